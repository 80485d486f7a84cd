// One unit of work (expert j, 32 intermediate columns): portable and AVX-512 BF16 kernels.
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

namespace pdscope_cpu_ffn {

// ---------------------------------------------------------------------------------------------------------
// Portable kernels.
void gate_up_scalar(const Call& c, const bf16* w, int b, const int* rows, int m, float* g, float* u) {
  const size_t ld = 2 * size_t(c.f);
  const int c0 = b * kBlock;
  std::fill(g, g + m * kBlock, 0.0f);
  std::fill(u, u + m * kBlock, 0.0f);
  for (int dd = 0; dd < c.d; ++dd) {
    const bf16* wg = w + dd * ld + c0;
    const bf16* wu = wg + c.f;
    float wgf[kBlock], wuf[kBlock];
    for (int i = 0; i < kBlock; ++i) { wgf[i] = bf16_to_f32(wg[i]); wuf[i] = bf16_to_f32(wu[i]); }
    for (int r = 0; r < m; ++r) {
      const float x = bf16_to_f32(c.h[size_t(rows[r]) * c.d + dd]);
      for (int i = 0; i < kBlock; ++i) { g[r * kBlock + i] += x * wgf[i]; u[r * kBlock + i] += x * wuf[i]; }
    }
  }
}

void down_scalar(const Call& c, const bf16* w, int b, const int* rows, int m, const bf16* act, float* partial) {
  const int f0 = b * kBlock;
  for (int i = 0; i < kBlock; ++i) {
    const bf16* wr = w + size_t(f0 + i) * c.d;
    for (int r = 0; r < m; ++r) {
      const float a = bf16_to_f32(act[r * kBlock + i]);
      float* o = partial + size_t(rows[r]) * c.d;
      for (int col = 0; col < c.d; ++col) o[col] += a * bf16_to_f32(wr[col]);
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

// The gate and up columns of weight rows dd and dd+1 of one unit, interleaved as the dot products take them:
// out[0], out[1] gate (lo, hi), out[2], out[3] up. Prefetches kGuPrefetch pairs ahead (past the end is harmless:
// prefetches never fault).
inline void load_gate_up_pair(const bf16* p0, size_t ld, int f, bool prefetch, __m512i out[4]) {
  const bf16* p1 = p0 + ld;
  if (prefetch && kGuPrefetch > 0) {
    const bf16* q = p0 + kGuPrefetch * 2 * ld;
    _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + ld), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + f), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + ld + f), _MM_HINT_T0);
  }
  const __m512i g0 = _mm512_loadu_si512(p0), g1 = _mm512_loadu_si512(p1);
  const __m512i u0 = _mm512_loadu_si512(p0 + f), u1 = _mm512_loadu_si512(p1 + f);
  out[0] = _mm512_unpacklo_epi16(g0, g1);
  out[1] = _mm512_unpackhi_epi16(g0, g1);
  out[2] = _mm512_unpacklo_epi16(u0, u1);
  out[3] = _mm512_unpackhi_epi16(u0, u1);
}

template <int R>
void gate_up_avx(const Call& c, const bf16* w, int b, const int* rows, float* g, float* u, bool prefetch) {
  const size_t ld = 2 * size_t(c.f);
  const bf16* wg = w + size_t(b) * kBlock;
  const bf16* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = c.h + size_t(rows[r]) * c.d;
  __m512 g_lo[R], g_hi[R], u_lo[R], u_hi[R];
  for (int r = 0; r < R; ++r) g_lo[r] = g_hi[r] = u_lo[r] = u_hi[r] = _mm512_setzero_ps();
  for (int dd = 0; dd < c.d; dd += 2) {
    __m512i w[4];
    load_gate_up_pair(wg + size_t(dd) * ld, ld, c.f, prefetch, w);
    const __m512bh glo = as_bh(w[0]), ghi = as_bh(w[1]), ulo = as_bh(w[2]), uhi = as_bh(w[3]);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = as_bh(pair_of(xr[r] + dd));
      g_lo[r] = _mm512_dpbf16_ps(g_lo[r], glo, x);
      g_hi[r] = _mm512_dpbf16_ps(g_hi[r], ghi, x);
      u_lo[r] = _mm512_dpbf16_ps(u_lo[r], ulo, x);
      u_hi[r] = _mm512_dpbf16_ps(u_hi[r], uhi, x);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 a, bb;
    unpermute(g_lo[r], g_hi[r], &a, &bb);
    _mm512_storeu_ps(g + r * kBlock, a);
    _mm512_storeu_ps(g + r * kBlock + 16, bb);
    unpermute(u_lo[r], u_hi[r], &a, &bb);
    _mm512_storeu_ps(u + r * kBlock, a);
    _mm512_storeu_ps(u + r * kBlock + 16, bb);
  }
}

// Many rows: each chunk of 2 * kChunkPairs weight rows is loaded from memory once, interleaved into a
// contiguous buffer, and every block of R rows runs over that buffer, its accumulators parked in `acc`
// between chunks. (Re-walking the unit's rows per row block, 2F elements apart, missed the TLB on every row.)
template <int R>
void gate_up_chunk_rows(const Call& c, const __m512i* wbuf, int dd0, const int* rows, float* acc) {
  __m512 a[R][4];
  const bf16* xr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = c.h + size_t(rows[r]) * c.d + dd0;
    for (int q = 0; q < 4; ++q) a[r][q] = _mm512_loadu_ps(acc + (r * 4 + q) * 16);
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
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(acc + (r * 4 + q) * 16, a[r][q]);
}

template <int R>
void gate_up_chunk_rows_upto(const Call& c, const __m512i* wbuf, int dd0, const int* rows, int m, float* acc) {
  if constexpr (R > 1) {
    if (m < R) return gate_up_chunk_rows_upto<R - 1>(c, wbuf, dd0, rows, m, acc);
  }
  gate_up_chunk_rows<R>(c, wbuf, dd0, rows, acc);
}

// g, u [m, kBlock]: the unit's gate and up columns for all m rows (any m >= 1).
void gate_up_many(const Call& c, const bf16* w, int b, const int* rows, int m, Scratch& s, float* g, float* u) {
  const size_t ld = 2 * size_t(c.f);
  const bf16* wg = w + size_t(b) * kBlock;
  s.acc.assign(size_t(m) * 64, 0.0f);
  s.pairs.resize(kChunkPairs * 4 * 32 + 32);
  __m512i* wbuf = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(s.pairs.data()) + 63) & ~uintptr_t(63));
  for (int dd0 = 0; dd0 < c.d; dd0 += 2 * kChunkPairs) {
    for (int p = 0; p < kChunkPairs; ++p) {
      __m512i w[4];
      load_gate_up_pair(wg + size_t(dd0 + 2 * p) * ld, ld, c.f, true, w);
      for (int q = 0; q < 4; ++q) _mm512_store_si512(wbuf + 4 * p + q, w[q]);
    }
    for (int r0 = 0; r0 < m; r0 += kGuRows)
      gate_up_chunk_rows_upto<kGuRows>(c, wbuf, dd0, rows + r0, std::min(kGuRows, m - r0), s.acc.data() + r0 * 64);
  }
  for (int r = 0; r < m; ++r) {
    const float* a = s.acc.data() + r * 64;
    __m512 first, second;
    unpermute(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16), &first, &second);
    _mm512_storeu_ps(g + r * kBlock, first);
    _mm512_storeu_ps(g + r * kBlock + 16, second);
    unpermute(_mm512_loadu_ps(a + 32), _mm512_loadu_ps(a + 48), &first, &second);
    _mm512_storeu_ps(u + r * kBlock, first);
    _mm512_storeu_ps(u + r * kBlock + 16, second);
  }
}

template <int R>
void down_avx(const Call& c, const bf16* w, int b, const int* rows, const bf16* act, float* partial,
              bool prefetch) {
  const size_t ld = size_t(c.d);
  const bf16* w0 = w + size_t(b) * kBlock * ld;
  float* o[R];
  for (int r = 0; r < R; ++r) o[r] = partial + size_t(rows[r]) * ld;
  for (int cb = 0; cb < c.d; cb += kBlock) {
    if (prefetch && kDownPrefetch > 0) {
      const int ahead = cb + kDownPrefetch * kBlock;
      if (ahead < c.d)
        for (int i = 0; i < kBlock; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(w0 + i * ld + ahead), _MM_HINT_T0);
    }
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int i = 0; i < kBlock; i += 2) {
      const bf16* p0 = w0 + i * ld + cb;
      const __m512i a0 = _mm512_loadu_si512(p0), a1 = _mm512_loadu_si512(p0 + ld);
      const __m512bh wlo = as_bh(_mm512_unpacklo_epi16(a0, a1)), whi = as_bh(_mm512_unpackhi_epi16(a0, a1));
      for (int r = 0; r < R; ++r) {
        const __m512bh x = as_bh(pair_of(act + r * kBlock + i));
        lo[r] = _mm512_dpbf16_ps(lo[r], wlo, x);
        hi[r] = _mm512_dpbf16_ps(hi[r], whi, x);
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

template <int R>
void gate_up_avx_upto(const Call& c, const bf16* w, int b, const int* rows, int m, float* g, float* u, bool pf) {
  if constexpr (R > 1) {
    if (m < R) return gate_up_avx_upto<R - 1>(c, w, b, rows, m, g, u, pf);
  }
  gate_up_avx<R>(c, w, b, rows, g, u, pf);
}

template <int R>
void down_avx_upto(const Call& c, const bf16* w, int b, const int* rows, int m, const bf16* act, float* partial,
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
    const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    const __m512 a = _mm512_mul_ps(_mm512_mul_ps(sig, _mm512_loadu_ps(u + i)), _mm512_set1_ps(scale));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + i), (__m256i)_mm512_cvtneps_pbh(a));
  }
}

void unit_avx(const Call& c, int j, int b, const int* rows, int m, Scratch& s, float* partial, Phases* ph) {
  const bf16* gu = c.gate_up[j];
  float* g = s.gu.data();
  float* u = g + kGuRows * kBlock;
  bf16* act = s.act.data();
  const float* coef = c.coef + size_t(j) * c.n;
  int64_t t = ph ? now_ns() : 0;
  if (m <= kGuRows) {  // one pass over the weights either way: skip the chunk buffer
    gate_up_avx_upto<kGuRows>(c, gu, b, rows, m, g, u, true);
  } else {
    u = g + size_t(m) * kBlock;
    gate_up_many(c, gu, b, rows, m, s, g, u);
  }
  if (ph) { const int64_t t1 = now_ns(); ph->gate_up += t1 - t; t = t1; }
  for (int r = 0; r < m; ++r) activation_avx(g + r * kBlock, u + r * kBlock, coef[rows[r]], act + r * kBlock);
  if (ph) { const int64_t t1 = now_ns(); ph->act += t1 - t; t = t1; }
  for (int r0 = 0; r0 < m; r0 += kDownRows) {
    const int rb = std::min(kDownRows, m - r0);
    down_avx_upto<kDownRows>(c, c.down[j], b, rows + r0, rb, act + r0 * kBlock, partial, r0 == 0);
  }
  if (ph) ph->down += now_ns() - t;
}

bool cpu_has_avx512bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

#pragma GCC pop_options
#else
bool cpu_has_avx512bf16() { return false; }
void unit_avx(const Call&, int, int, const int*, int, Scratch&, float*, Phases*) {}
#endif

void unit_scalar(const Call& c, int j, int b, const int* rows, int m, Scratch& s, float* partial) {
  std::vector<float> g(size_t(m) * kBlock), u(size_t(m) * kBlock);
  gate_up_scalar(c, c.gate_up[j], b, rows, m, g.data(), u.data());
  bf16* act = s.act.data();
  const float* coef = c.coef + size_t(j) * c.n;
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < kBlock; ++i)
      act[r * kBlock + i] = f32_to_bf16(coef[rows[r]] * silu(g[r * kBlock + i]) * u[r * kBlock + i]);
  down_scalar(c, c.down[j], b, rows, m, act, partial);
}

}  // namespace pdscope_cpu_ffn
