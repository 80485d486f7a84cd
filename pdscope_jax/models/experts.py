"""Routed-expert math: one expert's FFN and the weighted sum over each token's top-k experts.

Contract:
- `expert_ffn(x [N,D], gate_up [D,2F], down [F,D]) -> [N,D]`, the one definition of a routed expert, lives in
  `kernels.expert_math` (beside the kernels that implement it) and is re-exported here.
- `combine_experts(x, weights, ids, gate_up [S,D,2F], down [S,F,D], slot_of [E])` sums `weights * expert_ffn`
  over the top-k experts that `slot_of` maps to a slot (>= 0) and ignores the rest. The plain model passes
  None (expert e in slot e), the offload engine its slot maps. Three exact paths, chosen statically by shape (few
  assignments: gather; many: sort + `jax.lax.ragged_dot`; very many per slot, or a pool of more slots than
  experts: tiles of one slot's rows); all agree within float32 tolerance. Each expert's output is rounded to
  x's dtype before it is weighted (as `expert_ffn` returns it); the weighted sum is float32 and rounded once, to
  `out_dtype` (default x's dtype; the offload engine asks for float32 and rounds once after adding the CPU part).
- `picked_experts_ffn(x [A,D], gate_up, down, picks [A])`: row a through expert picks[a] (the gather path);
  device decode's `stacked_experts_ffn(rows [U,N,D], gate_ups [U,..], downs [U,..])` (rows[u] through expert u),
  `slots_experts_ffn(rows, gate_up [S,..], down [S,..], slots [U])` (through slot slots[u]) and
  `sources_experts_ffn(rows, sources, src [U], slots [U])` (through slot slots[u] of source src[u]: pool, bank,
  host memory; `gather_sources` copies those slots). On a CUDA GPU the four run `kernels.gather_matvec`.
- `weighted_sum(y [N,K,D], weights [N,K], valid [N,K]) -> [N,D] float32`: the sum over k of the few-assignment
  path, in k order; the device decode program sums with it too, so both reduce in the same order and dtypes.
- Weights may be `quant.formats.QuantizedWeight`s (routed experts stored int8 / int4): every path dequantizes
  the experts it reads inside the program (quantized pools always take the tiled path, never ragged_dot); XLA's
  paths round the dequantized weights to the compute dtype, the kernel uses their exact values (bf16: the two
  differ by that rounding).
- `grouped_tiles` sizes the tiled path; the offload budget (`store.budget`) counts its activations with it.
Pure jax functions of their arguments: no parameters, no state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdscope_jax.kernels import gather_matvec
from pdscope_jax.kernels.expert_math import expert_ffn, swiglu  # noqa: F401 (expert_ffn re-exported)
from pdscope_jax.quant.formats import is_quantized, matmul

F32 = jnp.float32
# combine_experts' paths. Up to GATHER_MAX_ASSIGNMENTS (token, expert) assignments: gather one weight copy per
# assignment (decode). From TILED_MIN_ROWS_PER_SLOT assignments per slot on average, or whenever there are more
# slots than experts: tiles, each of one slot's rows, because ragged_dot's cost grows with the number of groups
# (slots), not only with the rows, and a layer's tiles are bounded by the E slots it can use. In between: sort +
# ragged_dot. Tiles run as ONE batched matmul over a gathered copy of each tile's weights while that copy stays
# under GROUPED_MAX_BYTES (the tile grows with the tokens, so the copy holds at most about 2E + 1 experts); larger
# experts (Mixtral's) run tile after tile (`lax.map`) over TILE_ROWS-row tiles instead, which still beats
# ragged_dot over a large pool.
GATHER_MAX_ASSIGNMENTS = 64
TILED_MIN_ROWS_PER_SLOT = 64
TILE_ROWS = 128
GROUPED_MIN_TILE = 64
GROUPED_MAX_TILE = 512
GROUPED_MAX_BYTES = 3 * 10**9
# Tiles only pay when each tile's matmul is large: many tiny sequential tiles of a small expert are slower than
# ragged_dot.
TILED_MIN_EXPERT_ELEMENTS = 1 << 20  # D * 2F of one expert's gate_up


def _kernel_takes(rows: int, gate_up, down) -> bool:
    """Whether `kernels.gather_matvec` takes these rows and expert weights (dense, int8 or int4)."""
    d, f2, f = gate_up.shape[-2], gate_up.shape[-1], down.shape[-2]
    scheme = gate_up.scheme if is_quantized(gate_up) else None
    return (gather_matvec.supported(rows, d, f2, gate_up.dtype, scheme)
            and gather_matvec.supported(rows, f, d, down.dtype, scheme))


def _ffn_in_place(x, gate_up, down, picks, down_picks=None):
    """expert_ffn of row a through expert picks[a] of the stacks (down_picks[a] of `down` where given), by the
    kernel (rounding where expert_ffn does; the activation where `gather_matvec.fuses_activation` says)."""
    return gather_matvec.swiglu_ffn(x, gate_up, down, picks, down_picks).astype(x.dtype)


def picked_experts_ffn(x: jax.Array, gate_up: jax.Array, down: jax.Array, picks: jax.Array) -> jax.Array:
    """expert_ffn(x[a], gate_up[picks[a]], down[picks[a]]) for every row a: x [A, D], stacks [S, D, 2F] / [S, F, D],
    picks [A] int32 in [0, S) -> [A, D] in x's dtype. On a CUDA GPU, for weights of shapes it takes and can address
    (`gather_matvec.addressable`), the gather_matvec kernel reads each pick's weights in place (quantized ones
    at their exact values); elsewhere XLA multiplies a gathered copy."""
    def gathered(x, gate_up, down, picks):
        return jax.vmap(lambda xa, gu, dn: expert_ffn(xa[None], gu, dn)[0])(x, gate_up[picks], down[picks])

    if not (_kernel_takes(x.shape[0], gate_up, down) and gather_matvec.addressable(gate_up)
            and gather_matvec.addressable(down)):
        return gathered(x, gate_up, down, picks)
    return gather_matvec.on_gpu(_ffn_in_place, gathered, x, gate_up, down, picks)


def stacked_experts_ffn(rows: jax.Array, gate_ups: jax.Array, downs: jax.Array) -> jax.Array:
    """expert_ffn(rows[u], gate_ups[u], downs[u]) for every u: rows [U, N, D], gate_ups [U, D, 2F], downs [U, F, D]
    -> [U, N, D] in rows' dtype (device decode's picks, their weights already gathered); the kernel as in
    `picked_experts_ffn`."""
    return _rows_through(rows, gate_ups, downs, jnp.arange(rows.shape[0], dtype=jnp.int32), by_slot=False)


def slots_experts_ffn(rows: jax.Array, gate_up: jax.Array, down: jax.Array, slots: jax.Array) -> jax.Array:
    """expert_ffn(rows[u], gate_up[slots[u]], down[slots[u]]) for every u: rows [U, N, D], stacks [S, D, 2F] /
    [S, F, D], slots [U] int32 in [0, S) -> [U, N, D] in rows' dtype. On a CUDA GPU the kernel reads each slot's
    weights where they lie (no gathered copy), or a gathered copy where its offsets cannot reach every slot
    (`gather_matvec.addressable`); elsewhere XLA multiplies a gathered copy of each slot's."""
    return _rows_through(rows, gate_up, down, slots, by_slot=True)


def sources_experts_ffn(rows: jax.Array, sources: tuple, src: jax.Array, slots: jax.Array) -> jax.Array:
    """expert_ffn(rows[u], gate_up, down of slot slots[u] of sources[src[u]]) for every u: rows [U, N, D], sources a
    tuple of (gate_up [S_i, D, 2F], down [S_i, F, D]) stacks of one kind, src / slots [U] int32 (src in
    [0, len(sources)), slots in [0, S_src)) -> [U, N, D] in rows' dtype. On a CUDA GPU the kernel reads each row's
    slot where it lies, in its own source, and no other (`sources_take_kernel` says where it can); elsewhere XLA
    gathers every row's slot from every source and selects."""
    u, n, d = rows.shape

    def selected(rows, sources, src, slots):
        return jax.vmap(expert_ffn)(rows, *gather_sources(sources, src, slots))

    def in_place(rows, sources, src, slots):
        gate_ups, downs = tuple(g for g, _ in sources), tuple(w for _, w in sources)
        picks, where = jnp.repeat(slots, n), jnp.repeat(src, n)
        out = gather_matvec.swiglu_ffn(rows.reshape(u * n, d), gate_ups, downs, picks, src=where)
        return out.astype(rows.dtype).reshape(u, n, d)

    if not sources_take_kernel(u * n, sources):
        return selected(rows, sources, src, slots)
    return gather_matvec.on_gpu(in_place, selected, rows, sources, src, slots, check=gather_matvec.sources_compile_here)


def gather_sources(sources: tuple, src: jax.Array, slots: jax.Array) -> tuple:
    """(gate_ups [U, ...], downs [U, ...]): a gathered copy of slot slots[u] of source src[u] (sources as in
    `sources_experts_ffn`; a slot past its source's end reads its last). Every source is gathered and the right one
    selected: one more read of the picks' bytes per extra source."""
    taken = None
    for i, pair in enumerate(sources):
        got = jax.tree.map(lambda a: a[jnp.clip(slots, 0, a.shape[0] - 1)], tuple(pair))
        mine = src == i
        taken = got if taken is None else jax.tree.map(
            lambda new, old: jnp.where(mine.reshape(-1, *(1,) * (new.ndim - 1)), new, old), got, taken)
    return taken


def sources_take_kernel(rows: int, sources: tuple) -> bool:
    """Whether the kernel takes `rows` rows over these sources ((gate_up, down) pairs) and can address them all."""
    return (_kernel_takes(rows, *sources[0])
            and all(gather_matvec.addressable(w) for pair in sources for w in pair))


def _rows_through(rows, gate_up, down, slots, by_slot: bool):
    """rows[u] through expert slots[u] of the stacks; `by_slot` False: the stacks hold exactly the U picks, in
    order (slots = arange(U)), so XLA's path multiplies them as they are, with no gather."""
    u, n, d = rows.shape

    def batched(rows, gate_up, down, slots):
        if by_slot:
            gate_up, down = (jax.tree.map(lambda a: a[slots], w) for w in (gate_up, down))
        return jax.vmap(expert_ffn)(rows, gate_up, down)

    def reach(w, slots):  # (weights, each row's slot in them): a gathered copy where the kernel cannot reach a slot
        if by_slot and not gather_matvec.addressable(w):
            return jax.tree.map(lambda a: a[slots], w), jnp.repeat(jnp.arange(u, dtype=jnp.int32), n)
        return w, jnp.repeat(slots, n)

    def in_place(rows, gate_up, down, slots):
        (gate_up, picks), (down, down_picks) = reach(gate_up, slots), reach(down, slots)
        return _ffn_in_place(rows.reshape(u * n, d), gate_up, down, picks, down_picks).reshape(u, n, d)

    if not _kernel_takes(u * n, gate_up, down):
        return batched(rows, gate_up, down, slots)
    return gather_matvec.on_gpu(in_place, batched, rows, gate_up, down, slots)


def weighted_sum(y: jax.Array, weights: jax.Array, valid: jax.Array) -> jax.Array:
    """sum_k valid[n,k] * weights[n,k] * y[n,k] in float32, in k order: y [N, K, D] (each expert's output in
    the model's dtype), weights [N, K] float32, valid [N, K] bool -> [N, D] float32."""
    return jnp.where(valid[..., None], y.astype(F32) * weights[..., None], 0.0).sum(axis=1)


def combine_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array, down: jax.Array,
                    slot_of: jax.Array | None, out_dtype=None) -> jax.Array:
    """sum_k weights[n,k] * expert_ffn(x[n]) over experts with slot_of[id] >= 0.

    x [N, D], weights [N, K] float32, ids [N, K] int32, gate_up [S, D, 2F], down [S, F, D], slot_of [E] int32
    (None: expert e in slot e, every one; no lookup in the program) -> [N, D] in `out_dtype` (None: x's dtype),
    the float32 sum rounded once.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    n, k = ids.shape
    if slot_of is None:
        slots, valid = ids, jnp.ones(ids.shape, bool)
    else:
        slots = slot_of[ids]  # [N, K]
        valid = slots >= 0
        slots = jnp.where(valid, slots, 0)
    if n * k <= GATHER_MAX_ASSIGNMENTS:
        y = picked_experts_ffn(jnp.repeat(x, k, axis=0), gate_up, down, slots.reshape(-1))  # [N*K, D]
        return weighted_sum(y.reshape(n, k, -1), weights, valid).astype(out_dtype)
    num_slots = gate_up.shape[0]
    num_experts = num_slots if slot_of is None else slot_of.shape[0]
    big_experts = gate_up.shape[1] * gate_up.shape[2] >= TILED_MIN_EXPERT_ELEMENTS
    # quantized weights never take ragged_dot, which would dequantize the whole pool at once; tiles dequantize
    # only the slots they use
    if is_quantized(gate_up) or (big_experts and (num_slots > num_experts
                                                  or n * k >= TILED_MIN_ROWS_PER_SLOT * num_slots)):
        used = min(num_slots, num_experts + 1)
        expert_bytes = (gate_up.shape[1] * gate_up.shape[2] + down.shape[1] * down.shape[2]) * gate_up.dtype.itemsize
        tile, _, batched = grouped_tiles(n * k, used, expert_bytes)
        return _combine_tiled(x, weights, slots, valid, gate_up, down, tile if batched else TILE_ROWS, used,
                              batched=batched).astype(out_dtype)
    return _combine_ragged(x, weights, slots, valid, gate_up, down).astype(out_dtype)


def grouped_tiles(assignments: int, used_slots: int, expert_bytes: int) -> tuple[int, int, bool]:
    """(tile rows, tile count, batched) of the batched tiled path for `assignments` rows over at most
    `used_slots` slots of `expert_bytes` each: the tile is the power of two nearest above the mean rows per slot,
    within [GROUPED_MIN_TILE, GROUPED_MAX_TILE]; the count bounds the tiles any routing can fill (every slot's
    last tile may be partly empty); `batched` says whether the gathered copy of the tiles' weights fits
    GROUPED_MAX_BYTES (if not, `combine_experts` runs TILE_ROWS tiles one after another instead)."""
    mean = -(-assignments // max(used_slots, 1))
    tile = min(max(1 << max(mean - 1, 0).bit_length(), GROUPED_MIN_TILE), GROUPED_MAX_TILE)
    count = _tile_count(assignments, used_slots, tile)
    return tile, count, count * expert_bytes <= GROUPED_MAX_BYTES


def _tile_count(assignments: int, used_slots: int, tile: int) -> int:
    return -(-(assignments + used_slots * (tile - 1)) // tile)


def _combine_ragged(x, weights, slots, valid, gate_up, down):
    """Many tokens: sort the N*K assignments by slot and run each slot's rows as one group of ragged_dot."""
    n, k = slots.shape
    flat_slots = slots.reshape(-1)  # [N*K]
    order = jnp.argsort(flat_slots, stable=True)
    token_of = order // k  # assignment n*K + j belongs to token n
    group_sizes = jnp.bincount(flat_slots, length=gate_up.shape[0]).astype(jnp.int32)  # [S]
    xs = x[token_of].astype(gate_up.dtype)  # [N*K, D] grouped by slot
    h = jax.lax.ragged_dot(xs, gate_up, group_sizes, preferred_element_type=F32)  # [N*K, 2F]
    act = swiglu(h).astype(down.dtype)
    # each expert's output in x's dtype, as expert_ffn returns it, so every path rounds at the same places
    y = jax.lax.ragged_dot(act, down, group_sizes, preferred_element_type=F32).astype(x.dtype).astype(F32)
    y = jnp.where(valid.reshape(-1)[order, None], y * weights.reshape(-1)[order, None], 0.0)
    return jnp.zeros((n, x.shape[1]), F32).at[token_of].add(y)  # [N, D] float32


def _combine_tiled(x, weights, slots, valid, gate_up, down, tile, max_used_slots, batched):
    """Many tokens: sort assignments by slot, pad each slot's rows to whole tiles, run expert_ffn per tile: all
    tiles as one batched matmul over a gathered copy of their weights (`batched`), or one after another.
    At most `max_used_slots` distinct slots occur in `slots` (the layer's E experts, and slot 0 where invalid
    assignments point), which bounds the tiles of padding."""
    n, k = slots.shape
    num_slots = gate_up.shape[0]
    a = n * k
    flat = slots.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_slots = flat[order]
    sizes = jnp.bincount(flat, length=num_slots)  # [S]
    padded = (sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    dest = (padded_end - padded)[sorted_slots] + jnp.arange(a) - (jnp.cumsum(sizes) - sizes)[sorted_slots]
    num_tiles = _tile_count(a, max_used_slots, tile)
    rows = jnp.zeros((num_tiles * tile,), jnp.int32).at[dest].set((order // k).astype(jnp.int32))
    w = jnp.where(valid.reshape(-1)[order], weights.reshape(-1)[order], 0.0)
    w_rows = jnp.zeros((num_tiles * tile,), F32).at[dest].set(w)
    starts = jnp.arange(num_tiles) * tile
    tile_slot = jnp.minimum(jnp.searchsorted(padded_end, starts, side="right"), num_slots - 1)
    xt = x[rows].reshape(num_tiles, tile, x.shape[1])
    if batched:  # rows of unused tiles carry weight 0, so they need no mask
        gu, dn = gate_up[tile_slot], down[tile_slot]  # [T, D, 2F], [T, F, D]
        h = matmul(xt, gu)  # [T, tile, 2F] float32
        y = matmul(swiglu(h).astype(dn.dtype), dn).astype(x.dtype)
    else:
        def one_tile(args):
            xg, slot, live = args
            return jax.lax.cond(live, lambda: expert_ffn(xg, gate_up[slot], down[slot]), lambda: jnp.zeros_like(xg))

        y = jax.lax.map(one_tile, (xt, tile_slot, starts < padded_end[-1]))
    y = y.reshape(num_tiles * tile, -1).astype(F32) * w_rows[:, None]
    return jnp.zeros((n, x.shape[1]), F32).at[rows].add(y)  # [N, D] float32
