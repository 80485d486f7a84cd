"""Quantize routed experts as a model's weights arrive.

Contract: `quantizing_loader(loader, quant)` wraps a weights loader of the dense model (`loader(paths, placement)
-> {path: array}`, as `weights.checkpoint.checkpoint_loader` and the random-weights loader are) into one of the
quantized model (`ModelConfig.expert_quant = quant`): a routed-expert matrix is asked for by its integer path
(`layers.L.mlp.experts.gate_up`, `.down`) and/or its scale path (the same + `_scale`); the wrapper loads the dense
stack once, quantizes it where `placement` put it (a jitted program, expert by expert, so a GPU quantizes on the
GPU) and returns the parts asked for. Every other path passes through. Each dense stack is loaded by itself and
dropped once quantized, so at most one is held at a time, also when every parameter is asked for at once.
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
    # expert by expert (lax.map): the float32 working copy is one expert's, not the stack's
    return jax.jit(lambda w: jax.lax.map(lambda expert: quantize(expert, name), w))


def quantizing_loader(loader, quant: str):
    quantize_stack = _quantizer(scheme(quant).name)

    def load(paths, placement):
        paths = list(paths)
        dense = {p: dense_path(p) for p in paths}
        out = loader([p for p in paths if dense[p] is None], placement)
        # one dense expert matrix at a time, even when every parameter is asked for at once (the plain model)
        for base in sorted({d for d in dense.values() if d is not None}):
            w = quantize_stack(loader([base], placement).pop(base))
            for p in (base, base + SCALE):
                if p in dense:
                    out[p] = w.q if p == base else w.scale
            del w
        return out

    return load
