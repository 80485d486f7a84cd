// One unit of work (expert j, 32 intermediate columns): portable and AVX-512 BF16 kernels, each a template over
// the weights' format (a view of ffn_weights.h: M::value for the portable path, pair_of_rows for AVX-512).
// run_units hands int8 and int4 experts of few rows to ffn_quant.h's kernels first (a run of units at a time).
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ffn_types.h"
#include "ffn_weights.h"

namespace pdscope_cpu_ffn {

// ---------------------------------------------------------------------------------------------------------
// Portable kernels.
// The view of expert j's gate_up [d, 2f] and down [f, d] in the call's format.
template <class M>
M gate_up_mat(const Call& c, int j) {
  return M(c.gate_up[j], c.gate_up_scale.empty() ? nullptr : c.gate_up_scale[j], 2 * size_t(c.f), c.gu_group);
}
template <class M>
M down_mat(const Call& c, int j) {
  return M(c.down[j], c.down_scale.empty() ? nullptr : c.down_scale[j], size_t(c.d), c.dn_group);
}

template <class M>
void gate_up_scalar(const Call& c, const M& w, int b, const int* rows, int m, float* g, float* u) {
  const int c0 = b * kBlock;
  std::fill(g, g + m * kBlock, 0.0f);
  std::fill(u, u + m * kBlock, 0.0f);
  for (int dd = 0; dd < c.d; ++dd) {
    float wgf[kBlock], wuf[kBlock];
    for (int i = 0; i < kBlock; ++i) { wgf[i] = w.value(dd, c0 + i); wuf[i] = w.value(dd, c.f + c0 + i); }
    for (int r = 0; r < m; ++r) {
      const float x = bf16_to_f32(c.h[size_t(rows[r]) * c.d + dd]);
      for (int i = 0; i < kBlock; ++i) { g[r * kBlock + i] += x * wgf[i]; u[r * kBlock + i] += x * wuf[i]; }
    }
  }
}

template <class M>
void down_scalar(const Call& c, const M& w, int b, const int* rows, int m, const bf16* act, float* partial) {
  const int f0 = b * kBlock;
  std::vector<float> wr(c.d);
  for (int i = 0; i < kBlock; ++i) {
    for (int col = 0; col < c.d; ++col) wr[col] = w.value(f0 + i, col);
    for (int r = 0; r < m; ++r) {
      const float a = bf16_to_f32(act[r * kBlock + i]);
      float* o = partial + size_t(rows[r]) * c.d;
      for (int col = 0; col < c.d; ++col) o[col] += a * wr[col];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 BF16 kernels. vdpbf16ps multiplies pairs along the reduction axis, so two consecutive weight rows
// are interleaved (unpacklo/hi_epi16); that leaves the 32 columns of a block permuted across the two
// accumulators, undone once per block by kUnpermute.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

inline __m512i pair_of(const bf16* p) {  // broadcast the bf16 pair p[0], p[1]
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Accumulator lane i of lo holds column (i/4)*8 + i%4, of hi column (i/4)*8 + 4 + i%4.
inline void unpermute(__m512 lo, __m512 hi, __m512* first, __m512* second) {
  alignas(64) static const int32_t idx[2][16] = {
      {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
      {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
  *first = _mm512_permutex2var_ps(lo, _mm512_load_si512(idx[0]), hi);
  *second = _mm512_permutex2var_ps(lo, _mm512_load_si512(idx[1]), hi);
}

// out[0 .. 32) = the 32 columns of accumulators lo, hi in column order.
inline void store_unpermuted(__m512 lo, __m512 hi, float* out) {
  __m512 first, second;
  unpermute(lo, hi, &first, &second);
  _mm512_storeu_ps(out, first);
  _mm512_storeu_ps(out + 16, second);
}

// The gate and up columns [c0, c0 + 32) of weight rows dd and dd+1, interleaved as the dot products take them:
// out[0], out[1] gate (lo, hi), out[2], out[3] up. Prefetches kGuPrefetch pairs ahead (past the end is harmless:
// prefetches never fault).
template <class M>
inline void load_gate_up_pair(const M& w, int dd, int c0, int f, bool prefetch, __m512i out[4]) {
  if (prefetch && kGuPrefetch > 0) {
    prefetch_rows(w, dd + 2 * kGuPrefetch, c0);
    prefetch_rows(w, dd + 2 * kGuPrefetch, f + c0);
  }
  __m512i g0, g1, u0, u1;
  pair_of_rows(w, dd, c0, &g0, &g1);
  pair_of_rows(w, dd, f + c0, &u0, &u1);
  out[0] = _mm512_unpacklo_epi16(g0, g1);
  out[1] = _mm512_unpackhi_epi16(g0, g1);
  out[2] = _mm512_unpacklo_epi16(u0, u1);
  out[3] = _mm512_unpackhi_epi16(u0, u1);
}

// NB consecutive units' gate and up columns (blocks b .. b + NB - 1) for R rows in one pass over the weight rows:
// g, u [NB, R, kBlock]. A row's NB gate lines and NB up lines are adjacent, so each weight row (2F elements from the
// next: its own page) is visited once for all NB units; one unit a pass visits every row's page once per unit.
// Prefetches kGuPrefetch row pairs ahead (past the end is harmless: prefetches never fault).
template <int R, int NB, class M>
void gate_up_wide(const Call& c, const M& w, int b, const int* rows, float* g, float* u) {
  const bf16* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = c.h + size_t(rows[r]) * c.d;
  __m512 acc[NB][R][4];
  for (int k = 0; k < NB; ++k)
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) acc[k][r][q] = _mm512_setzero_ps();
  const int c0 = b * kBlock;
  for (int dd = 0; dd < c.d; dd += 2) {
    if (kGuPrefetch > 0)
      for (int k = 0; k < NB; ++k) {
        prefetch_rows(w, dd + 2 * kGuPrefetch, c0 + k * kBlock);
        prefetch_rows(w, dd + 2 * kGuPrefetch, c.f + c0 + k * kBlock);
      }
    __m512bh x[R];
    for (int r = 0; r < R; ++r) x[r] = as_bh(pair_of(xr[r] + dd));
    for (int k = 0; k < NB; ++k) {
      __m512i v[4];
      load_gate_up_pair(w, dd, c0 + k * kBlock, c.f, false, v);
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) acc[k][r][q] = _mm512_dpbf16_ps(acc[k][r][q], as_bh(v[q]), x[r]);
    }
  }
  for (int k = 0; k < NB; ++k)
    for (int r = 0; r < R; ++r) {
      store_unpermuted(acc[k][r][0], acc[k][r][1], g + (size_t(k) * R + r) * kBlock);
      store_unpermuted(acc[k][r][2], acc[k][r][3], u + (size_t(k) * R + r) * kBlock);
    }
}

// gate_up_wide for m <= kGuRows rows and 1 <= nb <= wide_units(m) units.
template <class M>
void gate_up_wide_any(const Call& c, const M& w, int b, int nb, const int* rows, int m, float* g, float* u) {
  if (nb == 1) {
    if (m == 1) return gate_up_wide<1, 1>(c, w, b, rows, g, u);
    if (m == 2) return gate_up_wide<2, 1>(c, w, b, rows, g, u);
    if (m == 3) return gate_up_wide<3, 1>(c, w, b, rows, g, u);
    return gate_up_wide<4, 1>(c, w, b, rows, g, u);
  }
  if (m == 2) return gate_up_wide<2, 2>(c, w, b, rows, g, u);
  if (nb == 2) return gate_up_wide<1, 2>(c, w, b, rows, g, u);
  if (nb == 3) return gate_up_wide<1, 3>(c, w, b, rows, g, u);
  gate_up_wide<1, 4>(c, w, b, rows, g, u);
}

// Many rows: each chunk of 2 * kChunkPairs weight rows is loaded from memory once, interleaved into a
// contiguous buffer, and every block of R rows runs over that buffer, its accumulators parked in `acc`
// between chunks. (Re-walking the unit's rows per row block, 2F elements apart, missed the TLB on every row.)
// scale (quantized weights; else null): the chunk's sums start from 0 and are added to acc times scale[q].
template <int R>
void gate_up_chunk_rows(const Call& c, const __m512i* wbuf, int dd0, const int* rows, float* acc,
                        const __m512* scale) {
  __m512 a[R][4];
  const bf16* xr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = c.h + size_t(rows[r]) * c.d + dd0;
    for (int q = 0; q < 4; ++q) a[r][q] = scale ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r * 4 + q) * 16);
  }
  for (int p = 0; p < kChunkPairs; ++p) {
    const __m512bh w0 = as_bh(_mm512_load_si512(wbuf + 4 * p)), w1 = as_bh(_mm512_load_si512(wbuf + 4 * p + 1));
    const __m512bh w2 = as_bh(_mm512_load_si512(wbuf + 4 * p + 2)), w3 = as_bh(_mm512_load_si512(wbuf + 4 * p + 3));
    for (int r = 0; r < R; ++r) {
      const __m512bh x = as_bh(pair_of(xr[r] + 2 * p));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], w0, x);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], w1, x);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], w2, x);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], w3, x);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) {
      float* p = acc + (r * 4 + q) * 16;
      _mm512_storeu_ps(p, scale ? _mm512_fmadd_ps(a[r][q], scale[q], _mm512_loadu_ps(p)) : a[r][q]);
    }
}

template <int R>
void gate_up_chunk_rows_upto(const Call& c, const __m512i* wbuf, int dd0, const int* rows, int m, float* acc,
                             const __m512* scale) {
  if constexpr (R > 1) {
    if (m < R) return gate_up_chunk_rows_upto<R - 1>(c, wbuf, dd0, rows, m, acc, scale);
  }
  gate_up_chunk_rows<R>(c, wbuf, dd0, rows, acc, scale);
}

// g, u [nb, m, kBlock]: the gate and up columns of nb consecutive units (blocks b .. b + nb - 1) for all m rows
// (any m >= 1). Per chunk, the units run one after another, so the later ones find the chunk's weight lines in
// the cache: with quantized weights a unit's 32 columns are half a line, and a pass over two units' columns
// costs what one unit's costs (the passes are bound by lines and pages touched per row, not bytes).
template <class M>
void gate_up_many(const Call& c, const M& w, int b, int nb, const int* rows, int m, Scratch& s, float* g, float* u) {
  s.acc.assign(size_t(nb) * m * 64, 0.0f);
  s.pairs.resize(kChunkPairs * 4 * 32 + 32);
  __m512i* wbuf = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(s.pairs.data()) + 63) & ~uintptr_t(63));
  for (int dd0 = 0; dd0 < c.d; dd0 += 2 * kChunkPairs) {
    for (int k = 0; k < nb; ++k) {
      for (int p = 0; p < kChunkPairs; ++p) {
        __m512i v[4];
        load_gate_up_pair(w, dd0 + 2 * p, (b + k) * kBlock, c.f, k == 0, v);
        for (int q = 0; q < 4; ++q) _mm512_store_si512(wbuf + 4 * p + q, v[q]);
      }
      float* acc = s.acc.data() + size_t(k) * m * 64;
      __m512 scale[4];
      if constexpr (M::kScaled) {  // the chunk's 32 rows share a scale row
        permuted_scales(w, dd0, (b + k) * kBlock, &scale[0], &scale[1]);
        permuted_scales(w, dd0, c.f + (b + k) * kBlock, &scale[2], &scale[3]);
      }
      for (int r0 = 0; r0 < m; r0 += kGuRows)
        gate_up_chunk_rows_upto<kGuRows>(c, wbuf, dd0, rows + r0, std::min(kGuRows, m - r0), acc + r0 * 64,
                                         M::kScaled ? scale : nullptr);
    }
  }
  for (int r = 0; r < nb * m; ++r) {
    const float* a = s.acc.data() + r * 64;
    store_unpermuted(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16), g + r * kBlock);
    store_unpermuted(_mm512_loadu_ps(a + 32), _mm512_loadu_ps(a + 48), u + r * kBlock);
  }
}

template <int R, class M>
void down_avx(const Call& c, const M& w, int b, const int* rows, const bf16* act, float* partial,
              bool prefetch) {
  const int f0 = b * kBlock;
  float* o[R];
  for (int r = 0; r < R; ++r) o[r] = partial + size_t(rows[r]) * c.d;
  for (int cb = 0; cb < c.d; cb += kBlock) {
    if (prefetch && kDownPrefetch > 0) {
      const int ahead = cb + kDownPrefetch * kBlock;
      if (ahead < c.d)
        for (int i = 0; i < kBlock; i += 2) prefetch_rows(w, f0 + i, ahead);
    }
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int i = 0; i < kBlock; i += 2) {
      __m512i a0, a1;
      pair_of_rows(w, f0 + i, cb, &a0, &a1);
      const __m512bh wlo = as_bh(_mm512_unpacklo_epi16(a0, a1)), whi = as_bh(_mm512_unpackhi_epi16(a0, a1));
      for (int r = 0; r < R; ++r) {
        const __m512bh x = as_bh(pair_of(act + r * kBlock + i));
        lo[r] = _mm512_dpbf16_ps(lo[r], wlo, x);
        hi[r] = _mm512_dpbf16_ps(hi[r], whi, x);
      }
    }
    if constexpr (M::kScaled) {  // the unit's 32 rows share a scale row
      __m512 s_lo, s_hi;
      permuted_scales(w, f0, cb, &s_lo, &s_hi);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_mul_ps(lo[r], s_lo);
        hi[r] = _mm512_mul_ps(hi[r], s_hi);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 a, bb;
      unpermute(lo[r], hi[r], &a, &bb);
      _mm512_storeu_ps(o[r] + cb, _mm512_add_ps(_mm512_loadu_ps(o[r] + cb), a));
      _mm512_storeu_ps(o[r] + cb + 16, _mm512_add_ps(_mm512_loadu_ps(o[r] + cb + 16), bb));
    }
  }
}

template <int R, class M>
void down_avx_upto(const Call& c, const M& w, int b, const int* rows, int m, const bf16* act, float* partial,
                   bool pf) {
  if constexpr (R > 1) {
    if (m < R) return down_avx_upto<R - 1>(c, w, b, rows, m, act, partial, pf);
  }
  down_avx<R>(c, w, b, rows, act, partial, pf);
}

// exp(x) for x in [-88, 88]: 2^(x log2 e) split into 2^n (scalef) and a degree-6 polynomial of the
// fraction (relative error ~2e-7, far below the bf16 rounding the activation gets next).
inline __m512 exp_avx(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // in [-0.35, 0.35]
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// act[0..32) = bf16(scale * silu(g) * u) for one row's 32 columns, rounded to nearest even like f32_to_bf16.
inline void activation_avx(const float* g, const float* u, float scale, bf16* act) {
  for (int i = 0; i < kBlock; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
    const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx(neg)));
    const __m512 a = _mm512_mul_ps(_mm512_mul_ps(sig, _mm512_loadu_ps(u + i)), _mm512_set1_ps(scale));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + i), (__m256i)_mm512_cvtneps_pbh(a));
  }
}

// Units (j, b) .. (j, b + nb - 1) of one expert (quantized: nb 1 or 2, see gate_up_many; bf16: at most
// wide_units(m)), in order.
template <class M>
void unit_avx(const Call& c, int j, int b, int nb, const int* rows, int m, Scratch& s, float* partial, Phases* ph) {
  const M gu = gate_up_mat<M>(c, j), dn = down_mat<M>(c, j);
  float* g = s.gu.data();
  float* u = g + size_t(nb) * m * kBlock;
  const float* coef = c.coef + size_t(j) * c.n;
  int64_t t = ph ? now_ns() : 0;
  if (!M::kScaled && m <= kGuRows && nb <= wide_units(m))  // one pass over the weights either way: no chunk buffer
    gate_up_wide_any(c, gu, b, nb, rows, m, g, u);
  else
    gate_up_many(c, gu, b, nb, rows, m, s, g, u);
  if (ph) { const int64_t t1 = now_ns(); ph->gate_up += t1 - t; t = t1; }
  for (int k = 0; k < nb; ++k) {
    bf16* act = s.act.data();
    const float* gk = g + size_t(k) * m * kBlock;
    const float* uk = u + size_t(k) * m * kBlock;
    for (int r = 0; r < m; ++r) activation_avx(gk + r * kBlock, uk + r * kBlock, coef[rows[r]], act + r * kBlock);
    if (ph) { const int64_t t1 = now_ns(); ph->act += t1 - t; t = t1; }
    for (int r0 = 0; r0 < m; r0 += kDownRows) {
      const int rb = std::min(kDownRows, m - r0);
      down_avx_upto<kDownRows>(c, dn, b + k, rows + r0, rb, act + r0 * kBlock, partial, r0 == 0);
    }
    if (ph) { const int64_t t1 = now_ns(); ph->down += t1 - t; t = t1; }
  }
}

bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

bool cpu_has_avx512vbmi() {  // the int4 few-row kernels' nibble spread (ffn_quant.h)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
}

#pragma GCC pop_options
#else
bool cpu_has_avx512bf16() { return false; }
bool cpu_has_avx512vbmi() { return false; }
template <class M>
void unit_avx(const Call&, int, int, int, const int*, int, Scratch&, float*, Phases*) {}
#endif

template <class M>
void unit_scalar(const Call& c, int j, int b, const int* rows, int m, Scratch& s, float* partial) {
  std::vector<float> g(size_t(m) * kBlock), u(size_t(m) * kBlock);
  gate_up_scalar(c, gate_up_mat<M>(c, j), b, rows, m, g.data(), u.data());
  bf16* act = s.act.data();
  const float* coef = c.coef + size_t(j) * c.n;
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < kBlock; ++i)
      act[r * kBlock + i] = f32_to_bf16(coef[rows[r]] * silu(g[r * kBlock + i]) * u[r * kBlock + i]);
  down_scalar(c, down_mat<M>(c, j), b, rows, m, act, partial);
}

// The few-row quantized kernels (ffn_quant.h): true where they took the units.
template <class M>
bool quant_units(const Call& c, int j, int b, int nu, const int* rows, int m, Scratch& s, float* partial,
                 Phases* ph);

// Units (j, b) .. (j, b + nb - 1) in the call's format and instruction set, or (quantized, few rows) all of the
// run (j, b) .. (j, b + run - 1) (run >= nb); returns how many it computed.
template <class M>
int run_units(const Call& c, int j, int b, int nb, int run, const int* rows, int m, Scratch& s, float* partial,
              Phases* ph) {
  if (c.isa >= kAvx512Bf16) {
    if constexpr (M::kScaled) {
      if (quant_units<M>(c, j, b, run, rows, m, s, partial, ph)) return run;
    }
    unit_avx<M>(c, j, b, nb, rows, m, s, partial, ph);
  } else {
    for (int k = 0; k < nb; ++k) unit_scalar<M>(c, j, b + k, rows, m, s, partial);
  }
  return nb;
}

}  // namespace pdscope_cpu_ffn
