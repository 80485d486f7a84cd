// The few-row bf16 path (decode): each task reads a contiguous run of weight rows once, front to back.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
//
// Why: the unit path computes 32 columns at a time, so it reads each expert's rows a row apart (5.6 KB for
// DeepSeek-V2-Lite's gate_up): with 4 KiB pages nearly every row is a TLB miss, and the hardware prefetchers see
// no stream. Here a task takes kStreamChunk consecutive rows of one expert's gate_up (every column), then of its
// down, and adds x[row] * W[row, :] into float32 sums in L1/L2 (the axpy form of the product), so every task
// streams contiguous memory. Four passes over the pool: gate_up partial sums per task; their sum per column
// block and the activation (as the unit path: bf16(coef * silu(g) * u)); down partial sums per task; their
// sum per output row. Partials are added in task order, so the result does not depend on the pool's size.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ffn_types.h"
#include "ffn_units.h"
#include "thread_pool.h"

namespace pdscope_cpu_ffn {

constexpr int kStreamRows = 4;    // the most routed rows an expert may have for this path
constexpr int kStreamChunk = 64;  // weight rows per task
// Off unless PDSCOPE_CPU_FFN_STREAM=1 or pdscope_cpu_ffn_set_stream(1): not yet faster where measured.
std::atomic<bool> g_stream{env_int("PDSCOPE_CPU_FFN_STREAM", 0) != 0};

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

struct Stream {
  Call* c = nullptr;
  std::vector<int> expert;           // the experts (j) with a routed row, in j order
  int gu_chunks = 0, dn_chunks = 0;  // tasks per expert in the gate_up and down passes
  std::vector<float> gu;             // [experts * gu_chunks][kStreamRows][2f]
  std::vector<bf16> act;             // [experts][kStreamRows][f]
  std::vector<float> dn;             // [experts * dn_chunks][kStreamRows][d]
};

inline __m512 load16(const bf16* p) {  // 16 bf16 -> f32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// acc[r][0..cols) += sum over rows i in [0, n) of x[r][i] * w[i * cols + 0..cols), cols a multiple of 16.
template <int M>
void axpy_rows(const bf16* w, size_t cols, int n, const float (*x)[kStreamChunk], float* acc) {
  int i = 0;
  for (; i + 1 < n; i += 2) {
    const bf16* w0 = w + size_t(i) * cols;
    const bf16* w1 = w0 + cols;
    _mm_prefetch(reinterpret_cast<const char*>(w1 + 2 * cols), _MM_HINT_T0);
    for (size_t v = 0; v < cols; v += 16) {
      const __m512 a = load16(w0 + v), b = load16(w1 + v);
      for (int r = 0; r < M; ++r) {
        float* o = acc + r * cols + v;
        __m512 s = _mm512_loadu_ps(o);
        s = _mm512_fmadd_ps(_mm512_set1_ps(x[r][i]), a, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(x[r][i + 1]), b, s);
        _mm512_storeu_ps(o, s);
      }
    }
  }
  for (; i < n; ++i) {
    const bf16* w0 = w + size_t(i) * cols;
    for (size_t v = 0; v < cols; v += 16) {
      const __m512 a = load16(w0 + v);
      for (int r = 0; r < M; ++r) {
        float* o = acc + r * cols + v;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(x[r][i]), a, _mm512_loadu_ps(o)));
      }
    }
  }
}

template <int M>
void axpy_rows_upto(int m, const bf16* w, size_t cols, int n, const float (*x)[kStreamChunk], float* acc) {
  if constexpr (M > 1) {
    if (m < M) return axpy_rows_upto<M - 1>(m, w, cols, n, x, acc);
  }
  axpy_rows<M>(w, cols, n, x, acc);
}

inline int routed(const Call& c, int j) { return c.row_off[j + 1] - c.row_off[j]; }
inline const int* routed_rows(const Call& c, int j) { return c.rows.data() + c.row_off[j]; }

void stream_gate_up(void* ctx, int t) {
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int e = t / s.gu_chunks, row0 = (t % s.gu_chunks) * kStreamChunk, j = s.expert[e];
  const int n = std::min(kStreamChunk, c.d - row0), m = routed(c, j);
  const size_t cols = 2 * size_t(c.f);
  float x[kStreamRows][kStreamChunk];
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < n; ++i) x[r][i] = bf16_to_f32(c.h[size_t(routed_rows(c, j)[r]) * c.d + row0 + i]);
  float* acc = s.gu.data() + size_t(t) * kStreamRows * cols;
  std::memset(acc, 0, sizeof(float) * m * cols);
  axpy_rows_upto<kStreamRows>(m, static_cast<const bf16*>(c.gate_up[j]) + size_t(row0) * cols, cols, n, x, acc);
}

void stream_activation(void* ctx, int t) {  // t: (expert, block of kBlock intermediate columns)
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int blocks = c.f / kBlock, e = t / blocks, col = (t % blocks) * kBlock, j = s.expert[e];
  const size_t cols = 2 * size_t(c.f);
  for (int r = 0; r < routed(c, j); ++r) {
    alignas(64) float g[kBlock] = {0}, u[kBlock] = {0};
    for (int k = 0; k < s.gu_chunks; ++k) {
      const float* p = s.gu.data() + (size_t(e) * s.gu_chunks + k) * kStreamRows * cols + r * cols;
      for (int i = 0; i < kBlock; ++i) {
        g[i] += p[col + i];
        u[i] += p[c.f + col + i];
      }
    }
    const float scale = c.coef[size_t(j) * c.n + routed_rows(c, j)[r]];
    activation_avx(g, u, scale, s.act.data() + (size_t(e) * kStreamRows + r) * c.f + col);
  }
}

void stream_down(void* ctx, int t) {
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int e = t / s.dn_chunks, row0 = (t % s.dn_chunks) * kStreamChunk, j = s.expert[e];
  const int n = std::min(kStreamChunk, c.f - row0), m = routed(c, j);
  float x[kStreamRows][kStreamChunk];
  for (int r = 0; r < m; ++r)
    for (int i = 0; i < n; ++i) x[r][i] = bf16_to_f32(s.act[(size_t(e) * kStreamRows + r) * c.f + row0 + i]);
  float* acc = s.dn.data() + size_t(t) * kStreamRows * c.d;
  std::memset(acc, 0, sizeof(float) * m * c.d);
  axpy_rows_upto<kStreamRows>(m, static_cast<const bf16*>(c.down[j]) + size_t(row0) * c.d, c.d, n, x, acc);
}

void stream_sum(void* ctx, int t) {  // t: a block of 256 output columns, every row
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int lo = t * 256, hi = std::min(c.d, lo + 256);
  for (int n = 0; n < c.n; ++n) std::fill(c.out + size_t(n) * c.d + lo, c.out + size_t(n) * c.d + hi, 0.0f);
  for (size_t e = 0; e < s.expert.size(); ++e) {
    const int j = s.expert[e];
    for (int r = 0; r < routed(c, j); ++r) {
      float* o = c.out + size_t(routed_rows(c, j)[r]) * c.d;
      for (int k = 0; k < s.dn_chunks; ++k) {
        const float* p = s.dn.data() + (e * s.dn_chunks + k) * kStreamRows * c.d + size_t(r) * c.d;
        for (int col = lo; col < hi; ++col) o[col] += p[col];
      }
    }
  }
}

// The streamed call: four passes over the pool, its buffers kept across calls (the caller holds the call lock).
void run_streamed(Call& c, Pool& p) {
  static Stream s;
  s.c = &c;
  s.expert.clear();
  for (int j = 0; j < c.k; ++j)
    if (c.row_off[j + 1] > c.row_off[j]) s.expert.push_back(j);
  const size_t e = s.expert.size();
  s.gu_chunks = (c.d + kStreamChunk - 1) / kStreamChunk;
  s.dn_chunks = (c.f + kStreamChunk - 1) / kStreamChunk;
  s.gu.resize(std::max(s.gu.size(), e * s.gu_chunks * kStreamRows * 2 * size_t(c.f)));
  s.act.resize(std::max(s.act.size(), e * kStreamRows * size_t(c.f)));
  s.dn.resize(std::max(s.dn.size(), e * s.dn_chunks * kStreamRows * size_t(c.d)));
  p.Run(stream_gate_up, &s, int(e) * s.gu_chunks);
  p.Run(stream_activation, &s, int(e) * (c.f / kBlock));
  p.Run(stream_down, &s, int(e) * s.dn_chunks);
  p.Run(stream_sum, &s, (c.d + 255) / 256);
}

#pragma GCC pop_options
#else
inline void run_streamed(Call&, Pool&) {}  // never called: streams() is false off x86-64
#endif

// Whether the streamed path takes this call: bf16 weights, the AVX-512 kernels, at most kStreamRows routed rows
// per expert (row_off filled), and shapes the unit path takes too.
inline bool streams(const Call& c) {
#if defined(__x86_64__)
  if (c.fmt != kBf16 || c.isa < kAvx512Bf16 || !g_stream.load()) return false;
  for (int j = 0; j < c.k; ++j)
    if (c.row_off[j + 1] - c.row_off[j] > kStreamRows) return false;
  return true;
#else
  return false;
#endif
}

}  // namespace pdscope_cpu_ffn
