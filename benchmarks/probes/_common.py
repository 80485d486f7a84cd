"""Pieces shared by the decode-path probe scripts (`scripts/probe_{decode_paths,copy_issue,decode_host,dispatch}.py`).

Contract:
- `expert_shape_parser(description, reps)` -> an argparse parser with the expert shape (--hidden, --intermediate,
  DeepSeek-V2-Lite's by default), --experts (how many experts per measurement), --reps and --out;
- `random_experts(d, f, k)` -> (gate_ups, downs): k seeded random bf16 numpy arrays [D, 2F] and [F, D];
- `many_experts(x, gate_ups, downs)` -> the f32 sum of k experts' FFN over x (jit it; one program for k experts);
- `probe_result(what, devices, records, out, **extra)` -> the result dict (the command line, accelerator and jax
  version, then `extra`, e.g. the expert shape, then the records), also written as JSON to `out` when given.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.models.layers import expert_ffn


def expert_shape_parser(description: str, reps: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def random_experts(d: int, f: int, k: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    gate_ups = [(rng.standard_normal((d, 2 * f)) * 0.02).astype(jnp.bfloat16) for _ in range(k)]
    downs = [(rng.standard_normal((f, d)) * 0.02).astype(jnp.bfloat16) for _ in range(k)]
    return gate_ups, downs


def many_experts(x, gate_ups, downs):
    return sum(expert_ffn(x, gu, dn).astype(jnp.float32) for gu, dn in zip(gate_ups, downs))


def probe_result(what: str, devices, records: list[dict], out: Path | None, **extra) -> dict:
    result = {"what": what, "command": "python3 " + " ".join(shlex.quote(a) for a in sys.argv),
              "accelerator": str(devices.accel), "jax": jax.__version__, **extra, "records": records}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result
