// Views of one weight matrix [K, N] (K: contraction rows) in each stored format, giving the kernels its bf16
// values: a bf16 matrix as stored; a quantized one dequantized and rounded to bf16 exactly as the XLA path's
// dequantize() does (float32 q * scale, then round to nearest even), so a quantized call computes the bf16
// kernel's math on the very weights the XLA path uses. Quantized bytes are read once and converted in
// registers. Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
//   bf16: w [K, N].
//   int8: q int8 [K, N], scale float32 [1, N]:          w[k, n] = q[k, n] * scale[0, n].
//   int4: q uint8 [K/2, N], scale float32 [K/G, N]:     w[k, n] = nibble(k, n) * scale[k / G, n], where byte
//         (i, n) holds row 2i in its low nibble and row 2i+1 in its high one (two's complement, [-8, 7]) and G
//         is a power of two >= 2 (so the rows k, k+1 of a dot-product pair share a byte and a scale).
// Each view has value(r, c) (portable path) and, for AVX-512, pair(r, c0, row0, row1): the 32 bf16 values of
// rows r and r+1 (r even) at columns [c0, c0 + 32), and prefetch(r, c0): the lines pair(r, c0) will read.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ffn_types.h"

namespace pdscope_cpu_ffn {

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

struct Bf16Mat {
  const bf16* w;
  size_t ld;
  Bf16Mat(const void* q, const float*, size_t n, int) : w(static_cast<const bf16*>(q)), ld(n) {}
  float value(size_t r, size_t c) const { return bf16_to_f32(w[r * ld + c]); }
};

struct Int8Mat {
  const int8_t* q;
  const float* s;
  size_t ld;
  Int8Mat(const void* q_, const float* s_, size_t n, int) : q(static_cast<const int8_t*>(q_)), s(s_), ld(n) {}
  float value(size_t r, size_t c) const { return round_bf16(float(q[r * ld + c]) * s[c]); }
};

struct Int4Mat {
  const uint8_t* q;
  const float* s;
  size_t ld;
  int shift;  // log2(G)
  Int4Mat(const void* q_, const float* s_, size_t n, int group)
      : q(static_cast<const uint8_t*>(q_)), s(s_), ld(n), shift(__builtin_ctz(unsigned(group))) {}
  float value(size_t r, size_t c) const {
    const int8_t byte = int8_t(q[(r >> 1) * ld + c]);
    const int nibble = (r & 1) ? (byte >> 4) : (int8_t(byte << 4) >> 4);
    return round_bf16(float(nibble) * s[(r >> shift) * ld + c]);
  }
};

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

// 32 float32 products (lo: columns 0-15, hi: 16-31) -> their 32 bf16 roundings, in column order.
inline __m512i to_bf16(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

inline void pair_of_rows(const Bf16Mat& m, int r, int c0, __m512i* row0, __m512i* row1) {
  const bf16* p = m.w + size_t(r) * m.ld + c0;
  *row0 = _mm512_loadu_si512(p);
  *row1 = _mm512_loadu_si512(p + m.ld);
}

inline void prefetch_rows(const Bf16Mat& m, int r, int c0) {
  const bf16* p = m.w + size_t(r) * m.ld + c0;
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + m.ld), _MM_HINT_T0);
}

inline __m512i int8_row(const int8_t* p, __m512 s_lo, __m512 s_hi) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return to_bf16(_mm512_mul_ps(lo, s_lo), _mm512_mul_ps(hi, s_hi));
}

inline void pair_of_rows(const Int8Mat& m, int r, int c0, __m512i* row0, __m512i* row1) {
  const int8_t* p = m.q + size_t(r) * m.ld + c0;
  const __m512 s_lo = _mm512_loadu_ps(m.s + c0), s_hi = _mm512_loadu_ps(m.s + c0 + 16);
  *row0 = int8_row(p, s_lo, s_hi);
  *row1 = int8_row(p + m.ld, s_lo, s_hi);
}

inline void prefetch_rows(const Int8Mat& m, int r, int c0) {
  const int8_t* p = m.q + size_t(r) * m.ld + c0;
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + m.ld), _MM_HINT_T0);
}

// 16 bytes zero-extended to dwords hold both nibbles' rows; vpermps reads the low 4 bits of each index, so a
// 16-entry table turns a nibble straight into its signed value as float32 (the high one after a shift by 4).
inline void int4_rows(const uint8_t* p, const float* s, __m512* even, __m512* odd) {
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 scale = _mm512_loadu_ps(s);
  *even = _mm512_mul_ps(_mm512_permutexvar_ps(x, values), scale);
  *odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), values), scale);
}

inline void pair_of_rows(const Int4Mat& m, int r, int c0, __m512i* row0, __m512i* row1) {
  const uint8_t* p = m.q + size_t(r >> 1) * m.ld + c0;
  const float* s = m.s + size_t(r >> m.shift) * m.ld + c0;
  __m512 e_lo, o_lo, e_hi, o_hi;
  int4_rows(p, s, &e_lo, &o_lo);
  int4_rows(p + 16, s + 16, &e_hi, &o_hi);
  *row0 = to_bf16(e_lo, e_hi);
  *row1 = to_bf16(o_lo, o_hi);
}

inline void prefetch_rows(const Int4Mat& m, int r, int c0) {
  _mm_prefetch(reinterpret_cast<const char*>(m.q + size_t(r >> 1) * m.ld + c0), _MM_HINT_T0);
  if ((r & ((1 << m.shift) - 1)) == 0) {  // the first pair of a group: its 32 scales, 128 bytes
    const float* s = m.s + size_t(r >> m.shift) * m.ld + c0;
    _mm_prefetch(reinterpret_cast<const char*>(s), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s + 16), _MM_HINT_T0);
  }
}

#pragma GCC pop_options
#endif

}  // namespace pdscope_cpu_ffn
