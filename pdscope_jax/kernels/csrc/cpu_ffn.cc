// Routed-expert SwiGLU FFN on the CPU as XLA FFI handlers, reading bf16 weights where they lie.
//
// out[n, :] = sum_j coef[j, n] * (silu(h[n] @ Wg_j) * (h[n] @ Wu_j)) @ Wd_j        (float32 out [N, D])
// gate_up_j [D, 2F] row-major bf16 (gate = columns [0, F), up = [F, 2F)), down_j [F, D] bf16, h [N, D] bf16,
// coef [k, N] float32. Products accumulate in float32; silu runs in float32; the activation is rounded to bf16
// (after scaling by coef) before the down projection. A row whose coef is exactly 0 for expert j skips it;
// an expert with no such row reads none of its bytes.
//
// Work split: a unit is (expert j, 32 consecutive intermediate columns b). The units of all k experts are
// cut into one contiguous group per pool thread; threads claim groups and, per unit, compute its gate and up
// columns for the routed rows, the activation, and the matching 32 rows of down into the group's [N, D]
// float32 partial sum; one reduction at the end adds the partials in group order. No barrier between
// experts, every weight byte is read once per call, the split balances across experts, and the result does
// not depend on which thread ran which group (bitwise the same for a given pool size). Weights walk row by row with software prefetch (a unit's rows are 2F or D elements apart,
// too far for the hardware prefetchers).
//
// Handlers: pdscope_cpu_ffn_list (h, coef, k gate_ups, k downs -> out) and pdscope_cpu_ffn_stacked
// (h, coef, ids [k] int32, gate_up [E, D, 2F], down [E, F, D] -> out). Exported controls: threads, ISA.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bf16 = uint16_t;
constexpr int kBlock = 32;       // intermediate columns per unit (one 64-byte line of a weight row)
constexpr int kGuRows = 4;       // rows held in registers by the gate/up kernel (4 accumulators each)
constexpr int kDownRows = 8;     // rows held in registers by the down kernel (2 accumulators each)
constexpr int kChunkPairs = 16;  // weight row pairs per chunk of the many-row gate/up (4 KB interleaved)

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}
// Prefetch distances (0: none): gate/up row pairs ahead, down 32-column blocks ahead.
const int kGuPrefetch = env_int("PDSCOPE_CPU_FFN_PF_GU", 12);
const int kDownPrefetch = env_int("PDSCOPE_CPU_FFN_PF_DOWN", 4);

enum Isa : int { kScalar = 0, kAvx512Bf16 = 2 };

inline float bf16_to_f32(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Nanoseconds by phase, summed over a group's units (profiling only).
struct Phases {
  int64_t gate_up = 0, act = 0, down = 0, total = 0;
};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------------------------------------------------
// One call's problem and its plan.
struct Call {
  int n = 0, d = 0, f = 0, k = 0;
  const bf16* h = nullptr;              // [n, d]
  const float* coef = nullptr;          // [k, n]
  std::vector<const bf16*> gate_up;     // k x [d, 2f]
  std::vector<const bf16*> down;        // k x [f, d]
  float* out = nullptr;                 // [n, d]
  std::vector<int> rows, row_off;       // routed rows of expert j: rows[row_off[j] .. row_off[j+1])
  std::vector<int> unit_expert, unit_block;
  std::vector<float*> partials;         // per group of units: its [n, d] partial sum
  std::vector<char> used;               // per group: it had units (its partial is meaningful)
  std::atomic<size_t> next_chunk{0};    // the reduction's chunks, claimed likewise
  int isa = kScalar;
  bool profile = false;
  std::vector<Phases> group_ns;         // per group: where its time went (only when profiling)
};

struct Scratch {
  std::vector<bf16> act;       // [rows, kBlock]
  std::vector<float> gu;       // [2, max(rows, kGuRows), kBlock]: gate then up
  std::vector<float> acc;      // [rows, 4, 16]: the chunked gate/up's accumulators between chunks
  std::vector<uint16_t> pairs; // one chunk's interleaved weight pairs (64-byte aligned inside)
};

thread_local Scratch tls_scratch;

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

template <int R>
void gate_up_avx(const Call& c, const bf16* w, int b, const int* rows, float* g, float* u, bool prefetch) {
  const size_t ld = 2 * size_t(c.f);
  const bf16* wg = w + size_t(b) * kBlock;
  const bf16* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = c.h + size_t(rows[r]) * c.d;
  __m512 g_lo[R], g_hi[R], u_lo[R], u_hi[R];
  for (int r = 0; r < R; ++r) g_lo[r] = g_hi[r] = u_lo[r] = u_hi[r] = _mm512_setzero_ps();
  for (int dd = 0; dd < c.d; dd += 2) {
    const bf16* p0 = wg + size_t(dd) * ld;
    const bf16* p1 = p0 + ld;
    if (prefetch && kGuPrefetch > 0) {  // past the end is harmless: prefetches never fault
      const bf16* q = p0 + kGuPrefetch * 2 * ld;
      _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + ld), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + c.f), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + ld + c.f), _MM_HINT_T0);
    }
    const __m512i g0 = _mm512_loadu_si512(p0), g1 = _mm512_loadu_si512(p1);
    const __m512i u0 = _mm512_loadu_si512(p0 + c.f), u1 = _mm512_loadu_si512(p1 + c.f);
    const __m512bh glo = as_bh(_mm512_unpacklo_epi16(g0, g1)), ghi = as_bh(_mm512_unpackhi_epi16(g0, g1));
    const __m512bh ulo = as_bh(_mm512_unpacklo_epi16(u0, u1)), uhi = as_bh(_mm512_unpackhi_epi16(u0, u1));
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
      const bf16* p0 = wg + size_t(dd0 + 2 * p) * ld;
      const bf16* p1 = p0 + ld;
      if (kGuPrefetch > 0) {
        const bf16* q = p0 + kGuPrefetch * 2 * ld;
        _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + ld), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + c.f), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + ld + c.f), _MM_HINT_T0);
      }
      const __m512i g0 = _mm512_loadu_si512(p0), g1 = _mm512_loadu_si512(p1);
      const __m512i u0 = _mm512_loadu_si512(p0 + c.f), u1 = _mm512_loadu_si512(p1 + c.f);
      _mm512_store_si512(wbuf + 4 * p, _mm512_unpacklo_epi16(g0, g1));
      _mm512_store_si512(wbuf + 4 * p + 1, _mm512_unpackhi_epi16(g0, g1));
      _mm512_store_si512(wbuf + 4 * p + 2, _mm512_unpacklo_epi16(u0, u1));
      _mm512_store_si512(wbuf + 4 * p + 3, _mm512_unpackhi_epi16(u0, u1));
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

// ---------------------------------------------------------------------------------------------------------
// A pool of threads kept across calls. Run(fn, ctx, tasks) runs fn(ctx, i) once for every task i < tasks on
// the caller and the pool's threads, each claiming the next task, and returns when all tasks are done. The
// caller works too and never waits for a thread that has not started: under oversubscription a late thread
// finds the job closed and leaves ctx alone. Idle threads spin briefly (the next layer's call usually follows
// within a millisecond), then sleep on a condition variable.
class Pool {
 public:
  explicit Pool(int n) : size_(std::max(n, 1)), spin_us_(env_int("PDSCOPE_CPU_FFN_SPIN_US", 200)) {
    for (int t = 1; t < size_; ++t) threads_.emplace_back([this] { Work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return size_; }

  void Run(void (*fn)(void*, int), void* ctx, int tasks) {
    std::lock_guard<std::mutex> call(call_mu_);
    fn_ = fn;
    ctx_ = ctx;
    tasks_ = tasks;
    next_.store(0);
    done_.store(0);
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t g = gen_.load() + 1;
      open_.store(g);
      gen_.store(g);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
    Claim();
    for (int i = 0; done_.load() != tasks; ++i) Relax(i);
    open_.store(0);  // then no thread enters; wait for those inside
    for (int i = 0; active_.load() != 0; ++i) Relax(i);
  }

 private:
  void Claim() {
    for (int t = next_.fetch_add(1); t < tasks_; t = next_.fetch_add(1)) {
      fn_(ctx_, t);
      done_.fetch_add(1);
    }
  }

  static void Relax(int i) {
#if defined(__x86_64__)
    if (i < 2000) { _mm_pause(); return; }  // then yield: under oversubscription the awaited thread needs a core
#endif
    std::this_thread::yield();
  }

  void Work() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = gen_.load();
      auto start = std::chrono::steady_clock::now();
      for (int i = 0; g == seen; ++i) {
        if ((i & 255) == 255 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleepers_;
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          --sleepers_;
        }
#if defined(__x86_64__)
        _mm_pause();
#endif
        g = gen_.load();
      }
      seen = g;
      if (stop_.load()) return;
      active_.fetch_add(1);
      if (open_.load() == g) Claim();
      active_.fetch_sub(1);
    }
  }

  const int size_;
  const int spin_us_;
  std::vector<std::thread> threads_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  int sleepers_ = 0;                    // guarded by mu_
  std::atomic<uint64_t> gen_{0};        // bumped per job
  std::atomic<uint64_t> open_{0};       // the job's gen while it may be entered, else 0
  std::atomic<int> active_{0};          // threads inside a job
  std::atomic<int> next_{0}, done_{0};  // tasks claimed, tasks finished
  std::atomic<bool> stop_{false};
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  int tasks_ = 0;
};

int default_threads() {
  if (const char* env = std::getenv("PDSCOPE_CPU_FFN_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(CPU_COUNT(&set), 1);
  return std::max(int(std::thread::hardware_concurrency()), 1);
}

std::mutex g_pool_mu;
std::unique_ptr<Pool> g_pool;
std::atomic<int> g_isa{-1};  // -1: not chosen yet
std::mutex g_call_mu;
std::vector<std::vector<float>> g_partials;  // per group of units: its partial sum, reused across calls
std::atomic<bool> g_profile{false};
// Profile totals over calls (guarded by g_call_mu): calls, then ns of: setup, compute (wall), reduce (wall),
// and summed over groups gate_up, act, down, group total; then the slowest group's total summed over calls.
constexpr int kProfileFields = 9;
double g_profile_totals[kProfileFields] = {0};

Pool& pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<Pool>(default_threads());
  return *g_pool;
}

int best_isa() { return cpu_has_avx512bf16() ? kAvx512Bf16 : kScalar; }

int current_isa() {
  int isa = g_isa.load();
  if (isa < 0) {
    isa = best_isa();
    g_isa.store(isa);
  }
  return isa;
}

// ---------------------------------------------------------------------------------------------------------
void compute_group(void* ctx, int g) {
  Call& c = *static_cast<Call*>(ctx);
  const int64_t units = int64_t(c.unit_expert.size()), groups = int64_t(c.partials.size());
  const int lo = int(units * g / groups), hi = int(units * (g + 1) / groups);
  if (lo == hi) return;
  Scratch& s = tls_scratch;
  s.act.resize(size_t(c.n) * kBlock);
  s.gu.resize(2 * size_t(std::max(c.n, kGuRows)) * kBlock);
  Phases* ph = c.profile ? &c.group_ns[g] : nullptr;
  const int64_t start = ph ? now_ns() : 0;
  float* partial = c.partials[g];
  std::memset(partial, 0, sizeof(float) * size_t(c.n) * c.d);
  c.used[g] = 1;
  for (int u = lo; u < hi; ++u) {
    const int j = c.unit_expert[u];
    const int* rows = c.rows.data() + c.row_off[j];
    const int m = c.row_off[j + 1] - c.row_off[j];
    if (c.isa == kAvx512Bf16)
      unit_avx(c, j, c.unit_block[u], rows, m, s, partial, ph);
    else
      unit_scalar(c, j, c.unit_block[u], rows, m, s, partial);
  }
  if (ph) ph->total = now_ns() - start;
}

constexpr size_t kReduceChunk = 2048;

void reduce_chunk(void* ctx, int chunk) {
  Call& c = *static_cast<Call*>(ctx);
  const size_t total = size_t(c.n) * c.d, lo = size_t(chunk) * kReduceChunk;
  const size_t hi = std::min(total, lo + kReduceChunk);
  bool first = true;
  for (size_t g = 0; g < c.partials.size(); ++g) {
    if (!c.used[g]) continue;
    const float* p = c.partials[g];
    if (first)
      std::memcpy(c.out + lo, p + lo, sizeof(float) * (hi - lo));
    else
      for (size_t i = lo; i < hi; ++i) c.out[i] += p[i];
    first = false;
  }
}

void run_call(Call& c) {
  const int64_t t0 = now_ns();
  c.isa = current_isa();
  c.row_off.assign(c.k + 1, 0);
  for (int j = 0; j < c.k; ++j) {
    for (int r = 0; r < c.n; ++r)
      if (c.coef[size_t(j) * c.n + r] != 0.0f) c.rows.push_back(r);
    c.row_off[j + 1] = int(c.rows.size());
    if (c.row_off[j + 1] > c.row_off[j])
      for (int b = 0; b < c.f / kBlock; ++b) {
        c.unit_expert.push_back(j);
        c.unit_block.push_back(b);
      }
  }
  if (c.unit_expert.empty()) {
    std::memset(c.out, 0, sizeof(float) * size_t(c.n) * c.d);
    return;
  }
  std::lock_guard<std::mutex> lock(g_call_mu);  // the group buffers are shared by calls
  Pool& p = pool();
  const int groups = p.size();
  if (g_partials.size() < size_t(groups)) g_partials.resize(groups);
  for (int g = 0; g < groups; ++g) {
    g_partials[g].resize(std::max(g_partials[g].size(), size_t(c.n) * c.d));
    c.partials.push_back(g_partials[g].data());
  }
  c.used.assign(groups, 0);
  c.profile = g_profile.load();
  if (c.profile) c.group_ns.assign(groups, Phases());
  const int64_t t1 = now_ns();
  p.Run(compute_group, &c, groups);
  const int64_t t2 = now_ns();
  p.Run(reduce_chunk, &c, int((size_t(c.n) * c.d + kReduceChunk - 1) / kReduceChunk));
  if (c.profile) {
    double* tot = g_profile_totals;
    int64_t slowest = 0;
    tot[0] += 1;
    tot[1] += double(t1 - t0);
    tot[2] += double(t2 - t1);
    tot[3] += double(now_ns() - t2);
    for (const Phases& ph : c.group_ns) {
      tot[4] += double(ph.gate_up);
      tot[5] += double(ph.act);
      tot[6] += double(ph.down);
      tot[7] += double(ph.total);
      slowest = std::max(slowest, ph.total);
    }
    tot[8] += double(slowest);
  }
}

ffi::Error check_shapes(const Call& c) {
  if (c.d % kBlock != 0 || c.f % kBlock != 0 || c.d <= 0 || c.f <= 0)
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn: hidden and intermediate sizes must be multiples of 32");
  return ffi::Error::Success();
}

ffi::Error ffn_list(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> coef, ffi::RemainingArgs weights,
                    ffi::ResultBuffer<ffi::F32> out) {
  Call c;
  auto hd = h.dimensions(), cd = coef.dimensions();
  if (hd.size() != 2 || cd.size() != 2 || cd[1] != hd[0])
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_list: h [N, D], coef [k, N]");
  c.n = int(hd[0]);
  c.d = int(hd[1]);
  c.k = int(cd[0]);
  if (weights.size() != size_t(2 * c.k))
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_list: expected k gate_up then k down buffers");
  for (int j = 0; j < 2 * c.k; ++j) {
    auto w = weights.get<ffi::Buffer<ffi::BF16>>(j);
    if (!w.has_value()) return w.error();
    auto wd = w->dimensions();
    if (wd.size() != 2) return ffi::Error::InvalidArgument("pdscope_cpu_ffn_list: weights are matrices");
    if (j < c.k) {
      if (j == 0) c.f = int(wd[1] / 2);
      if (wd[0] != c.d || wd[1] != 2 * int64_t(c.f))
        return ffi::Error::InvalidArgument("pdscope_cpu_ffn_list: gate_up must be [D, 2F]");
      c.gate_up.push_back(w->typed_data());
    } else {
      if (wd[0] != c.f || wd[1] != c.d) return ffi::Error::InvalidArgument("pdscope_cpu_ffn_list: down must be [F, D]");
      c.down.push_back(w->typed_data());
    }
  }
  if (c.k == 0) c.f = kBlock;
  if (auto e = check_shapes(c); e.failure()) return e;
  c.h = h.typed_data();
  c.coef = coef.typed_data();
  c.out = out->typed_data();
  run_call(c);
  return ffi::Error::Success();
}

ffi::Error ffn_stacked(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                       ffi::ResultBuffer<ffi::F32> out) {
  Call c;
  auto hd = h.dimensions(), cd = coef.dimensions(), gd = gate_up.dimensions(), dd = down.dimensions();
  if (hd.size() != 2 || cd.size() != 2 || cd[1] != hd[0] || gd.size() != 3 || dd.size() != 3 ||
      ids.element_count() != size_t(cd[0]))
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_stacked: h [N, D], coef [k, N], ids [k], stacks 3-d");
  c.n = int(hd[0]);
  c.d = int(hd[1]);
  c.k = int(cd[0]);
  c.f = int(gd[2] / 2);
  const int64_t experts = gd[0];
  if (gd[1] != c.d || gd[2] != 2 * int64_t(c.f) || dd[0] != experts || dd[1] != c.f || dd[2] != c.d)
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_stacked: gate_up [E, D, 2F], down [E, F, D]");
  if (auto e = check_shapes(c); e.failure()) return e;
  const int32_t* id = ids.typed_data();
  const size_t gu_size = size_t(c.d) * 2 * c.f, dn_size = size_t(c.f) * c.d;
  for (int j = 0; j < c.k; ++j) {
    if (id[j] < 0 || id[j] >= experts) return ffi::Error::InvalidArgument("pdscope_cpu_ffn_stacked: id out of range");
    c.gate_up.push_back(gate_up.typed_data() + id[j] * gu_size);
    c.down.push_back(down.typed_data() + id[j] * dn_size);
  }
  c.h = h.typed_data();
  c.coef = coef.typed_data();
  c.out = out->typed_data();
  run_call(c);
  return ffi::Error::Success();
}

struct ReadArgs {
  const uint8_t* data;
  size_t bytes;
};
constexpr size_t kReadTask = size_t(1) << 20;

void read_task(void* ctx, int task) {
  auto* args = static_cast<ReadArgs*>(ctx);
  const size_t lo = size_t(task) * kReadTask, hi = std::min(args->bytes, lo + kReadTask);
  uint64_t acc = 0;
  for (size_t i = lo; i + 8 <= hi; i += 64) {
    uint64_t v;
    std::memcpy(&v, args->data + i, 8);
    acc += v;
  }
  static std::atomic<uint64_t> sink;
  sink.fetch_add(acc, std::memory_order_relaxed);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_cpu_ffn_list, ffn_list,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_cpu_ffn_stacked, ffn_stacked,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" {

// The instruction set in use: 2 = AVX-512 BF16, 0 = portable.
int pdscope_cpu_ffn_isa() { return current_isa(); }

// The best instruction set this CPU supports (what `isa` picks unless forced).
int pdscope_cpu_ffn_best_isa() { return best_isa(); }

// Force an instruction set (0 or 2; 2 only where supported), or -1 for the best one. Returns the one in use.
int pdscope_cpu_ffn_set_isa(int isa) {
  if (isa == kAvx512Bf16 && best_isa() != kAvx512Bf16) isa = -1;
  if (isa != kScalar && isa != kAvx512Bf16) isa = best_isa();
  g_isa.store(isa);
  return isa;
}

int pdscope_cpu_ffn_threads() { return pool().size(); }

// Start (1, totals reset) or stop (0) the phase profile of later calls.
void pdscope_cpu_ffn_profile(int on) {
  std::lock_guard<std::mutex> lock(g_call_mu);
  if (on) std::fill(g_profile_totals, g_profile_totals + kProfileFields, 0.0);  // stopping keeps them to read
  g_profile.store(on != 0);
}

// Copy the profile totals (see g_profile_totals) into out[0 .. n); returns how many fields exist.
int pdscope_cpu_ffn_profile_read(double* out, int n) {
  std::lock_guard<std::mutex> lock(g_call_mu);
  for (int i = 0; i < std::min(n, kProfileFields); ++i) out[i] = g_profile_totals[i];
  return kProfileFields;
}

// Replace the thread pool with one of n threads (n <= 0: the default, from PDSCOPE_CPU_FFN_THREADS or the
// CPUs this process may run on). Not to be called while a kernel runs.
int pdscope_cpu_ffn_set_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_pool.reset();
  g_pool = std::make_unique<Pool>(n > 0 ? n : default_threads());
  return g_pool->size();
}

// Read `bytes` at `data` once with the pool (one 8-byte load per 64-byte line): a memory bandwidth probe.
void pdscope_cpu_ffn_read(const void* data, size_t bytes) {
  ReadArgs args{static_cast<const uint8_t*>(data), bytes};
  pool().Run(read_task, &args, int((bytes + kReadTask - 1) / kReadTask));
}

}  // extern "C"
