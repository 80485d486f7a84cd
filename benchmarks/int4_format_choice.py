"""Which int4 format: relative error of group sizes 32 / 64 / 128, three rounding rules and two scale dtypes, on
the embedded reference MoE's trained experts and on Gaussian matrices, beside the bits each costs a weight.

Rules (symmetric unless named): "sym-8": scale = -(the group's value of largest magnitude) / 8, integers in
[-8, 7] (the extreme lands on -8); "sym7": scale = max|w| / 7, integers in [-7, 7]; "asym": min/max with a zero
point, 16 levels (4 more bits a group). Scales float32 or bfloat16 (rounded before the integers are chosen).
Pure numpy in float64: the error of the format, not of a kernel. Writes a JSON (command, commit, machine) to --out.
Usage: python benchmarks/int4_format_choice.py [--out benchmarks/results/int4_format_choice.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from _shared import REPO, command_line


def quantized(w: np.ndarray, group: int, rule: str, scale_dtype: str) -> np.ndarray:
    """w [..., K, N] -> its int4 approximation under one format."""
    *lead, k, n = w.shape
    g = w.reshape(*lead, k // group, group, n)

    def stored(scale):
        if scale_dtype == "bfloat16":
            import ml_dtypes

            scale = scale.astype(ml_dtypes.bfloat16).astype(np.float64)
        return np.where(scale == 0, 1.0, scale)

    if rule == "sym-8":
        pick = np.take_along_axis(g, np.abs(g).argmax(-2)[..., None, :], -2)
        s = stored(-pick / 8)
        out = np.clip(np.round(g / s), -8, 7) * s
    elif rule == "sym7":
        s = stored(np.abs(g).max(-2, keepdims=True) / 7)
        out = np.clip(np.round(g / s), -7, 7) * s
    else:
        lo, hi = g.min(-2, keepdims=True), g.max(-2, keepdims=True)
        s = stored((hi - lo) / 15)
        z = np.round(-lo / s)
        out = (np.clip(np.round(g / s) + z, 0, 15) - z) * s
    return out.reshape(w.shape)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/int4_format_choice.json")
    args = p.parse_args(argv)
    import jax

    import pdscope_jax
    from pdscope_jax import models

    sys.path.insert(0, str(REPO / "benchmarks"))
    from start_times import commit, machine

    reference = pdscope_jax.load("reference-moe", dtype="float32", compile_cache=False)
    sets = {
        "reference-moe experts (trained)": [np.asarray(v, np.float64)
                                            for p, v in models.to_flat(reference.model).items()
                                            if p.endswith((".experts.gate_up", ".experts.down"))],
        "gaussian [8, 512, 256]": [np.asarray(jax.random.normal(jax.random.key(0), (8, 512, 256)), np.float64)],
    }
    rows = []
    for name, mats in sets.items():
        for group in (32, 64, 128):
            usable = [w for w in mats if w.shape[-2] % group == 0]
            if not usable:
                continue
            for rule in ("sym-8", "sym7", "asym"):
                for scale_dtype in ("float32", "bfloat16"):
                    err = float(np.mean([np.linalg.norm(quantized(w, group, rule, scale_dtype) - w) / np.linalg.norm(w)
                                         for w in usable]))
                    bits = 4 + (32 if scale_dtype == "float32" else 16) / group + (4 / group if rule == "asym" else 0)
                    rows.append({"matrices": name, "group": group, "rule": rule, "scale_dtype": scale_dtype,
                                 "relative_error": round(err, 5), "bits_per_weight": round(bits, 4)})
                    print(f"{name:34s} g{group:<4d} {rule:6s} {scale_dtype:9s} rel.err {err:.4f}  bits {bits:.3f}")
    report = {"command": command_line(__file__, argv if argv is not None else sys.argv[1:]), "commit": commit(),
              "machine": machine(), "weights": "the embedded reference MoE's trained experts; seeded Gaussian",
              "note": "reference-moe's contraction sizes are 160 and 64: group 128 divides neither", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
