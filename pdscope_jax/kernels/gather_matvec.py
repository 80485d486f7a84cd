"""Few-row products with gathered expert weights on the GPU, reading each weight once (Pallas, Triton lowering).

Why: XLA copies each gathered pick's weights and turns a one-row product into a reduction, at a fraction of the
memory's speed; this kernel reads the picks' weights in place, in [BK, BN] tiles, accumulating in float32.
- `gather_matvec(x [A, K], w [S, K, N], idx [A] int32) -> float32 [A, N]`: row a is x[a] @ w[idx[a]], x's values
  rounded to w's (compute) dtype, summed in float32 (up to the order of the sum); idx in [0, S). w: a
  bf16/f16/f32 array or an int8 / int4 `quant.formats.QuantizedWeight`, read once in its stored width, x times the
  integers summed per scale (a column's, an int4 group's) and then scaled: quantized weights count at their exact
  values (`w.dequantize(float32)`), where XLA's paths round them to the compute dtype first.
- `matvec_parts(x, w, idx) -> float32 [P, A, N]`: the same products left in the P parts K is cut into; w may be a
  pair (w1, w2) of dense weights of one shape: [P, A, 2N], w1's columns first (gate and up in one call).
  `swiglu_matvec(h_parts [P', A, 2K], w [S, K, N], idx) -> float32 [A, N]`: row a is swiglu(the sum of
  h_parts[:, a]) rounded to w's dtype, times w[idx[a]]. `swiglu_ffn(x, gate_up, down, picks, down_picks=None)`:
  an FFN, its activation in the down call where `fuses_activation(down)` (`FUSED_ACTIVATION`), else between.
- Per-row sources: each call takes `src` [A] int32; w is then a tuple of sources of one kind but their slot
  counts (the pool, the decode bank, host memory), and row a reads slot idx[a] of source src[a] only.
- `supported(a, k, n, dtype, scheme=None)`: the shapes the kernel takes (K and N multiples of its tiles, at most
  `MAX_ROWS` rows; int4 groups of 32 or 64 rows). `addressable(w)`: whether its offsets reach every slot of w.
  `tiles` (`Tiles`, static) sets how a call cuts its work; by default `tiles_for(N)`.
- `on_gpu(kernel_fn, xla_fn, *args, check=compiles_here)`: `kernel_fn(*args)` when lowered for a CUDA GPU,
  `ENABLED` (PDSCOPE_GPU_KERNELS != 0) and `check()`, else `xla_fn(*args)` (`jax.lax.platform_dependent`).
  `compiles_here()` / `sources_compile_here()` compile every variant (without / with sources) once per process
  where a GPU is the default backend (`compile_check`, which `row_copy` shares); on a failure they warn once and
  the XLA paths run. `interpret=True` runs the kernel through Pallas' interpreter (tests on the CPU backend).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pdscope_jax.kernels import triton_offsets
from pdscope_jax.kernels.expert_math import swiglu
from pdscope_jax.quant.formats import is_quantized, quantize

F32 = jnp.float32
ENABLED = os.environ.get("PDSCOPE_GPU_KERNELS", "1") != "0"
MAX_ROWS = 64  # assignments a call takes (the gather path's bound, models.experts.GATHER_MAX_ASSIGNMENTS)
BLOCK_N = 128


class Tiles(NamedTuple):
    """How a call cuts its work: columns a program takes (`block_n`, a multiple of 16 dividing N), rows of K a tile
    takes for 2-byte dense weights (`block_k`; 4-byte weights take half, int4 one group), the grid's target size
    (`programs`: K is split until the grid has about this many), and Triton's `num_warps` / `num_stages`."""
    block_n: int = BLOCK_N
    block_k: int = 64
    programs: int = 2112  # 16 per multiprocessor of an H100/H200: enough weight bytes in flight
    num_warps: int = 4
    num_stages: int = 3


TILES = Tiles()
NARROW = TILES._replace(block_k=32)  # N <= 2048: half-height tiles, twice the programs along K
# Down weights whose call computes the activation itself: it sums gate/up's K parts in every column block, which costs
# a dense down call more than the XLA kernel it saves (docs/MEASUREMENTS.md); "dense" names unquantized weights.
FUSED_ACTIVATION = frozenset({"int8", "int4"})


def tiles_for(n: int) -> Tiles:
    """The cut a call of N columns takes by default (swept on an H200 over decode's shapes: docs/MEASUREMENTS.md):
    narrow outputs have too few column blocks to keep the memory busy, so their K is cut finer."""
    return NARROW if n <= 2048 else TILES


def kernel_name(tiles: Tiles) -> str:
    """The kernel's name in profiles: its tiles, so that a trace tells cuts apart."""
    return "gather_matvec_n{}_k{}_p{}_w{}_s{}".format(*tiles)


def _block_k(dtype, scheme=None, k: int = 0, tiles: Tiles = TILES) -> int:
    """Rows of K a tile takes: tiles.block_k (half for 4-byte weights); an int4 group (a tile shares one scale
    row)."""
    if scheme is not None and scheme.bits == 4:
        return scheme.group_for(k)
    return tiles.block_k if jnp.dtype(dtype).itemsize <= 2 else tiles.block_k // 2


def supported(a: int, k: int, n: int, dtype, scheme=None) -> bool:
    dtype = jnp.dtype(dtype)
    if not (0 < a <= MAX_ROWS and n % BLOCK_N == 0
            and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(F32), jnp.dtype(jnp.float16))):
        return False
    if scheme is not None and scheme.bits == 4:
        return k % 32 == 0 and scheme.group_for(k) in (32, 64)
    return k % _block_k(dtype, scheme, k) == 0


def addressable(w) -> bool:
    """Whether the kernel can address every slot of `w` (an array or a QuantizedWeight): always where
    `triton_offsets.install()` widened the lowering's offsets; else only where no leaf needs it (an operand of 2^31
    elements or more within 4 GiB, such as an int4 pool's packed values of 2-4 GB, would wrap 32-bit offsets)."""
    return triton_offsets.install() or not any(triton_offsets.needs_wide(leaf.shape, leaf.dtype)
                                               for leaf in jax.tree.leaves(w))


def _splits(a: int, k_blocks: int, n_blocks: int, programs: int = TILES.programs) -> int:
    """Parts K is cut into: the largest divisor of the K blocks that keeps the grid within `programs` programs (more
    programs, more weight bytes in flight). Any divisor, not only powers of two: K blocks of few factors of two
    (an int4 down projection's 22 groups) would otherwise leave the grid a tenth of its target."""
    cap = max(programs // (a * n_blocks), 1)
    return max(d for d in range(1, min(k_blocks, cap) + 1) if k_blocks % d == 0)


def _rounded(v: jax.Array, dtype) -> jax.Array:
    """float32 v rounded to `dtype` (to nearest, ties to even) and held in float32. For bf16 by integer
    arithmetic on the bits, which no compiler folds away (XLA, running the interpreted kernel, would drop a float32
    -> bf16 -> float32 round trip as excess precision); v must be finite."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return v.astype(dtype).astype(F32)
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, F32)


def _x_rows(x_ref, a, start, size: int, dtype, act: int) -> jax.Array:
    """Row a of x, elements [start, start + size), in float32 rounded to dtype. `act` > 0: x_ref holds the K parts
    of a gate/up product [P, A, 2 * act] (gate columns first) and the elements are swiglu of their sums."""
    if not act:
        return x_ref[a, pl.ds(start, size)].astype(dtype).astype(F32)
    gate = up = 0.0
    for p in range(x_ref.shape[0]):
        gate = gate + x_ref[p, a, pl.ds(start, size)]
        up = up + x_ref[p, a, pl.ds(act + start, size)]
    return _rounded(jax.nn.silu(gate) * up, dtype)


def _each_source(src_ref, a, groups: list, fn) -> None:
    """fn(refs) on the weight refs of row a's source (`groups[src[a]]`; the only one where src_ref is None). The
    branch is the same for all of a program's threads (a program takes one row), so no thread idles in it."""
    if src_ref is None:
        fn(groups[0])
        return
    source = src_ref[a]
    for i, refs in enumerate(groups):
        pl.when(source == i)(functools.partial(fn, refs))


def _split_refs(refs: tuple, sources: int) -> tuple:
    """(src_ref or None, x_ref, weight refs of each source, o_ref) of a kernel's refs after idx_ref."""
    src_ref, refs = (refs[0], refs[1:]) if sources > 1 else (None, refs)
    x_ref, weights, o_ref = refs[0], refs[1:-1], refs[-1]
    per = len(weights) // sources
    return src_ref, x_ref, [weights[i * per:(i + 1) * per] for i in range(sources)], o_ref


def _kernel(idx_ref, *refs, sources: int, block_k: int, block_n: int, steps: int, dtype, act: int,
            pair_blocks: int, scaled: bool):
    """Dense or int8 weights: acc[BN] += x[BK] @ w[slot, BK rows, BN columns], tile after tile along K (x's rows
    as `_x_rows` gives them). Each source's refs: its weights (two with `pair_blocks`: column blocks from
    pair_blocks on read the second), int8's scales when `scaled` (each column's sum times its float32 scale once,
    at the end)."""
    src_ref, x_ref, groups, o_ref = _split_refs(refs, sources)
    a, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[a]

    def product(w_ref, scale_ref, col_block):
        cols = pl.ds(pl.multiple_of(col_block * block_n, block_n), block_n)

        def body(i, acc):
            start = pl.multiple_of((s * steps + i) * block_k, block_k)
            xb = _x_rows(x_ref, a, start, block_k, dtype, act)  # [BK]
            wb = w_ref[slot, pl.ds(start, block_k), cols].astype(F32)  # [BK, BN]: rows of BN contiguous values
            return acc + jnp.sum(xb[:, None] * wb, axis=0)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_n,), F32))
        o_ref[...] = acc * scale_ref[slot, 0, cols].astype(F32) if scaled else acc

    def source(group):
        w_refs, scale_ref = (group[:-1], group[-1]) if scaled else (group, None)
        if len(w_refs) == 1:
            product(w_refs[0], scale_ref, j)
        else:  # one program reads one matrix: the branch is the same for all its threads
            pl.when(j < pair_blocks)(lambda: product(w_refs[0], scale_ref, j))
            pl.when(j >= pair_blocks)(lambda: product(w_refs[1], scale_ref, j - pair_blocks))

    _each_source(src_ref, a, groups, source)


def _kernel_int4(idx_ref, *refs, sources: int, group: int, block_n: int, steps: int, dtype, act: int):
    """int4 weights, two rows a byte (row 2i low nibble, 2i+1 high) and one scale row per group of `group` rows
    (each source's refs: q, scale): a tile is one group; its x (as `_x_rows` gives them) is split into even and
    odd elements in the kernel, so each nibble meets its own. A group's sums of x times the integers are
    multiplied by its scales once (few operations a byte: the kernel reads a quarter of bf16's bytes, and would
    otherwise be bound by its arithmetic)."""
    src_ref, x_ref, groups, o_ref = _split_refs(refs, sources)
    a, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[a]
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    half = group // 2

    def source(refs):
        q_ref, scale_ref = refs

        def body(i, acc):
            g = s * steps + i
            packed = q_ref[slot, pl.ds(pl.multiple_of(g * half, half), half), cols].astype(jnp.int32)  # [G/2, BN]
            low = ((packed << 28) >> 28).astype(F32)  # arithmetic shifts sign-extend each nibble
            high = ((packed << 24) >> 28).astype(F32)
            xg = _x_rows(x_ref, a, pl.multiple_of(g * group, group), group, dtype, act)  # [G]
            xe, xo = (v.reshape(half, 1) for v in jnp.split(xg.reshape(half, 2), 2, axis=-1))
            return acc + jnp.sum(xe * low + xo * high, axis=0) * scale_ref[slot, g, cols].astype(F32)

        o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_n,), F32))

    _each_source(src_ref, a, groups, source)


def _parts(x, sources: tuple, idx, interpret: bool, tiles: Tiles | None, act: int = 0, src=None) -> jax.Array:
    """K's parts of the rows' products [P, A, N * len(ws)] float32 (their sum over P is the product). sources: one
    tuple `ws` per source, of one weight or two dense ones of one shape side by side (every source alike but in
    its slot count); row a reads source src[a] (the only one where src is None). x: [A, K], or with `act` = K a
    gate/up product's parts [P', A, 2K] whose swiglu the rows are."""
    ws = sources[0]
    w = ws[0]
    a, k = x.shape[-2], x.shape[-1] // 2 if act else x.shape[-1]
    _, k_w, n = w.shape
    tiles = tiles_for(n) if tiles is None else tiles
    scheme = w.scheme if is_quantized(w) else None
    block_k, block_n = _block_k(w.dtype, scheme, k, tiles), tiles.block_n
    alike = all(len(other) == len(ws) and all(_same_kind(v, w) for v in other) for other in sources)
    if (k_w != k or idx.shape != (a,) or not supported(a, k, n, w.dtype, scheme) or n % block_n or k % block_k
            or (len(ws) > 1 and scheme is not None) or not alike
            or (src is None) != (len(sources) == 1) or (src is not None and src.shape != (a,))
            or (act and (act != k or x.ndim != 3))):
        shapes = [[v.shape for v in one] for one in sources]
        raise ValueError(f"gather_matvec: unsupported shapes x {x.shape}, w {shapes} {w.dtype}, idx {idx.shape}, "
                         f"src {None if src is None else src.shape} for {tiles}")
    if not all(addressable(v) for one in sources for v in one):
        raise ValueError(f"gather_matvec: unsupported shapes w {w.shape} {w.dtype}: 2^31 elements or more within "
                         f"4 GiB lie past the kernel's 32-bit offsets; pass a gathered copy of the rows' slots")
    n_blocks, k_blocks = n // block_n, k // block_k
    splits = _splits(a, k_blocks, n_blocks * len(ws), tiles.programs)
    cut = dict(sources=len(sources), block_n=block_n, steps=k_blocks // splits, dtype=jnp.dtype(w.dtype))
    if scheme is not None and scheme.bits == 4:
        kernel = functools.partial(_kernel_int4, group=block_k, act=act, **cut)
    else:
        kernel = functools.partial(_kernel, block_k=block_k, act=act, pair_blocks=n_blocks, scaled=scheme is not None,
                                   **cut)
    weights = [leaf for ws in sources for v in ws for leaf in ((v.q, v.scale) if scheme is not None else (v,))]
    operands = ((idx.astype(jnp.int32),) + (() if src is None else (src.astype(jnp.int32),)) + (x, *weights))
    whole = pl.BlockSpec(memory_space=pl.ANY) if interpret else pl.no_block_spec
    from jax.experimental.pallas import triton as pl_triton

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, a, n * len(ws)), F32),
        grid=(a, n_blocks * len(ws), splits),
        in_specs=[whole] * len(operands),
        out_specs=pl.BlockSpec((None, None, block_n), lambda i, j, s: (s, i, j)),
        compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name=kernel_name(tiles) + ("_pair" if len(ws) > 1 else "") + ("_swiglu" if act else "")
        + (f"_from{len(sources)}" if src is not None else ""),
        interpret=interpret,
    )(*operands)


def _same_kind(v, w) -> bool:
    """Whether weight v is w's kind: the same shape past the slot axis, dtype and scheme (slot counts may differ)."""
    if is_quantized(v) != is_quantized(w) or v.shape[1:] != w.shape[1:] or v.dtype != w.dtype:
        return False
    return not is_quantized(w) or v.scheme == w.scheme


def _sources(w, src) -> tuple:
    """The `sources` of `_parts` for a public call's w: one weight, a pair, or (with src) one of those a source."""
    def one(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return tuple(one(v) for v in w) if src is not None else (one(w),)


def _summed(parts: jax.Array) -> jax.Array:
    return parts.sum(axis=0) if parts.shape[0] > 1 else parts[0]


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def gather_matvec(x: jax.Array, w, idx: jax.Array, interpret: bool = False, tiles: Tiles | None = None,
                  src: jax.Array | None = None) -> jax.Array:
    return _summed(_parts(x, _sources(w, src), idx, interpret, tiles, src=src))


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def matvec_parts(x: jax.Array, w, idx: jax.Array, interpret: bool = False, tiles: Tiles | None = None,
                 src: jax.Array | None = None) -> jax.Array:
    return _parts(x, _sources(w, src), idx, interpret, tiles, src=src)


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def swiglu_matvec(h_parts: jax.Array, w, idx: jax.Array, interpret: bool = False, tiles: Tiles | None = None,
                  src: jax.Array | None = None) -> jax.Array:
    return _summed(_parts(h_parts, _sources(w, src), idx, interpret, tiles, act=h_parts.shape[-1] // 2, src=src))


def fuses_activation(down) -> bool:
    return (down.scheme.name if is_quantized(down) else "dense") in FUSED_ACTIVATION


def swiglu_ffn(x: jax.Array, gate_up, down, picks: jax.Array, down_picks: jax.Array | None = None,
               src: jax.Array | None = None) -> jax.Array:
    h_parts = matvec_parts(x, gate_up, picks, src=src)  # [P, A, 2F] float32, gate's columns first
    down_picks = picks if down_picks is None else down_picks
    first_down = down[0] if src is not None else down
    if fuses_activation(first_down):
        return swiglu_matvec(h_parts, down, down_picks, src=src)
    return gather_matvec(swiglu(_summed(h_parts)).astype(first_down.dtype), down, down_picks, src=src)


def compile_check(compile_all, what: str, instead: str) -> bool:
    """Whether `compile_all()` (lowering and compiling a kernel's variants on shapes: it may run while an outer
    program is traced, where concrete arrays would become its tracers) succeeds where a GPU is the default
    backend; True elsewhere (nothing lowers a kernel there). On a failure it warns, naming `what` failed and what
    runs `instead`, and returns False. Callers cache it: once per process."""
    if jax.default_backend() != "gpu":
        return True
    try:
        compile_all()
    except Exception as err:  # noqa: BLE001 (any failure of Pallas/Triton here means: use XLA's paths)
        warnings.warn(f"{what} does not compile on this GPU ({type(err).__name__}: {str(err)[:300]}); {instead}",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _probe_shapes() -> tuple:
    """(x, idx, [dense, int8, int4 weights]) as shapes: the small variants the compile checks lower."""
    w = jax.ShapeDtypeStruct((1, 64, BLOCK_N), jnp.bfloat16)
    quantized = [jax.eval_shape(lambda s=scheme: quantize(jnp.ones(w.shape, w.dtype), s))
                 for scheme in ("int8", "int4")]
    return jax.ShapeDtypeStruct((1, 64), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32), [w, *quantized]


def _compile_variants() -> None:
    x, idx, weights = _probe_shapes()
    for w in weights:  # every variant a program may hold, so none fails inside one
        gather_matvec.lower(x, w, idx).compile()
        swiglu_matvec.lower(jax.ShapeDtypeStruct((2, 1, 128), F32), w, idx).compile()
    matvec_parts.lower(x, (weights[0], weights[0]), idx).compile()


def _compile_source_variants() -> None:
    x, idx, weights = _probe_shapes()
    for w in weights:
        gather_matvec.lower(x, (w, w), idx, src=idx).compile()


@functools.cache
def compiles_here() -> bool:
    return compile_check(_compile_variants, "the GPU matvec kernel (pdscope_jax.kernels.gather_matvec)",
                         "decode runs XLA's paths instead. Set PDSCOPE_GPU_KERNELS=0 to skip the kernel and this "
                         "check.")


@functools.cache
def sources_compile_here() -> bool:
    return compiles_here() and compile_check(
        _compile_source_variants, "the GPU matvec kernel with per-row sources (pdscope_jax.kernels.gather_matvec)",
        "those calls run XLA's paths.")


def on_gpu(kernel_fn, xla_fn, *args, check=compiles_here):
    if not (ENABLED and check()):
        return xla_fn(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=xla_fn)
