"""Routing workloads for random-weight models: "uniform" (the weights as generated) and "skewed" (routers set so
that expert popularity and inter-layer affinity look like what the trained reference MoE learned).

Why: seeded random weights route nearly uniformly and without inter-layer structure, which no trained MoE does,
and which hides exactly what hot-expert tables and cross-layer prediction exploit. The reference MoE
(`pdscope_jax/assets/reference-moe`) recorded its held-out routing when it was trained
(`scripts/train_reference_moe.py`), shipped as package data in `pdscope_jax/assets/reference-moe-routing.json`
("routing_heldout": per-layer expert counts [12, 32], and per layer pair the recall@K of an inter-layer affinity
table against the recall@K of always guessing the K most popular experts). The skewed workload reproduces, per
MoE layer of the target model (reference layers mapped by relative depth, nearest index):
- popularity: the reference layer's sorted share curve (share of top-k assignments by expert rank), resampled to
  E experts through its cumulative curve (so the top-quarter share carries over exactly when 4 divides E) and
  capped at 1/k per expert (an expert is chosen at most once per token), assigned by a seeded permutation;
- affinity: the reference's lift of affinity recall over popularity recall, `(r_aff - r_pop) / (1 - r_pop)`,
  which unlike raw recall is comparable across expert counts and top-k (the reference: about 0.29).
Every policy and the plain model see one and the same model (a routing channel in the residual stream, see
`Workload`), so parity holds and nothing changes at run time.

Contract: `design(cfg, workload, seed=0, stats=None) -> Workload | None` (None for "uniform");
`Workload.transform(path, array) -> array` rewrites one parameter (others pass through), `Workload.loader(loader)`
wraps an `OffloadRunner` loader, `Workload.apply(flat)` rewrites a flat parameter dict, `Workload.experts(ids)`
-> [M, N, K] the experts each token id picks per MoE layer, and `Workload.summary()` gives the targets and the
fitted values per layer (recorded in benchmark JSON next to `"workload"`). `reference_stats(path=None)` reads the
reference's routing statistics (default: the package's copy, so an installed package runs the skewed workload).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

WORKLOADS = ("uniform", "skewed")
REFERENCE_RESULTS = Path(__file__).resolve().parents[1] / "assets" / "reference-moe-routing.json"
_RESIDUAL_WRITERS = (".o_proj.kernel", ".o_proj.bias", ".down_proj.kernel", ".mlp.experts.down")


def reference_stats(path: str | Path | None = None) -> dict:
    """The reference MoE's held-out routing statistics ("routing_heldout" of its training results)."""
    path = Path(path) if path is not None else REFERENCE_RESULTS
    try:
        stats = json.loads(path.read_text())["routing_heldout"]
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: the reference MoE's training results are needed for the skewed workload "
                                "(pass their path)") from None
    for key in ("counts", "affinity_recall_at_k", "popularity_recall_at_k"):
        if key not in stats:
            raise ValueError(f"{path}: routing_heldout has no {key!r}")
    return stats


def design(cfg, workload: str, seed: int = 0, stats: dict | None = None, channel: int = 16,
           calibration: int = 4096) -> "Workload | None":
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if workload == "uniform":
        return None
    return Workload.fit(cfg, reference_stats() if stats is None else stats, seed, channel, calibration)


def _resample_shares(counts, e: int, k: int) -> np.ndarray:
    """Sorted (descending) share curve of `counts` resampled to e experts via its cumulative curve, capped at 1/k."""
    shares = -np.sort(-np.asarray(counts, np.float64))
    shares = shares / shares.sum()
    cum = np.concatenate(([0.0], np.cumsum(shares)))
    at = np.interp(np.arange(e + 1) / e, np.arange(shares.size + 1) / shares.size, cum)
    out = np.diff(at)
    for _ in range(e):  # water-filling: move what exceeds 1/k onto the experts below the cap
        over = out > 1.0 / k
        if not over.any():
            break
        excess = (out[over] - 1.0 / k).sum()
        out[over] = 1.0 / k
        under = ~over
        out[under] += excess * out[under] / out[under].sum() if out[under].sum() > 0 else excess / under.sum()
    return out


def _choices(logits: np.ndarray, k: int) -> np.ndarray:
    """[N, E] -> [N, K] the k largest per row (any order)."""
    return np.argpartition(-logits, k - 1, axis=1)[:, :k]


def _multi_hot(ids: np.ndarray, e: int) -> np.ndarray:
    out = np.zeros((ids.shape[0], e), np.float64)
    np.put_along_axis(out, ids, 1.0, axis=1)
    return out


def shares(ids: np.ndarray, e: int) -> np.ndarray:
    """[N, K] chosen experts -> [E] share of the assignments."""
    counts = np.bincount(ids.reshape(-1), minlength=e).astype(np.float64)
    return counts / max(counts.sum(), 1.0)


def top_quarter_share(share: np.ndarray) -> float:
    return float(-np.sort(-share)[: max(1, share.size // 4)].sum())


def affinity_lift(cur: np.ndarray, nxt: np.ndarray, e: int) -> tuple[float, float, float]:
    """(affinity recall@K, popularity recall@K, lift) of [N, K] choices at two consecutive layers: the reference's
    measures, except that the table is estimated and scored on the same tokens. The skewed routing is a fixed
    function of the token id and the calibration tokens are its whole population (the vocabulary, or a large
    sample), so this is the population's table; the reference's held-out halves guard a finite sample of a
    stochastic process, and on a 256-token vocabulary would mostly measure estimation noise."""
    k = cur.shape[1]
    a, b = _multi_hot(cur, e), _multi_hot(nxt, e)
    cond = a.T @ b / np.maximum(a.sum(0)[:, None], 1.0)  # P(j at l+1 | i at l)
    guess = np.argsort(-(a @ cond), axis=1, kind="stable")[:, :k]
    r_aff = float(np.take_along_axis(b, guess, axis=1).sum(1).mean() / k)
    popular = np.argsort(-b.sum(0), kind="stable")[:k]
    r_pop = float(b[:, popular].sum(1).mean() / k)
    return r_aff, r_pop, (r_aff - r_pop) / (1.0 - r_pop) if r_pop < 1.0 else 0.0


def _unit_columns(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=0, keepdims=True), 1e-12)


@dataclasses.dataclass
class Workload:
    """The skewed model, the same for every policy and the plain model: the last `channel` hidden dimensions become
    a routing channel. The embedding writes a per-token code there (`channel - 1` seeded standard normal values and
    one constant, scaled to the embedding's own spread), and no layer writes into it (those columns of every
    attention output projection, dense and shared-expert down projection and routed expert down projection are
    zero), so the residual stream carries the code unchanged to every layer. Each router reads only the channel: its
    kernel rows there are `[A_l; b_l]` (A_l [channel-1, E] unit-norm columns, b_l [E] per-expert offsets through the
    constant), its other rows zero. Post-attention RMSNorm only rescales a token's channel by a positive factor
    (random-init norms are ones), and every family's expert choice (softmax top-k, group-limited greedy, sigmoid
    with the zero correction bias of random init at n_group 1) depends only on the order of the logits, so the
    experts a token picks at layer l are exactly top-k(z_t A_l + b_l) for its code z_t: the routing is a function of
    the token id, the same in prefill and decode, and can be fitted offline in numpy:
    - `A_{l+1} = cos(theta_l) A_l P_l + sin(theta_l) G_{l+1}` (columns renormalised; P_l a seeded permutation of
      experts, G fresh Gaussian): tokens that pick expert i at layer l lean towards expert P_l(i) next; theta_l is
      bisected until the measured lift matches the target (theta = 0: fully determined, pi/2: independent);
    - b_l by fixed-point iteration `b += log(target share) - log(measured share)` over the calibration tokens.
    Calibration tokens are the vocabulary (a seeded sample of `calibration` ids when larger), i.e. the statistics
    hold for prompts drawn uniformly from the vocabulary, as the benchmarks draw them."""

    name: str
    cfg: object
    channel: int  # routing channel width (the last `channel` hidden dimensions)
    codes: np.ndarray  # [V, channel] float32: per-token code, last column the constant 1
    rows: dict[int, np.ndarray]  # MoE layer -> [channel, E] router rows over the channel
    report: list[dict]  # per MoE layer: targets and fitted values

    @classmethod
    def fit(cls, cfg, stats: dict, seed: int, channel: int, calibration: int) -> "Workload":
        e, k, layers = cfg.num_experts, cfg.num_experts_per_tok, list(cfg.moe_layers)
        channel = min(channel, cfg.hidden_size // 4)
        if channel < 2:
            raise ValueError(f"hidden size {cfg.hidden_size} leaves no routing channel")
        rng = np.random.default_rng(seed)
        codes = np.concatenate([rng.standard_normal((cfg.vocab_size, channel - 1)),
                                np.ones((cfg.vocab_size, 1))], axis=1).astype(np.float32)
        sample = np.arange(cfg.vocab_size)
        if sample.size > calibration:
            sample = np.sort(rng.choice(sample, calibration, replace=False))
        z = codes[sample, :-1].astype(np.float64)  # [N, channel-1]
        ref_counts = np.asarray(stats["counts"], np.float64)
        ref_aff, ref_pop = stats["affinity_recall_at_k"], stats["popularity_recall_at_k"]
        m = len(layers)
        rows, report = {}, []
        prev_a = prev_ids = prev_target = None
        for j, layer in enumerate(layers):
            ref_layer = round(j * (len(ref_counts) - 1) / max(m - 1, 1))
            target = np.zeros(e)
            target[rng.permutation(e)] = _resample_shares(ref_counts[ref_layer], e, k)
            g = _unit_columns(rng.standard_normal((channel - 1, e)))
            entry = {"layer": layer, "reference_layer": ref_layer,
                     "target_top_quarter_share": top_quarter_share(target)}
            if prev_a is None:
                a = g
                b = _fit_offsets(z @ a, target, k, np.zeros(e), 200)
            else:
                t = round((j - 1) * (len(ref_aff) - 1) / max(m - 2, 1))
                lift = (ref_aff[t] - ref_pop[t]) / (1.0 - ref_pop[t])
                # expert of popularity rank r here carries the affinity of rank r at the previous layer
                carried = np.empty_like(prev_a)
                carried[:, np.argsort(-target, kind="stable")] = prev_a[:, np.argsort(-prev_target, kind="stable")]
                a, b, theta = _fit_affinity(z, carried, g, target, k, lift, prev_ids, e)
                entry.update(reference_pair=t, target_lift=lift, theta=theta)
            ids = _choices(z @ a + b, k)
            fitted = shares(ids, e)
            entry.update(top_quarter_share=top_quarter_share(fitted),
                         max_share_error=float(np.abs(fitted - target).max()))
            if prev_ids is not None:
                entry["lift"] = affinity_lift(prev_ids, ids, e)[2]
            rows[layer] = np.concatenate([a, b[None]], axis=0).astype(np.float32)  # [channel, E]
            report.append(entry)
            prev_a, prev_ids, prev_target = a, ids, target
        return cls("skewed", cfg, channel, codes, rows, report)

    # ---- the weights ------------------------------------------------------------------------------------
    def transform(self, path: str, array):
        """One parameter of the skewed model from its random-init value (a jax array, computed where it lives;
        parameters the workload does not touch are returned as they are)."""
        import jax.numpy as jnp

        c = self.channel
        if path == "embed.embedding":
            body = array[:, :-c].astype(jnp.float32)
            scale = jnp.sqrt(jnp.mean(body * body))  # the embedding's own spread
            return array.at[:, -c:].set((jnp.asarray(self.codes) * scale).astype(array.dtype))
        if path.endswith(_RESIDUAL_WRITERS):
            return array.at[..., -c:].set(0)
        layer = _router_layer(path)
        if layer is not None and layer in self.rows:
            return jnp.zeros_like(array).at[-c:].set(jnp.asarray(self.rows[layer], array.dtype))
        return array

    def apply(self, flat: dict) -> dict:
        """A flat parameter dict of the skewed model (a new dict; the input is not modified)."""
        return {path: self.transform(path, value) for path, value in flat.items()}

    def loader(self, loader):
        """Wrap `loader(paths, placement) -> {path: array}` so that it returns the skewed model's values."""
        def skewed(paths, placement):
            return {p: self.transform(p, v) for p, v in loader(paths, placement).items()}

        return skewed

    def experts(self, token_ids) -> np.ndarray:
        """[M, N, K] the experts each token id picks at each MoE layer (sorted per token)."""
        z = self.codes[np.asarray(token_ids).reshape(-1)].astype(np.float64)
        out = [np.sort(_choices(z @ self.rows[layer].astype(np.float64), self.cfg.num_experts_per_tok), axis=1)
               for layer in self.cfg.moe_layers]
        return np.stack(out)

    def summary(self) -> dict:
        return {"workload": self.name, "channel": self.channel, "layers": self.report,
                "source": str(REFERENCE_RESULTS.name)}


def _fit_offsets(logits: np.ndarray, target: np.ndarray, k: int, b: np.ndarray, steps: int) -> np.ndarray:
    """Per-expert offsets b so that top-k(logits + b) hits each expert with share `target` (a damped fixed
    point; the best iterate by largest share error is kept)."""
    floor = 1e-4 / target.size
    b = b.copy()
    best = (np.inf, b.copy())
    for step in range(steps):
        measured = shares(_choices(logits + b, k), target.size)
        best = min(best, (float(np.abs(measured - target).max()), b.copy()), key=lambda x: x[0])
        b += 0.5 / (1 + step / 50) * (np.log(target + floor) - np.log(measured + floor))
        b -= b.max()
    return best[1]


def _fit_affinity(z, carried, fresh, target, k, lift, prev_ids, e, steps: int = 8):
    """Bisect theta so that the lift of layer l -> l+1 matches `lift`; (A, b, theta) of the next layer."""
    def build(theta):
        a = _unit_columns(math.cos(theta) * carried + math.sin(theta) * fresh)
        b = _fit_offsets(z @ a, target, k, np.zeros(e), 40)
        return a, b, affinity_lift(prev_ids, _choices(z @ a + b, k), e)[2]

    lo, hi = 0.0, math.pi / 2  # lift falls as theta grows
    a, b, got = build(lo)
    best = (abs(got - lift), lo, a, b)
    if got > lift:
        for _ in range(steps):
            mid = (lo + hi) / 2
            a, b, got = build(mid)
            best = min(best, (abs(got - lift), mid, a, b), key=lambda x: x[0])
            lo, hi = (mid, hi) if got > lift else (lo, mid)
    _, theta, a, b = best
    return a, _fit_offsets(z @ a, target, k, b, 120), theta


def _router_layer(path: str) -> int | None:
    """Decoder-layer index of a router kernel path 'layers.<i>.mlp.gate.kernel', else None."""
    parts = path.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[2:] == ["mlp", "gate", "kernel"]:
        return int(parts[1])
    return None

