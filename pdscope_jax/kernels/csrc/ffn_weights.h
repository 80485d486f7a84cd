// Views of one weight matrix [K, N] (K: contraction rows) in each stored format. Part of cpu_ffn.cc (one
// translation unit); see its header comment for the contract.
//   bf16: w [K, N].
//   int8: q int8 [K, N], scale [1, N]:          w[k, n] = q[k, n] * scale[0, n].
//   int4: q uint8 [K/2, N], scale [K/G, N]:     w[k, n] = nibble(k, n) * scale[k / G, n], where byte (i, n) holds
//         row 2i in its low nibble and row 2i+1 in its high one (two's complement, [-8, 7]) and G is a power of
//         two and a multiple of 32 (a 32-row chunk of gate/up and a unit's 32 rows of down share one scale row).
// Scales are float32 or bf16 (S, the views' template argument): read where they lie and widened to float32 in
// registers (exact), so a store that keeps bf16 scales needs no float32 copy of them.
// Quantized bytes are read once and turned in registers into their integers as bf16 (exact: |q| <= 127); the
// dot products run on those, and the float32 sums of each 32-row chunk (gate/up) or unit (down) are scaled
// per output column then (kScaled). So a quantized call uses the weights q * scale exactly, with no bf16
// rounding of them (the XLA path's dequantize() rounds them to bf16: the two agree to that rounding).
// Each view has value(r, c), the weight as float32 (portable path), and, for AVX-512, pair_of_rows(m, r, c0,
// row0, row1): 32 bf16 values of rows r and r+1 (r even) at columns [c0, c0 + 32) (quantized: the integers),
// scale_row(r) (quantized: the scales of row r's group, by column; see permuted_scales) and prefetch_rows(m, r, c0).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ffn_types.h"

namespace pdscope_cpu_ffn {

struct Bf16Mat {
  static constexpr bool kScaled = false;
  const bf16* w;
  size_t ld;
  Bf16Mat(const void* q, const void*, size_t n, int) : w(static_cast<const bf16*>(q)), ld(n) {}
  float value(size_t r, size_t c) const { return bf16_to_f32(w[r * ld + c]); }
};

inline float scale_value(float s) { return s; }
inline float scale_value(bf16 s) { return bf16_to_f32(s); }

template <class S>  // the scales' type: float or bf16
struct Int8Mat {
  static constexpr bool kScaled = true;
  const int8_t* q;
  const S* s;
  size_t ld;
  Int8Mat(const void* q_, const void* s_, size_t n, int)
      : q(static_cast<const int8_t*>(q_)), s(static_cast<const S*>(s_)), ld(n) {}
  float value(size_t r, size_t c) const { return float(q[r * ld + c]) * scale_value(s[c]); }
  const S* scale_row(int) const { return s; }
};

template <class S>
struct Int4Mat {
  static constexpr bool kScaled = true;
  const uint8_t* q;
  const S* s;
  size_t ld;
  int shift;  // log2(G)
  Int4Mat(const void* q_, const void* s_, size_t n, int group)
      : q(static_cast<const uint8_t*>(q_)), s(static_cast<const S*>(s_)), ld(n),
        shift(__builtin_ctz(unsigned(group))) {}
  float value(size_t r, size_t c) const {
    const int8_t byte = int8_t(q[(r >> 1) * ld + c]);
    const int nibble = (r & 1) ? (byte >> 4) : (int8_t(byte << 4) >> 4);
    return float(nibble) * scale_value(s[(r >> shift) * ld + c]);
  }
  const S* scale_row(int r) const { return s + size_t(r >> shift) * ld; }
};

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")

// 32 float32 values (lo: columns 0-15, hi: 16-31) -> bf16, in column order (exact for integers up to 256).
inline __m512i to_bf16(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

inline void pair_of_rows(const Bf16Mat& m, int r, int c0, __m512i* row0, __m512i* row1) {
  const bf16* p = m.w + size_t(r) * m.ld + c0;
  *row0 = _mm512_loadu_si512(p);
  *row1 = _mm512_loadu_si512(p + m.ld);
}

template <class T>
inline void prefetch_two(const T* p, size_t ld) {  // p and the element one row (ld) below it
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + ld), _MM_HINT_T0);
}

inline void prefetch_rows(const Bf16Mat& m, int r, int c0) { prefetch_two(m.w + size_t(r) * m.ld + c0, m.ld); }

// 16 int8 values as float32 (exact).
inline __m512 int8_floats(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512i int8_row(const int8_t* p) { return to_bf16(int8_floats(p), int8_floats(p + 16)); }

template <class S>
inline void pair_of_rows(const Int8Mat<S>& m, int r, int c0, __m512i* row0, __m512i* row1) {
  const int8_t* p = m.q + size_t(r) * m.ld + c0;
  *row0 = int8_row(p);
  *row1 = int8_row(p + m.ld);
}

template <class S>
inline void prefetch_rows(const Int8Mat<S>& m, int r, int c0) { prefetch_two(m.q + size_t(r) * m.ld + c0, m.ld); }

// bf16 of the two's-complement nibble i & 15 at index i < 32 (vpermw reads an index's low 5 bits).
struct NibbleTable {
  alignas(64) bf16 v[32];
  NibbleTable() {
    for (int i = 0; i < 32; ++i) v[i] = f32_to_bf16(float((i & 15) < 8 ? (i & 15) : (i & 15) - 16));
  }
};
const NibbleTable kNibbles;

// 32 bytes zero-extended to words: the low nibble is the table index as it is, the high one after a shift.
template <class S>
inline void pair_of_rows(const Int4Mat<S>& m, int r, int c0, __m512i* row0, __m512i* row1) {
  const __m512i table = _mm512_load_si512(kNibbles.v);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.q + size_t(r >> 1) * m.ld + c0));
  const __m512i x = _mm512_cvtepu8_epi16(packed);
  *row0 = _mm512_permutexvar_epi16(x, table);
  *row1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(x, 4), table);
}

// A group's first row also prefetches its 32 scales: 128 bytes of float32 (two lines), 64 of bf16 (one line, or two
// where they straddle: its first and last scale).
template <class S>
inline void prefetch_rows(const Int4Mat<S>& m, int r, int c0) {
  _mm_prefetch(reinterpret_cast<const char*>(m.q + size_t(r >> 1) * m.ld + c0), _MM_HINT_T0);
  if ((r & ((1 << m.shift) - 1)) == 0) prefetch_two(m.scale_row(r) + c0, sizeof(S) == 4 ? 16 : kBlock - 1);
}

// 16 scales as float32: bf16 ones zero-extended to 32 bits and shifted into the high half (exact).
inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 scales16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The scales of columns [c0, c0 + 32) of row r's group, in the dot products' accumulator order (lane i of lo:
// column (i/4)*8 + i%4, of hi: (i/4)*8 + 4 + i%4; see unpermute in ffn_units.h).
template <class M>
inline void permuted_scales(const M& m, int r, int c0, __m512* lo, __m512* hi) {
  alignas(64) static const int32_t idx[2][16] = {
      {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
      {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}};
  const auto* s = m.scale_row(r) + c0;
  const __m512 a = scales16(s), b = scales16(s + 16);
  *lo = _mm512_permutex2var_ps(a, _mm512_load_si512(idx[0]), b);
  *hi = _mm512_permutex2var_ps(a, _mm512_load_si512(idx[1]), b);
}

#pragma GCC pop_options
#endif

}  // namespace pdscope_cpu_ffn
