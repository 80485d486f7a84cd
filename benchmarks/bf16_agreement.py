"""bfloat16 agreement of the offloaded policies with the plain model, per family, policy and CPU-kernel setting.

    python benchmarks/bf16_agreement.py [--new 256] [--prompts 3] [--prompt-len 24] [--slots 5] [--quick]
        [--out benchmarks/results/bf16_agreement_tiny_cpu.json]

Every family's tiny preset, random seeded weights in bfloat16, `--prompts` random prompts (batch 1): the plain
model (`Generator`) generates `--new` greedy tokens; so does the offload engine under every policy of
`sched.registry.COMPARED` with a pool of `--slots` expert slots (few: experts move and some run on the CPU), with
the CPU expert kernel on and off (`RuntimeConfig.cpu_kernel`). Per (family, policy, kernel): tokens before the
first divergence (per prompt and the least), the fraction of positions equal, and max |logit diff| over the
prompt. Runs on two CPU devices standing in for host and accelerator (`runtime.select_devices`); the JSON says
so. `--quick`: one family, one prompt, 32 tokens (a smoke test).
Output: JSON with `what`, `command`, `commit` (HEAD when the run started), `machine`, the settings and `rows`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _shared import REPO, command_line, commit

EXACT_FLAG = "--xla_allow_excess_precision=false"
MODES = {"default": "XLA's default (excess precision allowed)", "exact": f"XLA_FLAGS={EXACT_FLAG}"}
FAMILIES = ("tiny-deepseek-v2-lite", "tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b", "tiny-moonlight-16b-a3b")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bf16_agreement_tiny_cpu.json"


def _imports():
    """JAX and the package, imported once the mode's XLA_FLAGS are set (XLA reads them when it starts)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # before JAX is first used: a host and an "accelerator"
    import jax.numpy as jnp
    from flax import nnx

    from pdscope_jax import models
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.generation.generator import Generator
    from pdscope_jax.presets import preset
    from pdscope_jax.runtime import RuntimeConfig

    return jax, jnp, nnx, models, OffloadRunner, Generator, preset, RuntimeConfig


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """(tokens before the first difference, fraction of positions equal) of two token rows."""
    equal = a == b
    first = int(np.argmin(equal)) if not equal.all() else int(equal.size)
    return first, float(equal.mean())


def offload_config(RuntimeConfig, cfg, policy: str, slots: int, kernel: bool, max_seq_len: int):
    options = {"hot_per_layer": 2} if policy == "static" else {}
    return RuntimeConfig(gpu_memory="1GB", expert_pool=slots * cfg.expert_bytes(2), policy=policy,
                         policy_options=options, max_seq_len=max_seq_len, cpu_kernel=kernel)


def family_rows(name: str, args) -> list[dict]:
    _, jnp, nnx, models, OffloadRunner, Generator, preset, RuntimeConfig = _imports()
    cfg = preset(name)
    model = models.build(cfg, nnx.Rngs(args.seed), jnp.bfloat16)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, (1, args.prompt_len)).astype(np.int32) for _ in range(args.prompts)]
    plain = Generator(model)
    ref_logits = [plain.logits(p) for p in prompts]
    ref_tokens = [plain.generate(p, args.new).tokens[0] for p in prompts]
    rows = []
    for policy in args.policies:
        for kernel in (True, False):
            start = time.perf_counter()
            runner = OffloadRunner(model, offload_config(RuntimeConfig, cfg, policy, args.slots, kernel,
                                                         args.prompt_len + args.new + 8))
            firsts, fractions, logit_diff = [], [], 0.0
            for p, logits, tokens in zip(prompts, ref_logits, ref_tokens):
                logit_diff = max(logit_diff, float(np.abs(runner.logits(p) - logits).max()))
                first, fraction = agreement(runner.generate(p, args.new).tokens[0], tokens)
                firsts.append(first)
                fractions.append(fraction)
            stats = runner.stats
            rows.append({"mode": args.modes[0], "family": name, "policy": policy, "cpu_kernel": kernel,
                         "kernel_built": bool(runner.cpu_experts.kernel),
                         "first_divergence": firsts, "min_first_divergence": min(firsts),
                         "fraction_equal": float(np.mean(fractions)), "max_prompt_logit_diff": logit_diff,
                         "cpu_experts": {ph: stats[ph]["cpu_experts"] for ph in ("prefill", "decode")},
                         "seconds": round(time.perf_counter() - start, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_mode(args) -> list[dict]:
    """The rows of one mode, in this process (its XLA_FLAGS already set)."""
    if args.policies is None:
        from pdscope_jax.sched.registry import COMPARED

        args.policies = list(COMPARED)
    return [row for name in args.families for row in family_rows(name, args)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--slots", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--policies", nargs="+", default=None, help="default: sched.registry.COMPARED")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="default: XLA as it comes; exact: XLA_FLAGS=" + EXACT_FLAG + " (each mode in a child "
                         "process, since XLA reads its flags once)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # a child: rows JSON to --out
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.families, args.prompts, args.new = args.families[:1], 1, 32
    if args.rows_only:
        args.out.write_text(json.dumps(run_mode(args)))
        return
    head = commit()  # read before the run: the checkout's HEAD may move while it runs
    start, rows = time.perf_counter(), []
    for mode in args.modes:
        env = dict(os.environ)
        if mode == "exact":
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {EXACT_FLAG}".strip()
        with tempfile.TemporaryDirectory() as tmp:
            child = [a for a in argv if a != "--quick"]
            child = _without_option(_without_option(_without_option(child, "--modes"), "--out"), "--families")
            out = Path(tmp) / "rows.json"
            subprocess.run([sys.executable, __file__, *child, "--rows-only", "--modes", mode, "--out", str(out),
                            "--families", *args.families, "--prompts", str(args.prompts), "--new", str(args.new)],
                           env=env, check=True)
            rows += json.loads(out.read_text())
    cpus = os.cpu_count()
    result = {"what": "bf16 token agreement of the offloaded policies with the plain model (tiny presets, random "
                      "bfloat16 weights, greedy)",
              "command": command_line(__file__, argv), "commit": head,
              "weights": "random (seeded, tiny presets)",
              "machine": f"this CPU machine ({platform.machine()}, {cpus} cores; two JAX CPU devices stand in for "
                         "host and accelerator; no GPU)",
              "modes": {m: MODES[m] for m in args.modes},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k not in ("rows_only", "out")},
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def _without_option(argv: list[str], name: str) -> list[str]:
    """argv less `name` and the values after it (up to the next option)."""
    out, skipping = [], False
    for a in argv:
        if a == name:
            skipping = True
        elif skipping and not a.startswith("--"):
            continue
        else:
            skipping = False
            out.append(a)
    return out


if __name__ == "__main__":
    main()
