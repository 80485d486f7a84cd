"""Quantize routed experts as a model's weights arrive.

Contract: `quantizing_loader(loader, quant)` wraps a weights loader of the dense model (`loader(paths, placement)
-> {path: array}`, as `weights.checkpoint.checkpoint_loader` and the random-weights loader are) into one of the
quantized model (`ModelConfig.expert_quant = quant`): a routed-expert matrix is asked for by its integer path
(`layers.L.mlp.experts.gate_up`, `.down`) and/or its scale path (the same + `_scale`); the wrapper loads the dense
stack once, quantizes it where `placement` put it (a jitted program, so a GPU quantizes on the GPU) and returns
the parts asked for. Every other path passes through. The dense stack is dropped as soon as it is quantized, so a
caller that asks layer by layer (the offload engine) holds at most one dense layer at a time.
"""

from __future__ import annotations

import functools

import jax

from pdscope_jax.quant.formats import quantize, scheme

SCALE = "_scale"
EXPERT_MATRICES = (".mlp.experts.gate_up", ".mlp.experts.down")


def dense_path(path: str) -> str | None:
    """The dense expert matrix a quantized model's path stands for, or None for any other parameter."""
    base = path.removesuffix(SCALE)
    return base if base.endswith(EXPERT_MATRICES) else None


@functools.lru_cache(maxsize=None)
def _quantizer(name: str):
    return jax.jit(lambda w: quantize(w, name))


def quantizing_loader(loader, quant: str):
    quantize_stack = _quantizer(scheme(quant).name)

    def load(paths, placement):
        paths = list(paths)
        dense = {p: dense_path(p) for p in paths}
        wanted = [p for p in paths if dense[p] is None] + sorted({d for d in dense.values() if d is not None})
        values = loader(wanted, placement)
        out = {p: values.pop(p) for p in paths if dense[p] is None}
        for base in sorted({d for d in dense.values() if d is not None}):
            w = quantize_stack(values.pop(base))
            for p in (base, base + SCALE):
                if p in dense:
                    out[p] = w.q if p == base else w.scale
            del w
        return out

    return load
