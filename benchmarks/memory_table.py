"""Host RAM and GPU budget per model and precision, derived from the presets (no weights, no device).

`model_bytes(name, dtype, max_seq_len, max_batch)` -> the bytes the offload engine plans for a published
preset: routed experts (they live once in pinned host memory), non-expert weights, KV cache, activations (the
upper estimate `store.budget.activation_bytes`, the same on every backend; the engine measures its own programs
on the backend it runs on, `engine.activations`, usually less) and transfer staging (the accelerator's fixed
part, from `engine.build.plan_budget`, the engine's own accounting),
and two GPU budgets: the smallest that runs (an empty slot pool: every expert on the CPU) and one whose pool
holds a quarter of the routed experts; plus the whole model on one GPU (`plain`), and the decode bank: the
experts device decode holds beyond the pool at any budget, in what prefill's activations and staging leave beside
the staging of its fill (`store.budget`). A precision is a dtype ("bfloat16", "float32") or a quantized scheme of
the routed experts ("int8", "int4": the rest of the model in bfloat16, as `load(..., quantize=)` builds it).
`main` prints a markdown table (or JSON with --json) for every preset at each of --precisions (default bfloat16,
int8, int4).

    python3 benchmarks/memory_table.py [--max-seq-len 4096] [--max-batch 1] [--precisions ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POOL_SHARE = 0.25  # the README's example: a slot pool for a quarter of the routed experts


def model_bytes(name: str, dtype: str = "bfloat16", max_seq_len: int = 4096, max_batch: int = 1) -> dict:
    """Planned bytes of preset `name` at precision `dtype` (a dtype or an expert scheme) with a KV cache for
    max_batch x max_seq_len (see module doc)."""
    from pdscope_jax import models
    from pdscope_jax.api import DTYPES
    from pdscope_jax.quant.formats import SCHEMES
    from pdscope_jax.engine.build import plan_budget, split_abstract
    from pdscope_jax.presets import preset
    from pdscope_jax.runtime import RuntimeConfig

    cfg = preset(name)
    if dtype in SCHEMES:  # quantized routed experts, the rest in bfloat16
        cfg = cfg.replace(expert_quant=dtype)
    abstract = models.abstract_model(cfg, DTYPES.get(dtype, DTYPES["bfloat16"]))
    _graph, _state, shapes = split_abstract(abstract)
    rc = RuntimeConfig(gpu_memory=10**15, expert_pool=0, policy="pdscope", max_seq_len=max_seq_len,
                       max_batch=max_batch, activation_memory="estimated")
    budget, _expert_dtype, _cache_dtype = plan_budget(cfg, rc, abstract, shapes)
    # the engine's own decode bank where the budget leaves no pool: what prefill's parts leave, less its fill's staging
    smallest, _, _ = plan_budget(cfg, rc.replace(gpu_memory=budget.fixed, expert_pool=None), abstract, shapes)
    experts = len(cfg.moe_layers) * cfg.num_experts * budget.slot_bytes
    pool = int(POOL_SHARE * len(cfg.moe_layers) * cfg.num_experts) * budget.slot_bytes
    return {"model": name, "dtype": dtype, "max_seq_len": max_seq_len, "max_batch": max_batch,
            "routed_experts": experts, "non_expert": budget.non_expert, "kv_cache": budget.kv_cache,
            "activations": budget.activations, "staging": budget.staging, "gpu_minimum": budget.fixed,
            "gpu_quarter_pool": budget.fixed + pool,
            "decode_bank": smallest.decode_bank,
            "plain_gpu": budget.non_expert + experts + budget.kv_cache + budget.activations}


def table(rows: list[dict]) -> str:
    gb = lambda n: f"{n / 1e9:.1f}"  # noqa: E731
    out = ["| model | precision | host RAM: pinned experts (GB) | GPU: non-expert weights + KV cache + "
           "activations + staging (GB) | GPU budget, smallest (GB) | GPU budget, pool of 1/4 of the experts (GB) | "
           "decode: more experts in the bank (GB) | whole model on one GPU (GB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['dtype']} | {gb(r['routed_experts'])} | {gb(r['non_expert'])} + "
                   f"{gb(r['kv_cache'])} + {gb(r['activations'])} + {gb(r['staging'])} | {gb(r['gpu_minimum'])} | "
                   f"{gb(r['gpu_quarter_pool'])} | {gb(r['decode_bank'])} | {gb(r['plain_gpu'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--precisions", nargs="+", default=["bfloat16", "int8", "int4"],
                        help="dtypes (bfloat16, float32) or expert schemes (int8, int4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from pdscope_jax.presets import PUBLISHED

    rows = [model_bytes(name, dtype, args.max_seq_len, args.max_batch)
            for name in PUBLISHED for dtype in args.precisions]
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
