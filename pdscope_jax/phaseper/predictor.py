"""PhasePer predictor networks (Flax NNX) and the set of them for a model.

Contract
- One network per MoE layer l (all but the last) and phase: `f_l(a_l [N,D], w_l [N,K], e_l [N,K]) ->
  logits [N,E]` over the experts of the next MoE layer (sigmoid gives per-expert activation probabilities).
- Features: LayerNorm(a) projected to `proj_dim`, concatenated with the routing-weighted multi-hot of e
  and the plain multi-hot of e: [N, proj_dim + 2E]. With `hp.linear`, a linear map of a itself is added to the
  logits (the next layer's gate, a linear function of a, is then one of the functions it can represent).
- `ShallowPredictor` (input and output groups): one hidden layer.
  `DeepPredictor` (middle group): the same stem, then a residual block whose output is modulated by a gate
  on the attention output, `x + sigmoid(Linear(a)) * block(x)`, then the head.
- `PredictorSet` holds every (phase, layer) predictor as an NNX (graphdef, state) pair: `nnx.split` once,
  and `predict` / `logits` run one plain `jax.jit` function on (graphdef, state), compiled once per
  network kind and power-of-two token bucket (inputs are zero-padded up to it). `set_state` swaps a
  predictor's parameters in one assignment (atomic for readers in other threads). It never touches model
  weights or their placement.

Letters: N tokens, D attention-output width, K top-k, E experts, P projection width, H hidden width.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.phaseper.groups import group_of
from pdscope_jax.phaseper.traces import PHASES


@dataclasses.dataclass(frozen=True)
class PredictorHParams:
    """Architecture hyper-parameters; at D=2048, E=64 the defaults give 1.8 MB (shallow) / 3.7 MB (deep)."""

    dim: int  # D
    k: int  # K
    num_experts: int  # E
    proj_dim: int = 128  # P
    hidden: int = 192  # H
    linear: bool = True  # a linear path from a to the logits beside the network (the next gate is linear in a)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def encode_experts(w: jax.Array, e: jax.Array, num_experts: int) -> jax.Array:
    """[N, 2E]: routing-weighted multi-hot of e, then plain multi-hot."""
    one_hot = jax.nn.one_hot(e, num_experts, dtype=jnp.float32)  # [N, K, E]
    weighted = jnp.einsum("nk,nke->ne", w.astype(jnp.float32), one_hot)  # [N, E]
    plain = jnp.minimum(one_hot.sum(axis=1), 1.0)  # [N, E]
    return jnp.concatenate([weighted, plain], axis=-1)


class _Stem(nnx.Module):
    def __init__(self, hp: PredictorHParams, rngs: nnx.Rngs):
        self.num_experts = hp.num_experts
        self.norm = nnx.LayerNorm(hp.dim, rngs=rngs)
        self.proj = nnx.Linear(hp.dim, hp.proj_dim, rngs=rngs)
        self.hidden = nnx.Linear(hp.proj_dim + 2 * hp.num_experts, hp.hidden, rngs=rngs)
        self.linear = nnx.Linear(hp.dim, hp.num_experts, rngs=rngs) if hp.linear else None

    def __call__(self, a_n: jax.Array, w: jax.Array, e: jax.Array) -> jax.Array:
        feats = jnp.concatenate([self.proj(a_n), encode_experts(w, e, self.num_experts)], axis=-1)  # [N, P+2E]
        return nnx.gelu(self.hidden(feats))  # [N, H]

    def direct(self, a: jax.Array) -> jax.Array | float:
        """[N, E] logits of the linear path on a as given (not normalised), or 0 without one."""
        return 0.0 if self.linear is None else self.linear(a.astype(jnp.float32))


class ShallowPredictor(nnx.Module):
    def __init__(self, hp: PredictorHParams, rngs: nnx.Rngs):
        self.stem = _Stem(hp, rngs)
        self.head = nnx.Linear(hp.hidden, hp.num_experts, rngs=rngs)

    def __call__(self, a: jax.Array, w: jax.Array, e: jax.Array) -> jax.Array:
        a_n = self.stem.norm(a.astype(jnp.float32))  # [N, D]
        return self.head(self.stem(a_n, w, e)) + self.stem.direct(a)  # [N, E]


class DeepPredictor(nnx.Module):
    def __init__(self, hp: PredictorHParams, rngs: nnx.Rngs):
        self.stem = _Stem(hp, rngs)
        self.block_in = nnx.Linear(hp.hidden, hp.hidden, rngs=rngs)
        self.block_out = nnx.Linear(hp.hidden, hp.hidden, rngs=rngs)
        self.gate = nnx.Linear(hp.dim, hp.hidden, rngs=rngs)
        self.head = nnx.Linear(hp.hidden, hp.num_experts, rngs=rngs)

    def __call__(self, a: jax.Array, w: jax.Array, e: jax.Array) -> jax.Array:
        a_n = self.stem.norm(a.astype(jnp.float32))  # [N, D]
        x = self.stem(a_n, w, e)  # [N, H]
        block = self.block_out(nnx.gelu(self.block_in(x)))  # [N, H]
        x = x + jax.nn.sigmoid(self.gate(a_n)) * block  # [N, H], gated residual
        return self.head(x) + self.stem.direct(a)  # [N, E]


def network_kind(group: str) -> str:
    return "deep" if group == "middle" else "shallow"


def build_network(kind: str, hp: PredictorHParams, seed: int) -> nnx.Module:
    cls = DeepPredictor if kind == "deep" else ShallowPredictor
    return cls(hp, nnx.Rngs(seed))


def param_bytes(state) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))


@partial(jax.jit, static_argnums=0)
def forward_logits(graphdef, state, a, w, e) -> jax.Array:
    """[N, E] logits of the network (graphdef, state); compiled once per graphdef and input shapes."""
    return nnx.merge(graphdef, state)(a, w, e)


@partial(jax.jit, static_argnums=0)
def _forward_probs(graphdef, state, a, w, e) -> jax.Array:
    return jax.nn.sigmoid(nnx.merge(graphdef, state)(a, w, e))


class PredictorSet:
    """All predictors of a model: layers[i] -> layers[i+1] for every phase (see the module docstring)."""

    def __init__(self, hp: PredictorHParams, layers: Iterable[int], groups: tuple[int, int], seed: int = 0):
        self.hp = hp
        self.moe_layers = tuple(int(l) for l in layers)  # every MoE layer, in order
        if len(self.moe_layers) < 3:
            raise ValueError("PredictorSet needs at least 3 MoE layers (three layer groups)")
        self.groups = (int(groups[0]), int(groups[1]))
        if not 1 <= self.groups[0] < self.groups[1] <= len(self.moe_layers) - 1:
            raise ValueError(f"groups {self.groups} must satisfy 1 <= input_end < middle_end <= "
                             f"{len(self.moe_layers) - 1} for {len(self.moe_layers)} MoE layers")
        self.graphdefs = {}
        self._states: dict[tuple[str, int], nnx.State] = {}
        for p_i, phase in enumerate(PHASES):
            for pos, layer in enumerate(self.source_layers):
                kind = network_kind(group_of(pos, self.groups))
                graphdef, state = nnx.split(build_network(kind, hp, seed + 1000 * p_i + pos))
                self.graphdefs[kind] = graphdef
                self._states[(phase, layer)] = state

    @property
    def source_layers(self) -> tuple[int, ...]:
        """Layers that have a predictor (every MoE layer but the last)."""
        return self.moe_layers[:-1]

    def next_layer(self, layer: int) -> int:
        return self.moe_layers[self.moe_layers.index(layer) + 1]

    def group(self, layer: int) -> str:
        return group_of(self.moe_layers.index(layer), self.groups)

    def kind(self, layer: int) -> str:
        return network_kind(self.group(layer))

    def graphdef(self, layer: int):
        return self.graphdefs[self.kind(layer)]

    def state(self, phase: str, layer: int) -> nnx.State:
        return self._states[(phase, layer)]

    def set_state(self, phase: str, layer: int, state: nnx.State) -> None:
        self._states[(phase, layer)] = state

    def to_device(self, device: jax.Device) -> "PredictorSet":
        """Move every predictor's parameters to `device` (where the model's hidden states are), in place."""
        self._states = {key: jax.device_put(state, device) for key, state in self._states.items()}
        return self

    def keys(self) -> list[tuple[str, int]]:
        return list(self._states)

    def _padded(self, a, w, e):
        """Inputs padded to the next power-of-two token count, so a few compiled shapes serve every N.
        Device arrays stay on their device (jnp), host arrays on the host (np) until the call."""
        xp = np if isinstance(a, np.ndarray) else jnp
        n = a.shape[0]
        pad = (1 << max(0, (n - 1).bit_length())) - n
        a, w, e = xp.asarray(a), xp.asarray(w, np.float32), xp.asarray(e, np.int32)
        if pad:
            a, w, e = (xp.pad(x, ((0, pad), (0, 0))) for x in (a, w, e))
        return n, a, w, e

    def logits(self, phase: str, layer: int, a, w, e) -> jax.Array:
        """[N, E] logits for the experts of `next_layer(layer)`."""
        n, a, w, e = self._padded(a, w, e)
        return forward_logits(self.graphdef(layer), self._states[(phase, layer)], a, w, e)[:n]

    def predict(self, phase: str, layer: int, a, w, e) -> np.ndarray:
        """[N, E] float32 activation probabilities of the next layer's experts (host numpy)."""
        n, a, w, e = self._padded(a, w, e)
        return np.asarray(_forward_probs(self.graphdef(layer), self._states[(phase, layer)], a, w, e))[:n]

    def sizes(self) -> dict[str, int]:
        """Bytes of parameters per network kind present in the set."""
        out = {}
        for (phase, layer), state in self._states.items():
            out[self.kind(layer)] = param_bytes(state)
        return out
