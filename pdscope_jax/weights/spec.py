"""Declarative map from checkpoint tensors to model parameters.

Contract: each model family publishes `checkpoint_sources(cfg) -> dict[str, Source]`, keyed by the
parameter's path in the model's NNX state (path parts joined with '.', e.g. 'layers.3.mlp.experts.gate_up').
A `Source` names the Hugging Face tensors that make that parameter and how they combine:

    keys[i][j]: outer index i stacks along a new leading axis (experts), inner index j concatenates along
    the last axis (gate and up projections fused into one matrix); a plain parameter is ((key,),).
    transpose: HF `nn.Linear` stores [out, in]; this package multiplies x @ W with W as [in, out].

The loader (`pdscope_jax.weights.checkpoint`) is the only code that reads tensors; this module only names them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Source:
    keys: tuple[tuple[str, ...], ...]
    transpose: bool = False
    stacked: bool = False  # True: keys' outer axis becomes the parameter's leading axis

    @classmethod
    def single(cls, key: str, transpose: bool = False) -> "Source":
        return cls(((key,),), transpose=transpose)

    @classmethod
    def stack(cls, keys: list[tuple[str, ...]], transpose: bool = False) -> "Source":
        return cls(tuple(tuple(k) for k in keys), transpose=transpose, stacked=True)

    def all_keys(self) -> list[str]:
        return [key for group in self.keys for key in group]
