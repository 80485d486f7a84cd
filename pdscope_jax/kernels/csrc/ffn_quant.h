// Quantized units of few rows (int8 or int4 experts with at most kQuantRows routed rows) on AVX-512 BF16.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
//
// At one to four rows the unit path's cost is turning integers into bf16 and walking memory, not the dot products:
//  - Widening: each weight row pair is widened once, straight into the dot products' interleaved layout, and
//    every row's dot products run on it from registers (no chunk buffer).
//      int4 (needs AVX-512 VBMI): a 64-byte line of a byte row holds 64 columns of two weight rows (low and high
//      nibbles). vpmultishiftqb moves each column's two nibbles into the low bits of its lane's two words and
//      vpermw looks them up as bf16 (kNibbles): two instructions per 32 weights. The lanes come out in the spread
//      order (vector j, lane l: column 8 (l / 2) + 2 j + l % 2 of the 64; of 32 columns, 4 (l / 2) + 2 j + l % 2),
//      which the scales are put into and the sums taken out of (through permuted_scales' order, ffn_weights.h).
//      int8: 16 columns of rows r and r + 1 sign-extended and converted to float32 (exact), and vpermt2w keeps
//      their upper halves (the bf16 values, exact for integers) interleaved, columns in order.
//  - Memory order: a run of an expert's units (all of a group's) walks gate_up in slabs of kQuantSlab stored rows
//    (at most a scale group), every unit's columns of a slab before the next slab, then each unit's down rows (a
//    pair of units' 64 rows together), 64 output columns at a time. The kernels read a slab column block by
//    column block, too scattered for the hardware prefetchers; a software prefetch cursor walks the same lines in
//    memory order (row by row) a slab ahead into L2, and they stream at close to the core's sequential rate.
// Exactness: the float32 sums of each slab (within one scale group) or down block of rows are scaled per column
// and added to float32 totals, so the weights are q * scale exactly, as in the unit path (ffn_weights.h); only
// the order of the float32 additions differs.
// Entry: quant_units<M> (M = Int8Mat<S> or Int4Mat<S>, S the scales' type), tried first by run_units (ffn_units.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ffn_types.h"
#include "ffn_units.h"
#include "ffn_weights.h"

namespace pdscope_cpu_ffn {

template <class M>
constexpr bool kIsInt4 = false;  // whether the view M is an Int4Mat
template <class S>
constexpr bool kIsInt4<Int4Mat<S>> = true;

constexpr int kQuantRows = 4;  // the most routed rows of an expert these kernels take
// The most they do take, int4 [0] and int8 [1] (0: none; pdscope_cpu_ffn_set_quant_rows changes them). int8 is off
// by default: on a Sapphire Rapids host its unit kernels ran faster than these (docs/MEASUREMENTS.md).
std::atomic<int> g_quant_rows[2] = {
    std::clamp(env_int("PDSCOPE_CPU_FFN_QUANT_ROWS", kQuantRows), 0, kQuantRows),
    std::clamp(env_int("PDSCOPE_CPU_FFN_QUANT_ROWS_INT8", 0), 0, kQuantRows)};
constexpr int kQuantSlab = 32;  // stored rows (int4: byte rows) per slab of the gate_up walk
// Lines the prefetch cursor runs ahead of the kernels (unset: a slab's and 256 more; 0: no prefetch).
const int kQuantLead = env_int("PDSCOPE_CPU_FFN_PF_QUANT", -1);

#if defined(__x86_64__)
const bool kHasVbmi = cpu_has_avx512vbmi();

// Column of lane l of spread vector j: Z = 4 vectors (64 columns), or 2 (32 columns).
constexpr int spread_column(int z, int j, int l) { return (z == 4 ? 8 : 4) * (l / 2) + 2 * j + l % 2; }
// Column of lane i of permuted_scales' lo (h = 0) or hi (h = 1) vector (ffn_weights.h).
constexpr int unpermute_column(int h, int i) { return 8 * (i / 4) + 4 * h + i % 4; }

// Index vectors, made once (outside the AVX-512 target: this runs at load, on any x86-64).
struct QuantTables {
  alignas(64) uint8_t spread4[4][64];   // vpmultishiftqb controls: 64 columns, one qword (8 columns) per lane pair
  alignas(64) uint8_t spread2[2][64];   // 32 columns after vpmovzxdq: one dword (4 columns) per lane pair
  alignas(64) uint16_t int8_pairs[32];  // vpermt2w: lane l = the upper words of lane l of a, then of b
  alignas(64) int32_t in4[4][16];       // vpermt2ps: spread vector j from permuted_scales' (lo, lo') or (hi, hi')
  alignas(64) int32_t out4[4][16];      // vpermt2ps: lo, hi, lo', hi' from spread vectors (0, 1) or (2, 3)
  alignas(64) int32_t in2[2][16];       // 32 columns: spread vector j from (lo, hi)
  alignas(64) int32_t out2[2][16];      // 32 columns: lo, hi from spread vectors (0, 1)
  QuantTables() {
    for (int j = 0; j < 4; ++j)
      for (int b = 0; b < 64; ++b) {  // byte b of qword b / 8: word (b % 8) / 2 of the qword's lane pair
        const int lane_in_qword = (b % 8) / 4, high_nibble = (b % 4) / 2, column = 2 * j + lane_in_qword;
        spread4[j][b] = uint8_t(8 * column + 4 * high_nibble);
        if (j < 2) spread2[j][b] = uint8_t(8 * column + 4 * high_nibble);  // the qword holds 4 columns (32 bits)
      }
    for (int l = 0; l < 16; ++l) {
      int8_pairs[2 * l] = uint16_t(2 * l + 1);
      int8_pairs[2 * l + 1] = uint16_t(32 + 2 * l + 1);
    }
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 16; ++l) {  // from lo, lo' (j < 2) or hi, hi' (j >= 2): columns 0-31, then 32-63
        const int col = spread_column(4, j, l);
        in4[j][l] = 16 * (col / 32) + unpermute_lane(col % 32);
      }
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < 16; ++i) {  // lo, hi of columns 0-31, then 32-63: from spread vectors (0, 1) or (2, 3)
        const int col = 32 * (v / 2) + unpermute_column(v % 2, i);
        out4[v][i] = 16 * ((col % 8) / 2 % 2) + 2 * (col / 8) + col % 2;
      }
    for (int j = 0; j < 2; ++j)
      for (int l = 0; l < 16; ++l) {  // from lo, hi
        const int col = spread_column(2, j, l);
        in2[j][l] = 16 * ((col % 8) / 4) + unpermute_lane(col);
      }
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) {  // from spread vectors 0, 1
        const int col = unpermute_column(h, i);
        out2[h][i] = 16 * ((col % 4) / 2) + 2 * (col / 4) + col % 2;
      }
  }
  static int unpermute_lane(int col) { return 4 * (col / 8) + col % 4; }  // col's lane in lo or hi (0 <= col < 32)
};
const QuantTables kQ;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")


// Rows r, r + 1 (r even) at columns [c0, c0 + 16 Z) as Z vectors of bf16 pairs (exact), int4 in the spread order.
template <int Z, class S>
inline void widen(const Int4Mat<S>& w, int r, int c0, __m512i* out) {
  const __m512i table = _mm512_load_si512(kNibbles.v);
  const uint8_t* p = w.q + size_t(r >> 1) * w.ld + c0;
  if constexpr (Z == 4) {
    const __m512i x = _mm512_loadu_si512(p);
    for (int j = 0; j < 4; ++j)
      out[j] = _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(_mm512_load_si512(kQ.spread4[j]), x), table);
  } else {
    const __m512i x = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int j = 0; j < 2; ++j)
      out[j] = _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(_mm512_load_si512(kQ.spread2[j]), x), table);
  }
}

template <int Z, class S>
inline void widen(const Int8Mat<S>& w, int r, int c0, __m512i* out) {
  const __m512i idx = _mm512_load_si512(kQ.int8_pairs);
  const int8_t* p = w.q + size_t(r) * w.ld + c0;
  for (int z = 0; z < Z; ++z)
    out[z] = _mm512_permutex2var_epi16(_mm512_castps_si512(int8_floats(p + 16 * z)), idx,
                                       _mm512_castps_si512(int8_floats(p + w.ld + 16 * z)));
}

// Weight rows per scale row of a `rows`-row matrix.
template <class S>
inline int scale_group(const Int4Mat<S>& w, int) { return 1 << w.shift; }
template <class S>
inline int scale_group(const Int8Mat<S>&, int rows) { return rows; }

// The scales of row r's group at columns [c0, c0 + 16 Z), in widen's order.
template <int Z, class S>
inline void group_scales(const Int4Mat<S>& w, int r, int c0, __m512* s) {
  __m512 lo, hi;
  permuted_scales(w, r, c0, &lo, &hi);
  if constexpr (Z == 4) {
    __m512 lo2, hi2;
    permuted_scales(w, r, c0 + 32, &lo2, &hi2);
    for (int j = 0; j < 4; ++j)
      s[j] = _mm512_permutex2var_ps(j < 2 ? lo : hi, _mm512_load_si512(kQ.in4[j]), j < 2 ? lo2 : hi2);
  } else {
    for (int j = 0; j < 2; ++j) s[j] = _mm512_permutex2var_ps(lo, _mm512_load_si512(kQ.in2[j]), hi);
  }
}

template <int Z, class S>
inline void group_scales(const Int8Mat<S>& w, int r, int c0, __m512* s) {
  for (int h = 0; h < Z / 2; ++h) {
    __m512 lo, hi;
    permuted_scales(w, r, c0 + 32 * h, &lo, &hi);
    unpermute(lo, hi, &s[2 * h], &s[2 * h + 1]);
  }
}

// Sums in widen's order -> columns in order (16 per vector).
template <int Z, class S>
inline void to_columns(const Int4Mat<S>&, __m512* a) {
  if constexpr (Z == 4) {
    __m512 old[4];
    for (int v = 0; v < 4; ++v)
      old[v] = _mm512_permutex2var_ps(a[2 * (v % 2)], _mm512_load_si512(kQ.out4[v]), a[2 * (v % 2) + 1]);
    unpermute(old[0], old[1], &a[0], &a[1]);
    unpermute(old[2], old[3], &a[2], &a[3]);
  } else {
    const __m512 lo = _mm512_permutex2var_ps(a[0], _mm512_load_si512(kQ.out2[0]), a[1]);
    const __m512 hi = _mm512_permutex2var_ps(a[0], _mm512_load_si512(kQ.out2[1]), a[1]);
    unpermute(lo, hi, &a[0], &a[1]);
  }
}

template <int Z, class S>
inline void to_columns(const Int8Mat<S>&, __m512*) {}

// Software prefetch (into L2) of the lines a run will read, in the order they lie in memory: regions of `rows` rows
// `pitch` bytes apart from `base`, in each row the bytes [a, a + len) and, where b >= 0, [b, b + len) (widened to
// whole lines). The kernels read a slab column block by column block, too scattered for the hardware to stream;
// prefetched row by row, a slab ahead, the same lines stream at close to the core's sequential rate. The kernels
// pay for each line they read (issue); the lines of regions added with paid false (scales) come free.
struct LineCursor {
  struct Region {
    const uint8_t* base;
    size_t pitch;
    int rows, a, b, len;
    bool paid;
  };
  std::vector<Region> regions;
  size_t next = 0;      // the region after the current one
  int row = 0, second = 0, credit = 0;
  bool paid = true;     // the current range's lines are paid for
  const uint8_t* p = nullptr;    // the next line of the current range
  const uint8_t* end = nullptr;  // the current range's end

  void clear() {
    regions.clear();
    next = row = second = credit = 0;
    p = end = nullptr;
  }
  void add(const void* base, size_t pitch, int rows, size_t a, size_t b, size_t len, bool two, bool paid) {
    const size_t a0 = a & ~size_t(63), b0 = b & ~size_t(63), end = (a + len + 63) & ~size_t(63);
    regions.push_back({static_cast<const uint8_t*>(base), pitch, rows, int(a0), two ? int(b0) : -1, int(end - a0),
                       paid});
  }
  // Start the next range (the row's second, the next row's first, the next region's); false after the last one.
  bool advance() {
    if (next > regions.size()) return false;
    if (next == 0) {
      next = 1;
    } else if (!second && regions[next - 1].b >= 0) {
      second = 1;
    } else {
      second = 0;
      if (++row == regions[next - 1].rows) row = 0, ++next;
    }
    if (next > regions.size()) return false;
    const Region& g = regions[next - 1];
    p = g.base + size_t(row) * g.pitch + (second ? g.b : g.a);
    end = p + g.len;
    paid = g.paid;
    return true;
  }
  // The kernels are about to read n more lines: prefetch as many paid lines further on (and the free ones between).
  void issue(int n) {
    for (credit += n;;) {
      if (p == end && !advance()) return;
      if (paid && credit <= 0) return;
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
      p += 64;
      credit -= paid;
    }
  }
};

// Lines each row pair of widen<Z> reads (per column set).
template <class M>
constexpr int pair_lines() { return kIsInt4<M> ? 1 : 2; }

// acc[i % S][r][n Z + z] += the dot products of row r's activations x[r][2 i - x0], x[r][2 i + 1 - x0] with weight
// rows 2 i, 2 i + 1 at columns col[n] + [0, 16 Z) (widen's vector z), for pairs i in [p0, p1) (p1 - p0 a multiple
// of S). Two sets of sums (S = 2) where one set would leave too few independent dot product chains.
template <int R, int Z, int NC, int S, class M>
inline void dot_pairs(const M& w, int p0, int p1, const int* col, const bf16* const* x, int x0,
                      __m512 (*acc)[R][NC * Z]) {
  for (int i = p0; i < p1; i += S) {
    for (int s = 0; s < S; ++s) {
      const int r2 = 2 * (i + s);
      __m512i v[NC * Z];
      for (int n = 0; n < NC; ++n) widen<Z>(w, r2, col[n], v + n * Z);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = as_bh(pair_of(x[r] + r2 - x0));
        for (int q = 0; q < NC * Z; ++q) acc[s][r][q] = _mm512_dpbf16_ps(acc[s][r][q], as_bh(v[q]), xb);
      }
    }
  }
}

// total[r][n Z + z] (16 floats each, widen's order) += the scaled sums of weight rows [r0, r1) (of one scale group)
// at columns col[n] + [0, 16 Z) times x[r] (x[r][0]: weight row x0).
template <int R, int Z, int NC, class M>
inline void scaled_pass(const M& w, int r0, int r1, const int* col, const bf16* const* x, int x0, LineCursor& pf,
                        float* total) {
  constexpr int S = R * NC * Z >= 8 ? 1 : 2;
  __m512 acc[S][R][NC * Z];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < NC * Z; ++q) acc[s][r][q] = _mm512_setzero_ps();
  pf.issue((r1 - r0) / 2 * NC * pair_lines<M>());
  dot_pairs<R, Z, NC, S>(w, r0 / 2, r1 / 2, col, x, x0, acc);
  for (int n = 0; n < NC; ++n) {
    __m512 scale[Z];
    group_scales<Z>(w, r0, col[n], scale);
    for (int r = 0; r < R; ++r)
      for (int z = 0; z < Z; ++z) {
        const int q = n * Z + z;
        const __m512 sum = S == 2 ? _mm512_add_ps(acc[0][r][q], acc[S - 1][r][q]) : acc[0][r][q];
        float* t = total + (r * NC * Z + q) * 16;
        _mm512_storeu_ps(t, _mm512_fmadd_ps(sum, scale[z], _mm512_loadu_ps(t)));
      }
  }
}

// partial[rows[r]][cb + [0, 16 Z)] += the down sums of weight rows [f0, f0 + n) (scale groups of g rows) times
// x[r][0 .. n).
template <int R, int Z, class M>
inline void down_block(const M& w, int f0, int n, int g, int cb, const bf16* const* x, float* const* o,
                       LineCursor& pf) {
  alignas(64) float total[R * Z * 16] = {};
  for (int g0 = f0; g0 < f0 + n; g0 += g) scaled_pass<R, Z, 1>(w, g0, g0 + g, &cb, x, f0, pf, total);
  for (int r = 0; r < R; ++r) {
    __m512 t[Z];
    for (int z = 0; z < Z; ++z) t[z] = _mm512_load_ps(total + (r * Z + z) * 16);
    to_columns<Z>(w, t);
    for (int z = 0; z < Z; ++z) {
      float* p = o[r] + cb + 16 * z;
      _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), t[z]));
    }
  }
}

// A run's passes over gate_up: columns col[0 .. nc) + [0, 16 z) (nc 2: gate and up together).
struct QuantPass {
  int col[2], nc, z;
};

template <int R, class M>
inline void run_pass(const M& w, const QuantPass& p, int r0, int r1, const bf16* const* x, LineCursor& pf,
                     float* total) {
  if (p.nc == 2) {
    if constexpr (R <= 2) {
      if (p.z == 4) return scaled_pass<R, 4, 2>(w, r0, r1, p.col, x, 0, pf, total);
      return scaled_pass<R, 2, 2>(w, r0, r1, p.col, x, 0, pf, total);
    }
  }
  if (p.z == 4) return scaled_pass<R, 4, 1>(w, r0, r1, p.col, x, 0, pf, total);
  scaled_pass<R, 2, 1>(w, r0, r1, p.col, x, 0, pf, total);
}

// Bytes per stored row of w (int4: a byte row holds two weight rows).
template <class S>
inline int stored_row(const Int4Mat<S>&, int r) { return r >> 1; }
template <class S>
inline int stored_row(const Int8Mat<S>&, int r) { return r; }

// Units (j, b) .. (j, b + nu - 1) for R routed rows, in the header's memory order: the gate/up sums wait in s.acc
// between slabs (the passes: per unit or even-odd pair of units, gate and up together where R <= 2), then per unit
// or pair the activation and the down rows; the prefetch cursor covers the run's lines and scales in that order.
template <int R, class M>
void quant_run(const Call& c, int j, int b, int nu, const int* rows, Scratch& s, float* partial, Phases* ph) {
  const M gu = gate_up_mat<M>(c, j), dn = down_mat<M>(c, j);
  const int c_lo = b * kBlock, cols = nu * kBlock;
  thread_local std::vector<QuantPass> passes;
  thread_local LineCursor pf;
  passes.clear();
  for (int u = 0; u < nu;) {
    const int z = ((b + u) % 2 == 0 && u + 1 < nu) ? 4 : 2, c0 = (b + u) * kBlock;
    if (R <= 2) {
      passes.push_back({{c0, c.f + c0}, 2, z});
    } else {
      passes.push_back({{c0, 0}, 1, z});
      passes.push_back({{c.f + c0, 0}, 1, z});
    }
    u += z / 2;
  }
  size_t floats = 0;
  for (const QuantPass& p : passes) floats += size_t(R) * p.nc * p.z * 16;
  s.acc.assign(floats, 0.0f);
  const int slab = std::min(scale_group(gu, c.d), kQuantSlab * (kIsInt4<M> ? 2 : 1));
  pf.clear();
  const size_t es = sizeof(*gu.scale_row(0));
  for (int g0 = 0; g0 < c.d; g0 += slab) {  // the slab's scale row where a group starts, then its rows
    if (g0 % scale_group(gu, c.d) == 0)
      pf.add(gu.scale_row(g0), 0, 1, c_lo * es, (c.f + c_lo) * es, cols * es, true, false);
    pf.add(gu.q + size_t(stored_row(gu, g0)) * gu.ld, gu.ld, stored_row(gu, slab), c_lo, c.f + c_lo, cols, true,
           true);
  }
  const int g_dn = scale_group(dn, c.f);  // down: the scale rows of the run's rows, then the rows (contiguous)
  for (int g0 = c_lo / g_dn * g_dn; g0 < c_lo + cols; g0 += g_dn)
    pf.add(dn.scale_row(g0), 0, 1, 0, 0, c.d * sizeof(*dn.scale_row(0)), false, false);
  pf.add(dn.q + size_t(stored_row(dn, c_lo)) * dn.ld, dn.ld, stored_row(dn, cols), 0, 0, c.d, false, true);
  const int slab_lines = stored_row(gu, slab) * 2 * ((cols + 63) / 64 + 1);
  if (kQuantLead == 0) pf.clear();
  pf.issue(kQuantLead > 0 ? kQuantLead : slab_lines + 256);
  const bf16* x[R];
  for (int r = 0; r < R; ++r) x[r] = c.h + size_t(rows[r]) * c.d;
  int64_t t = ph ? now_ns() : 0;
  for (int g0 = 0; g0 < c.d; g0 += slab) {
    float* total = s.acc.data();
    for (const QuantPass& p : passes) {
      run_pass<R>(gu, p, g0, g0 + slab, x, pf, total);
      total += size_t(R) * p.nc * p.z * 16;
    }
  }
  // The sums in column order: g[r * cols + i], u likewise (column c_lo + i).
  s.gu.resize(std::max(s.gu.size(), 2 * size_t(R) * cols));
  float* g = s.gu.data();
  float* u = g + size_t(R) * cols;
  const float* total = s.acc.data();
  for (const QuantPass& p : passes) {
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < p.nc; ++n) {
        __m512 v[4];
        const float* tr = total + (r * p.nc + n) * p.z * 16;
        for (int z = 0; z < p.z; ++z) v[z] = _mm512_loadu_ps(tr + 16 * z);
        if (p.z == 4)
          to_columns<4>(gu, v);
        else
          to_columns<2>(gu, v);
        const bool up = p.col[n] >= c.f;
        float* out = (up ? u : g) + size_t(r) * cols + (p.col[n] - (up ? c.f : 0) - c_lo);
        for (int z = 0; z < p.z; ++z) _mm512_storeu_ps(out + 16 * z, v[z]);
      }
    total += size_t(R) * p.nc * p.z * 16;
  }
  if (ph) { const int64_t t1 = now_ns(); ph->gate_up += t1 - t; t = t1; }
  s.act.resize(std::max(s.act.size(), size_t(R) * cols));
  bf16* act = s.act.data();  // [R][cols]
  const float* coef = c.coef + size_t(j) * c.n;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < cols; i += kBlock)
      activation_avx(g + size_t(r) * cols + i, u + size_t(r) * cols + i, coef[rows[r]], act + size_t(r) * cols + i);
  if (ph) { const int64_t t1 = now_ns(); ph->act += t1 - t; t = t1; }
  float* o[R];
  for (int r = 0; r < R; ++r) o[r] = partial + size_t(rows[r]) * c.d;
  for (int u0 = 0; u0 < nu;) {  // units paired as in the gate_up passes
    const int n = ((b + u0) % 2 == 0 && u0 + 1 < nu) ? 2 * kBlock : kBlock, f0 = c_lo + u0 * kBlock;
    const bf16* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = act + size_t(r) * cols + u0 * kBlock;
    int cb = 0;
    for (; cb + 64 <= c.d; cb += 64) down_block<R, 4>(dn, f0, n, std::min(g_dn, n), cb, xr, o, pf);
    if (cb < c.d) down_block<R, 2>(dn, f0, n, std::min(g_dn, n), cb, xr, o, pf);  // d is a multiple of 32
    u0 += n / kBlock;
  }
  if (ph) ph->down += now_ns() - t;
}

template <class M>
void quant_run_avx(const Call& c, int j, int b, int nu, const int* rows, int m, Scratch& s, float* partial,
                   Phases* ph) {
  switch (m) {
    case 1: return quant_run<1, M>(c, j, b, nu, rows, s, partial, ph);
    case 2: return quant_run<2, M>(c, j, b, nu, rows, s, partial, ph);
    case 3: return quant_run<3, M>(c, j, b, nu, rows, s, partial, ph);
    default: return quant_run<4, M>(c, j, b, nu, rows, s, partial, ph);
  }
}

#pragma GCC pop_options
#endif

// Units (j, b) .. (j, b + nu - 1) of int8 or int4 expert j for its m routed rows, on these kernels where they take
// them (m <= the format's g_quant_rows; int4: the CPU has AVX-512 VBMI); false where they do not.
template <class M>
bool quant_units(const Call& c, int j, int b, int nu, const int* rows, int m, Scratch& s, float* partial,
                 Phases* ph) {
#if defined(__x86_64__)
  if (m > g_quant_rows[kIsInt4<M> ? 0 : 1].load() || (kIsInt4<M> && !kHasVbmi)) return false;
  quant_run_avx<M>(c, j, b, nu, rows, m, s, partial, ph);
  return true;
#else
  return false;
#endif
}

}  // namespace pdscope_cpu_ffn
