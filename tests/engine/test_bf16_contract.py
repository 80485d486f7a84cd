"""The bfloat16 contract of the offload engine against the plain model.

With XLA's excess precision off (`XLA_FLAGS=--xla_allow_excess_precision=false`, which XLA reads once per
process, hence a child process), every offloaded policy reproduces the plain model's bf16 prompt logits exactly
and its first greedy tokens, with the CPU expert kernel on and off, on tiny DeepSeek-V2-Lite. (Over 256 tokens
and the other families the kernel, which does not round each expert's output, parts from the plain model:
benchmarks/bf16_agreement.py measures it; the README states the contract.) With XLA's default, each program may
keep bf16 intermediates in float32, so programs split differently round differently: the prompt logits stay
within a bf16 tolerance. Random bf16 weights, a pool of 5 slots (experts move, some run on the CPU).
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax import models
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.generation.generator import Generator
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig
from pdscope_jax.sched.registry import COMPARED

NEW = 24  # greedy tokens compared
DEFAULT_LOGIT_TOL = 0.25  # |logit diff| on the prompt with XLA's default precision (measured max 0.04)

CHILD = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_bf16_contract import compare
print("RESULT " + json.dumps(compare(sys.argv[2:])))
"""


def compare(policies, generate: bool = True) -> dict:
    """{policy/kernel: (max |prompt logit diff|, offloaded tokens == plain tokens, experts run on the CPU)} for tiny
    DeepSeek in bf16; without `generate` only the prompt logits are compared (the other two None)."""
    cfg = preset("tiny-deepseek-v2-lite")
    model = models.build(cfg, nnx.Rngs(0), jnp.bfloat16)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 20)).astype(np.int32)
    plain = Generator(model)
    logits = plain.logits(ids)
    tokens = plain.generate(ids, NEW).tokens if generate else None
    out = {}
    for policy in policies:
        for kernel in (True, False):
            options = {"hot_per_layer": 2} if policy == "static" else {}
            runner = OffloadRunner(model, RuntimeConfig(
                gpu_memory="1GB", expert_pool=5 * cfg.expert_bytes(2), policy=policy, policy_options=options,
                max_seq_len=64, cpu_kernel=kernel))
            diff = float(np.abs(runner.logits(ids) - logits).max())
            if not generate:
                out[f"{policy}/{kernel}"] = (diff, None, None)
                continue
            gen = runner.generate(ids, NEW)
            cpu = runner.stats["prefill"]["cpu_experts"] + runner.stats["decode"]["cpu_experts"]
            out[f"{policy}/{kernel}"] = (diff, bool(np.array_equal(gen.tokens, tokens)), cpu)
    return out


def test_exact_without_excess_precision():
    # joined to the suite's flags (LLVM's optimisations off: compile time) rather than replacing them
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false".strip())
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", CHILD, here, *COMPARED], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(result) == 2 * len(COMPARED)
    assert any(cpu > 0 for _, _, cpu in result.values())  # some experts ran on the CPU
    for case, (diff, same_tokens, _) in result.items():
        assert diff == 0.0, (case, diff)
        assert same_tokens, case


def test_default_precision_within_bf16_tolerance():
    # both policies in one call: they share the model, the plain logits and most compiled programs; the tokens
    # are not compared here (the exact test does), so none are generated
    result = compare(["static", "pdscope"], generate=False)
    assert len(result) == 4
    for case, (diff, _, _) in result.items():
        assert diff <= DEFAULT_LOGIT_TOL, (case, diff)
