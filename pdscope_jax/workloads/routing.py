"""Routing workloads for random-weight models, defined by statistics: "uniform" (equal expert shares, independent
consecutive layers) and "skewed" (expert popularity and inter-layer affinity of the trained reference MoE), each with a
`predictability` of the next layer's routing from this layer's state (`workloads.predictability`).

The reference MoE (`pdscope_jax/assets/reference-moe`) recorded its held-out routing when trained (package data
`assets/reference-moe-routing.json`: per-layer expert counts [12, 32], per layer pair the recall@K of an inter-layer
affinity table and of the K most popular experts). Per MoE layer of the target model (reference layers mapped by
relative depth, nearest index) the skewed workload reproduces (why: docs/MEASUREMENTS.md):
- popularity: the reference layer's sorted share curve resampled to E experts through its cumulative curve and capped at
  1/k per expert, assigned by a seeded permutation ("uniform": 1/E each);
- affinity: the reference's lift of affinity recall over popularity recall, `(r_aff - r_pop) / (1 - r_pop)` (about 0.29;
  "uniform": consecutive layers read disjoint parts of the code, so they are independent);
- predictability: the Fate-style predictor's recall@k ("reference": the reference's per pair; "oracle": exact).
Every policy and the plain model see one and the same model (a routing channel in the residual stream, see `Workload`),
so parity holds, nothing changes at run time, and a GGUF export of the weights routes the same.

Contract: `design(cfg, workload, seed=0, stats=None, ..., predictability="reference", cache=None) -> Workload`, kept on
disk by `workloads.cache` (keyed by every input of the fit; `cache=False` or PDSCOPE_WORKLOAD_CACHE=0: fit afresh, write
nothing; a missing, unreadable or mismatched file is fitted and written again); `Workload.transform(path, array) ->
array` rewrites one parameter (others pass through), `.loader(loader)` wraps an `OffloadRunner` loader, `.apply(flat)`
rewrites a flat parameter dict, `.experts(ids)` -> [M, N, K] the experts each token id picks per MoE layer,
`.fate_experts(ids)` -> [M-1, N, K] what the Fate-style predictor at each layer guesses for the next, and `.summary()`
the setting, targets and fitted values per layer (recorded in benchmark JSON next to `"workload"`).
`reference_stats(path=None)` reads the reference's routing statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from pdscope_jax.workloads import cache as design_cache
from pdscope_jax.workloads import predictability as pred

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
           calibration: int = 4096, predictability="reference", targets: dict | None = None,
           cache: bool | str | Path | None = None) -> "Workload":
    """The workload's model for `cfg`; `stats` / `targets` default to the package's reference data. `cache`: see
    `workloads.cache.cache_folder` (None: the environment's setting or the user cache folder; False: none)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    setting = pred.check_setting(predictability)
    if workload == "skewed" and stats is None:
        stats = reference_stats()
    fates = pred.pair_targets(setting, max(len(cfg.moe_layers) - 1, 0), targets)
    folder = design_cache.cache_folder(cache)
    if folder is None:
        return Workload.fit(cfg, workload, stats, seed, channel, calibration, setting, fates)
    key = design_cache.design_key(cfg, workload, seed, channel, calibration, setting, fates,
                                  stats if workload == "skewed" else None)  # uniform reads no statistics
    path = design_cache.path_for(folder, cfg, key)
    saved = design_cache.load(path, cfg)
    if saved is not None:
        return Workload(cfg=cfg, **saved)
    fitted = Workload.fit(cfg, workload, stats, seed, channel, calibration, setting, fates)
    design_cache.save(path, fitted)
    return fitted


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
    """The workload's model, the same for every policy and the plain model: the last `channel` hidden dimensions
    become a routing channel. The embedding writes a per-token code there (`channel - 1` seeded standard normal
    values and one constant, scaled to the embedding's own spread), and no layer writes into it (those columns of
    every attention output projection, dense and shared-expert down projection and routed expert down projection are
    zero), so the residual stream carries the code unchanged to every layer. The code's dimensions are the carried
    part (the first `carried`), three fresh groups of `fresh` each (group j % 3 is MoE layer j's), and the constant.
    MoE layer j's post-attention norm has weight 0 on layer j+1's fresh group (1 elsewhere), so layer j's MoE input
    shows nothing of it. Each router reads only the channel: kernel rows `cos(phi_j) A_j` on what layer j-1's MoE
    input shows (skewed: the carried part and layer j-1's fresh group; uniform: half j % 2 of the carried part),
    `sin(phi_j) B_j` on its own fresh group, `b_j` on the constant, zero elsewhere (A, B unit-norm columns). RMSNorm
    only rescales a token's channel by a positive factor, and every family's expert choice (softmax top-k, group-
    limited greedy, sigmoid with the zero correction bias of random init at n_group 1) depends only on the order of
    the logits, so the experts a token picks at layer j are exactly top-k(code_t @ rows_j): a function of the token
    id, the same in prefill and decode, fitted offline in numpy over the calibration tokens (the vocabulary, or a
    seeded sample of `calibration` ids), i.e. for prompts drawn uniformly from the vocabulary, as the benchmarks
    draw them:
    - shares: b_j by fixed-point iteration `b += log(target share) - log(measured share)`;
    - affinity (skewed): `A_{j+1} = cos(theta) A_j P + sin(theta) G` (P a seeded permutation of experts, G fresh
      Gaussian), theta bisected to the target lift; uniform: A_j lives on half j % 2 of the carried part, so
      consecutive layers read disjoint, independent parts of the code;
    - predictability: phi_{j+1} bisected so that top-k of layer j+1's gate on layer j's MoE input
      (`cos(phi) A + b`: the fresh group is masked) has the target recall@k (`workloads.predictability`); "oracle"
      keeps phi = 0 and no fresh groups (the skewed weights of the design before predictability, bit for bit).
    Decode: greedy tokens would otherwise repeat (random weights loop on a few ids, so decode routed few experts
    and cached runtimes hit almost always), so the lm_head reads only the channel: column `successor[t]` is token
    t's code (its Gaussian part, unit norm), so the greedy token after t is `successor[t]` (one seeded cycle
    through the vocabulary; at bf16 near-ties a neighbour's) and decode walks the vocabulary as prompts sample it. Not
    with tied embeddings (the embedding is the lm_head there; `successor` None)."""

    name: str
    cfg: object
    channel: int  # routing channel width (the last `channel` hidden dimensions)
    codes: np.ndarray  # [V, channel] float32: per-token code, last column the constant 1
    rows: dict[int, np.ndarray]  # MoE layer -> [channel, E] router rows over the channel
    masks: dict[int, np.ndarray]  # MoE layer -> [channel] post-attention norm weight there (empty: not rewritten)
    report: list[dict]  # per MoE layer: targets and fitted values
    predictability: object = "oracle"
    layout: dict = dataclasses.field(default_factory=dict)
    successor: np.ndarray | None = None  # [V] int32: token t's greedy successor (None: lm_head not rewritten)

    @classmethod
    def fit(cls, cfg, name: str, stats: dict | None, seed: int, channel: int, calibration: int,
            predictability, fates: list) -> "Workload":
        e, k, layers = cfg.num_experts, cfg.num_experts_per_tok, list(cfg.moe_layers)
        channel = min(channel, cfg.hidden_size // 4)
        fresh = 0 if predictability == "oracle" else max(1, (channel - 1) // 5)
        carried = channel - 1 - 3 * fresh
        if carried < 2 or (name == "uniform" and carried < 4):
            raise ValueError(f"hidden size {cfg.hidden_size} leaves no routing channel")
        rng = np.random.default_rng(seed)
        codes = np.concatenate([rng.standard_normal((cfg.vocab_size, channel - 1)),
                                np.ones((cfg.vocab_size, 1))], axis=1).astype(np.float32)
        sample = np.arange(cfg.vocab_size)
        if sample.size > calibration:
            sample = np.sort(rng.choice(sample, calibration, replace=False))
        z = codes[sample, :-1].astype(np.float64)  # [N, channel-1]
        fresh_rng = np.random.default_rng([seed, 1])

        def group(j):  # fresh group of MoE layer j: three in turn, so layer j+1 can read layer j's
            return np.arange(carried + (j % 3) * fresh, carried + (j % 3 + 1) * fresh)

        m = len(layers)
        rows, masks, report = {}, {}, []
        prev_full = prev_ids = prev_target = None
        for j, layer in enumerate(layers):
            if name == "uniform":  # consecutive layers read disjoint halves: independent by construction
                known = np.arange(carried // 2) if j % 2 == 0 else np.arange(carried // 2, carried)
            else:  # the carried part, and the previous layer's fresh group, which this layer's input shows
                known = np.concatenate([np.arange(carried), group(j - 1) if j else []]).astype(int)
            fit = _LayerFit(z[:, known], z[:, group(j)], k, e)
            entry = {"layer": layer}
            if name == "skewed":
                ref_counts = np.asarray(stats["counts"], np.float64)
                ref_layer = round(j * (len(ref_counts) - 1) / max(m - 1, 1))
                target = np.zeros(e)
                target[rng.permutation(e)] = _resample_shares(ref_counts[ref_layer], e, k)
                entry["reference_layer"] = ref_layer
            else:
                target = np.full(e, 1.0 / e)
            g = _unit_columns(rng.standard_normal((channel - 1, e))[known])
            fit.fresh_rows = _unit_columns(fresh_rng.standard_normal((fresh, e))) if fresh else np.zeros((0, e))
            entry["target_top_quarter_share"] = top_quarter_share(target)
            goal = fates[j - 1] if j else None
            if j and goal is not None:
                fit.phi = pred.fit_angle(lambda phi: fit.recall(g, target, phi), goal)
            if prev_full is None or name == "uniform":
                a = g
                b = _fit_offsets(fit.logits(a), target, k, np.zeros(e), 200)
            else:
                t = round((j - 1) * (len(stats["affinity_recall_at_k"]) - 1) / max(m - 2, 1))
                r_aff, r_pop = stats["affinity_recall_at_k"][t], stats["popularity_recall_at_k"][t]
                lift = (r_aff - r_pop) / (1.0 - r_pop)
                # expert of popularity rank r here carries the affinity of rank r at the previous layer
                carry = np.empty((known.size, e))
                carry[:, np.argsort(-target, kind="stable")] = \
                    prev_full[known][:, np.argsort(-prev_target, kind="stable")]
                a, b, theta = _fit_affinity(fit, carry, g, target, k, lift, prev_ids, e)
                if goal is not None:  # the affinity's columns shift the recall a little: settle phi again
                    fit.phi = pred.fit_angle(lambda phi: fit.recall(a, target, phi), goal)
                    b = _fit_offsets(fit.logits(a), target, k, b, 120)
                entry.update(reference_pair=t, target_lift=lift, theta=theta)
            ids = _choices(fit.logits(a) + b, k)
            fitted = shares(ids, e)
            entry.update(top_quarter_share=top_quarter_share(fitted),
                         max_share_error=float(np.abs(fitted - target).max()))
            if prev_ids is not None:
                entry.update(lift=affinity_lift(prev_ids, ids, e)[2], phi=fit.phi, target_fate_recall=goal,
                             fate_recall=pred.fate_recall(fit.known(a) + b, ids, k))
            full = np.zeros((channel, e))
            full[known] = math.cos(fit.phi) * a
            full[group(j)] = math.sin(fit.phi) * fit.fresh_rows
            full[-1] = b
            rows[layer] = full.astype(np.float32)
            if fresh:  # hide the next layer's fresh group from this layer's MoE input
                masks[layer] = np.ones(channel, np.float32)
                masks[layer][group(j + 1)] = 0.0
            report.append(entry)
            prev_full, prev_ids, prev_target = full[:-1], ids, target
        successor = None
        if not cfg.tie_word_embeddings:  # one cycle through a seeded order: no token comes back before all did
            order = np.random.default_rng([seed, 2]).permutation(cfg.vocab_size)
            successor = np.empty(cfg.vocab_size, np.int32)
            successor[order] = np.roll(order, -1)
        return cls(name, cfg, channel, codes, rows, masks, report, predictability,
                   {"carried": carried, "fresh_per_group": fresh, "fresh_groups": 3 if fresh else 0, "constant": 1},
                   successor)

    # ---- the weights ------------------------------------------------------------------------------------
    def transform(self, path: str, array):
        """One parameter of the workload's model from its random-init value (a jax array, computed where it lives;
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
        layer = _norm_layer(path)
        if layer is not None and layer in self.masks:
            return array.at[-c:].multiply(jnp.asarray(self.masks[layer], array.dtype))
        if path == "lm_head.kernel" and self.successor is not None:
            return jnp.zeros_like(array).at[-c:].set(jnp.asarray(self.successor_rows(), array.dtype))
        return array

    def successor_rows(self) -> np.ndarray:
        """[channel, V] the lm_head's rows over the channel: column successor[t] = token t's unit Gaussian code."""
        rows = np.zeros((self.channel, self.codes.shape[0]), np.float32)
        rows[:-1, self.successor] = _unit_columns(self.codes[:, :-1].T.astype(np.float64))
        return rows

    def apply(self, flat: dict) -> dict:
        """A flat parameter dict of the workload's model (a new dict; the input is not modified)."""
        return {path: self.transform(path, value) for path, value in flat.items()}

    def loader(self, loader):
        """Wrap `loader(paths, placement) -> {path: array}` so that it returns the workload's values."""
        def rewritten(paths, placement):
            return {p: self.transform(p, v) for p, v in loader(paths, placement).items()}

        return rewritten

    def _logits(self, token_ids, layer: int, seen_at: int | None = None) -> np.ndarray:
        z = self.codes[np.asarray(token_ids).reshape(-1)].astype(np.float64)
        if seen_at is not None and seen_at in self.masks:
            z = z * self.masks[seen_at]
        return z @ self.rows[layer].astype(np.float64)

    def experts(self, token_ids) -> np.ndarray:
        """[M, N, K] the experts each token id picks at each MoE layer (sorted per token)."""
        k = self.cfg.num_experts_per_tok
        return np.stack([np.sort(_choices(self._logits(token_ids, layer), k), axis=1)
                         for layer in self.cfg.moe_layers])

    def fate_experts(self, token_ids) -> np.ndarray:
        """[M-1, N, K] top-k of MoE layer j+1's gate on layer j's MoE input (the Fate-style guess), sorted."""
        k, layers = self.cfg.num_experts_per_tok, list(self.cfg.moe_layers)
        return np.stack([np.sort(_choices(self._logits(token_ids, nxt, seen_at=cur), k), axis=1)
                         for cur, nxt in zip(layers, layers[1:])])

    def summary(self) -> dict:
        pairs = [entry for entry in self.report if "fate_recall" in entry]
        targets = [entry["target_fate_recall"] for entry in pairs]
        return {"workload": self.name, "predictability": self.predictability, "channel": self.channel,
                "layout": self.layout, "layers": self.report,
                "decode": ("greedy tokens walk one seeded cycle through the vocabulary (the lm_head reads the channel)"
                           if self.successor is not None else "generated tokens (tied embeddings: lm_head as drawn)"),
                "fate_recall_mean": float(np.mean([e["fate_recall"] for e in pairs])) if pairs else None,
                "target_fate_recall_mean": float(np.mean(targets)) if pairs and None not in targets else None,
                "source": [REFERENCE_RESULTS.name, pred.REFERENCE_PREDICTABILITY.name]}


class _LayerFit:
    """One MoE layer's logits as a function of its mixing angle: `cos(phi) carried @ a + sin(phi) fresh @ rows`
    without the offsets; `known` is what the previous layer's MoE input shows of them (the carried part)."""

    def __init__(self, carried: np.ndarray, fresh: np.ndarray, k: int, e: int):
        self.carried, self.fresh, self.k, self.e = carried, fresh, k, e
        self.fresh_rows = np.zeros((fresh.shape[1], e))
        self.phi = 0.0

    def known(self, a: np.ndarray, phi: float | None = None) -> np.ndarray:
        return math.cos(self.phi if phi is None else phi) * (self.carried @ a)

    def logits(self, a: np.ndarray, phi: float | None = None) -> np.ndarray:
        phi = self.phi if phi is None else phi
        out = self.known(a, phi)
        return out + math.sin(phi) * (self.fresh @ self.fresh_rows) if self.fresh.shape[1] else out

    def recall(self, a: np.ndarray, target: np.ndarray, phi: float) -> float:
        """The Fate-style recall@k at angle phi, offsets refitted to the target shares."""
        logits = self.logits(a, phi)
        b = _fit_offsets(logits, target, self.k, np.zeros(self.e), 40)
        return pred.fate_recall(self.known(a, phi) + b, _choices(logits + b, self.k), self.k)


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


def _fit_affinity(fit: "_LayerFit", carried, fresh, target, k, lift, prev_ids, e, steps: int = 8):
    """Bisect theta so that the lift of layer l -> l+1 matches `lift`; (A, b, theta) of the next layer."""
    def build(theta):
        a = _unit_columns(math.cos(theta) * carried + math.sin(theta) * fresh)
        b = _fit_offsets(fit.logits(a), target, k, np.zeros(e), 40)
        return a, b, affinity_lift(prev_ids, _choices(fit.logits(a) + b, k), e)[2]

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
    return a, _fit_offsets(fit.logits(a), target, k, b, 120), theta


def _router_layer(path: str) -> int | None:
    """Decoder-layer index of a router kernel path 'layers.<i>.mlp.gate.kernel', else None."""
    parts = path.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[2:] == ["mlp", "gate", "kernel"]:
        return int(parts[1])
    return None



def _norm_layer(path: str) -> int | None:
    """Decoder-layer index of a post-attention norm path 'layers.<i>.post_attention_layernorm.weight', else None."""
    parts = path.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2:] == ["post_attention_layernorm", "weight"]:
        return int(parts[1])
    return None
