// The few-row bf16 path (decode): each task reads a contiguous run of whole weight rows once, front to back.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
//
// Why: the unit path computes 32 columns at a time, so it reads an expert's gate_up rows a row apart (5.6 KB for
// DeepSeek-V2-Lite): the hardware prefetchers see no stream, and a core has only its fill buffers' worth of lines in
// flight. Here a task takes consecutive whole rows and adds x[row] * W[row, :] into float32 sums held in L1/L2 (the
// axpy form; four rows per pass over the sums, two a vdpbf16ps), so every task streams contiguous memory. Three
// passes over the pool:
//  1. gate_up: task (expert, run of gu_rows rows of gate_up) -> its partial sums [m][2F];
//  2. down: task (expert, run of dn_rows intermediate rows, whole 32-column blocks): its columns' gate and up sums
//     (partials added in task order), the activation as the unit path makes it (bf16(coef * silu(g) * u)), then
//     its rows of down -> its partial [m][D];
//  3. sum: out by 32 output columns, partials added in (expert, task) order; a row no expert routes is 0.
// Sums stay in vdpbf16ps's lane order (see unpermute) until read. Runs are sized from the pool's threads
// (g_stream_tasks tasks a thread in each pass): the result depends on the pool's size, never on which thread ran
// which task.
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

constexpr int kStreamRows = 4;           // the most routed rows an expert may have for this path
constexpr int kStreamMaxDownRows = 256;  // intermediate rows of a down task at most (its activation on the stack)
// Off unless PDSCOPE_CPU_FFN_STREAM=1 or pdscope_cpu_ffn_set_stream(1).
std::atomic<bool> g_stream{env_int("PDSCOPE_CPU_FFN_STREAM", 0) != 0};
// Tasks per pool thread in a pass: more balance a late thread, fewer leave fewer partial sums to add.
const int g_stream_tasks = std::max(env_int("PDSCOPE_CPU_FFN_STREAM_TASKS", 2), 1);
// Weight rows ahead of the one read that a task prefetches (0: none, the hardware prefetchers alone).
const int kStreamPrefetch = env_int("PDSCOPE_CPU_FFN_PF_STREAM", 4);

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

struct Stream {
  Call* c = nullptr;
  std::vector<int> expert;           // the experts (j) with a routed row, in j order
  std::vector<int> row_of;           // [experts][n]: which routed row r of expert e output row n is, else -1
  int gu_rows = 0, gu_chunks = 0;    // gate_up rows a task, tasks an expert
  int dn_rows = 0, dn_chunks = 0;    // down rows a task, tasks an expert
  std::vector<float> gu;             // [experts * gu_chunks][kStreamRows][2f], lane order
  std::vector<float> dn;             // [experts * dn_chunks][kStreamRows][d], lane order
};

inline int routed(const Call& c, int j) { return c.row_off[j + 1] - c.row_off[j]; }
inline const int* routed_rows(const Call& c, int j) { return c.rows.data() + c.row_off[j]; }

// acc[r * cols + 0..cols) += sum over weight rows i in [0, n) of x[r][i] * w[i * cols + 0..cols), in lane order,
// for r < M; n a multiple of 4, cols of 32.
template <int M>
void axpy_rows(const bf16* w, size_t cols, int n, const bf16* const* x, float* acc) {
  for (int i = 0; i < n; i += 4) {
    const bf16* w0 = w + size_t(i) * cols;
    if (kStreamPrefetch > 0)
      for (size_t v = 0; v < 4 * cols; v += 32)
        _mm_prefetch(reinterpret_cast<const char*>(w0 + size_t(kStreamPrefetch) * cols + v), _MM_HINT_T0);
    __m512bh x01[M], x23[M];
    for (int r = 0; r < M; ++r) {
      x01[r] = as_bh(pair_of(x[r] + i));
      x23[r] = as_bh(pair_of(x[r] + i + 2));
    }
    for (size_t v = 0; v < cols; v += 32) {
      const __m512i a = _mm512_loadu_si512(w0 + v), b = _mm512_loadu_si512(w0 + cols + v);
      const __m512i c2 = _mm512_loadu_si512(w0 + 2 * cols + v), d = _mm512_loadu_si512(w0 + 3 * cols + v);
      const __m512bh lo01 = as_bh(_mm512_unpacklo_epi16(a, b)), hi01 = as_bh(_mm512_unpackhi_epi16(a, b));
      const __m512bh lo23 = as_bh(_mm512_unpacklo_epi16(c2, d)), hi23 = as_bh(_mm512_unpackhi_epi16(c2, d));
      for (int r = 0; r < M; ++r) {
        float* o = acc + r * cols + v;
        _mm512_storeu_ps(o, _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_loadu_ps(o), lo01, x01[r]), lo23, x23[r]));
        _mm512_storeu_ps(o + 16,
                         _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_loadu_ps(o + 16), hi01, x01[r]), hi23, x23[r]));
      }
    }
  }
}

inline void axpy_rows_upto(int m, const bf16* w, size_t cols, int n, const bf16* const* x, float* acc) {
  switch (m) {
    case 1: return axpy_rows<1>(w, cols, n, x, acc);
    case 2: return axpy_rows<2>(w, cols, n, x, acc);
    case 3: return axpy_rows<3>(w, cols, n, x, acc);
    default: return axpy_rows<4>(w, cols, n, x, acc);
  }
}

void stream_gate_up(void* ctx, int t) {
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int e = t / s.gu_chunks, row0 = (t % s.gu_chunks) * s.gu_rows, j = s.expert[e];
  const int n = std::min(s.gu_rows, c.d - row0), m = routed(c, j);
  const size_t cols = 2 * size_t(c.f);
  const bf16* x[kStreamRows];
  for (int r = 0; r < m; ++r) x[r] = c.h + size_t(routed_rows(c, j)[r]) * c.d + row0;
  float* acc = s.gu.data() + size_t(t) * kStreamRows * cols;
  std::memset(acc, 0, sizeof(float) * m * cols);
  axpy_rows_upto(m, static_cast<const bf16*>(c.gate_up[j]) + size_t(row0) * cols, cols, n, x, acc);
}

void stream_down(void* ctx, int t) {
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int e = t / s.dn_chunks, row0 = (t % s.dn_chunks) * s.dn_rows, j = s.expert[e];
  const int n = std::min(s.dn_rows, c.f - row0), m = routed(c, j);
  const size_t cols = 2 * size_t(c.f);
  alignas(64) bf16 act[kStreamRows][kStreamMaxDownRows];
  for (int r = 0; r < m; ++r) {
    const float coef = c.coef[size_t(j) * c.n + routed_rows(c, j)[r]];
    for (int b = 0; b < n; b += kBlock) {
      __m512 g0 = _mm512_setzero_ps(), g1 = g0, u0 = g0, u1 = g0;
      for (int k = 0; k < s.gu_chunks; ++k) {  // the gate_up tasks' partials, in task order
        const float* p = s.gu.data() + (size_t(e) * s.gu_chunks + k) * kStreamRows * cols + r * cols + row0 + b;
        g0 = _mm512_add_ps(g0, _mm512_loadu_ps(p));
        g1 = _mm512_add_ps(g1, _mm512_loadu_ps(p + 16));
        u0 = _mm512_add_ps(u0, _mm512_loadu_ps(p + c.f));
        u1 = _mm512_add_ps(u1, _mm512_loadu_ps(p + c.f + 16));
      }
      alignas(64) float g[kBlock], u[kBlock];
      store_unpermuted(g0, g1, g);
      store_unpermuted(u0, u1, u);
      activation_avx(g, u, coef, act[r] + b);
    }
  }
  const bf16* x[kStreamRows] = {act[0], act[1], act[2], act[3]};
  float* acc = s.dn.data() + size_t(t) * kStreamRows * c.d;
  std::memset(acc, 0, sizeof(float) * m * c.d);
  axpy_rows_upto(m, static_cast<const bf16*>(c.down[j]) + size_t(row0) * c.d, c.d, n, x, acc);
}

void stream_sum(void* ctx, int t) {  // t: output columns [32 t, 32 t + 32), every row
  Stream& s = *static_cast<Stream*>(ctx);
  const Call& c = *s.c;
  const int col = t * kBlock;
  for (int row = 0; row < c.n; ++row) {
    __m512 lo = _mm512_setzero_ps(), hi = lo;
    for (size_t e = 0; e < s.expert.size(); ++e) {
      const int r = s.row_of[e * c.n + row];
      if (r < 0) continue;
      for (int k = 0; k < s.dn_chunks; ++k) {
        const float* p = s.dn.data() + ((e * s.dn_chunks + k) * kStreamRows + r) * size_t(c.d) + col;
        lo = _mm512_add_ps(lo, _mm512_loadu_ps(p));
        hi = _mm512_add_ps(hi, _mm512_loadu_ps(p + 16));
      }
    }
    store_unpermuted(lo, hi, c.out + size_t(row) * c.d + col);
  }
}

inline int round_up(int64_t v, int to) { return int((v + to - 1) / to * to); }

// The streamed call: three passes over the pool, its buffers kept across calls (the caller holds the call lock).
void run_streamed(Call& c, Pool& p) {
  static Stream s;
  s.c = &c;
  s.expert.clear();
  for (int j = 0; j < c.k; ++j)
    if (routed(c, j) > 0) s.expert.push_back(j);
  const int64_t e = int64_t(s.expert.size()), target = int64_t(p.size()) * g_stream_tasks;
  s.row_of.assign(size_t(e) * c.n, -1);
  for (int64_t k = 0; k < e; ++k)
    for (int r = 0; r < routed(c, s.expert[k]); ++r) s.row_of[k * c.n + routed_rows(c, s.expert[k])[r]] = r;
  // Runs of whole rows: gate_up in multiples of 8 rows (4 per pass, D a multiple of 32), down in whole blocks.
  s.gu_rows = std::clamp(round_up((e * c.d + target - 1) / target, 8), 8, c.d);
  s.gu_chunks = (c.d + s.gu_rows - 1) / s.gu_rows;
  s.dn_rows = std::clamp(round_up((e * c.f + target - 1) / target, kBlock), kBlock, kStreamMaxDownRows);
  s.dn_chunks = (c.f + s.dn_rows - 1) / s.dn_rows;
  s.gu.resize(std::max(s.gu.size(), size_t(e) * s.gu_chunks * kStreamRows * 2 * size_t(c.f)));
  s.dn.resize(std::max(s.dn.size(), size_t(e) * s.dn_chunks * kStreamRows * size_t(c.d)));
  p.Run(stream_gate_up, &s, int(e) * s.gu_chunks);
  p.Run(stream_down, &s, int(e) * s.dn_chunks);
  p.Run(stream_sum, &s, c.d / kBlock);
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
