// One bf16 unit (expert j, 32 intermediate columns) on AMX-BF16 tiles, for experts with several routed rows.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
//
// Why: the AVX-512 kernels spend one dot product instruction per 32 weights per row, so their time grows with
// the rows; a tile product takes 16 rows at once for about the cost of one, and the unit stays bound by reading
// its weights. The weights are read where they lie, once: each pair of weight rows (64 bytes of a unit's
// columns each) is interleaved in registers into the tiles' pair layout (vpermt2w, column order kept) and
// stored to a small per-thread buffer the tiles load from. The routed rows of h come from Call::hx (gathered
// and padded to a multiple of 16 rows by run_call), so every tile load reads 16 valid rows; rows past m are
// computed and ignored (a product's rows do not mix).
// Tiles: 0-3 the sums (gate columns 0-15, 16-31, up 0-15, 16-31; in down 0-1 the output), 4 the rows (h or the
// activation), 5-7 weights. Summation differs from the AVX-512 kernels only in order (float32 throughout).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "ffn_types.h"
#include "ffn_units.h"
#include "ffn_weights.h"

namespace pdscope_cpu_ffn {

constexpr int kTileRows = 16;  // rows of h per tile (the most a tile holds)

#if defined(__x86_64__)
// The CPU has AMX-BF16 and the kernel lets this process use the tile registers (Linux asks each process to
// request them once; the permission then holds for all its threads).
inline bool amx_permitted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx = ((d >> 22) & 1) && ((d >> 24) & 1);  // AMX-BF16, AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return amx && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}
#else
inline bool amx_permitted() { return false; }
#endif

inline size_t tile_padded(int m) { return size_t(m + kTileRows - 1) / kTileRows * kTileRows; }

// Fill Call::hx (AMX in use, bf16 weights): for each expert with at least g_amx_rows routed rows, its routed rows
// of h copied into `store` (kept across calls; guarded by g_call_mu, which the caller holds) with zero rows up to
// a multiple of 16, rows hx_ld = d + 32 apart (rows 4 KB apart would share one L1 set). Experts routed every row
// share one copy.
inline void gather_rows(Call& c) {
  static std::vector<bf16> store;
  c.hx.assign(c.k, nullptr);
  if (c.isa != kAmxBf16 || c.fmt != kBf16) return;
  const int min_rows = g_amx_rows.load();
  const size_t d = size_t(c.d), ld = c.hx_ld = d + 32;
  size_t need = 0;
  bool whole_counted = false;
  for (int j = 0; j < c.k; ++j) {
    const int m = c.row_off[j + 1] - c.row_off[j];
    if (m < min_rows || (m == c.n && whole_counted)) continue;
    whole_counted = whole_counted || m == c.n;
    need += tile_padded(m) * ld;
  }
  store.resize(std::max(store.size(), need));
  const bf16* whole = nullptr;
  size_t at = 0;
  for (int j = 0; j < c.k; ++j) {
    const int m = c.row_off[j + 1] - c.row_off[j];
    if (m < min_rows) continue;
    if (m == c.n && whole) {
      c.hx[j] = whole;
      continue;
    }
    bf16* dst = store.data() + at;
    const int* rows = c.rows.data() + c.row_off[j];
    for (int r = 0; r < m; ++r) std::memcpy(dst + r * ld, c.h + size_t(rows[r]) * d, d * sizeof(bf16));
    std::memset(dst + m * ld, 0, (tile_padded(m) - m) * ld * sizeof(bf16));
    at += tile_padded(m) * ld;
    c.hx[j] = dst;
    if (m == c.n) whole = dst;
  }
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configure tiles 0-7 as 16 rows of 64 bytes on this thread; amx_end releases them (the thread may run other
// code between calls, the caller's too: the configuration is not assumed to survive a group).
inline bool amx_begin() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  // Not _tile_loadconfig: some compilers' version tells the optimizer it reads 8 bytes, dropping the stores
  // of the rest of the configuration.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
  return true;
}
inline void amx_end() { _tile_release(); }

// Index vectors for vpermt2w: lo = (row0[i], row1[i]) for columns i in [0, 16), hi for [16, 32).
struct PairIndex {
  __m512i lo, hi;
  PairIndex() {
    alignas(64) int16_t l[32], h[32];
    for (int i = 0; i < 32; ++i) {
      l[i] = int16_t((i & 1) * 32 + i / 2);
      h[i] = int16_t((i & 1) * 32 + 16 + i / 2);
    }
    lo = _mm512_load_si512(l);
    hi = _mm512_load_si512(h);
  }
};

// Rows r, r+1 at columns [c0, c0 + 32) as two tile rows (columns [c0, c0 + 16) and [c0 + 16, c0 + 32)).
inline void pack_pair(const Bf16Mat& w, int r, int c0, const PairIndex& ix, __m512i* lo, __m512i* hi) {
  __m512i r0, r1;
  pair_of_rows(w, r, c0, &r0, &r1);
  _mm512_store_si512(lo, _mm512_permutex2var_epi16(r0, ix.lo, r1));
  _mm512_store_si512(hi, _mm512_permutex2var_epi16(r0, ix.hi, r1));
}

// g, u [blocks * 16, 32] float32: the unit's gate and up columns for the rows x [blocks * 16, d] (row stride
// Call::hx_ld). The first block packs each 32-row step of weights into buf as it goes and runs over it; with
// more blocks buf keeps every step (d / 32 steps of 4 KB, from L2) for the later blocks to run over again, so the
// weights are read from memory once and each block's sums stay in the tiles for the whole pass.
inline void gate_up_amx(const Call& c, const Bf16Mat& w, int b, const bf16* x, int blocks, __m512i* buf, float* g,
                        float* u) {
  const PairIndex ix;
  const int c0 = b * kBlock;
  const size_t ldx = c.hx_ld * sizeof(bf16);
  for (int rb = 0; rb < blocks; ++rb) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const bf16* xb = x + size_t(rb) * kTileRows * c.hx_ld;
    for (int st = 0; st < c.d / 32; ++st) {
      __m512i* t = buf + (blocks == 1 ? 0 : st * 64);  // 4 tiles of 16 rows: gate lo, gate hi, up lo, up hi
      for (int p = 0; rb == 0 && p < 16; ++p) {
        const int dd = 32 * st + 2 * p;
        if (kGuPrefetch > 0) {
          prefetch_rows(w, dd + 2 * kGuPrefetch, c0);
          prefetch_rows(w, dd + 2 * kGuPrefetch, c.f + c0);
        }
        pack_pair(w, dd, c0, ix, t + p, t + 16 + p);
        pack_pair(w, dd, c.f + c0, ix, t + 32 + p, t + 48 + p);
      }
      _tile_loadd(4, xb + 32 * st, ldx);
      _tile_loadd(5, t, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, t + 16, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, t + 32, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, t + 48, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* gb = g + rb * kTileRows * kBlock;
    float* ub = u + rb * kTileRows * kBlock;
    _tile_stored(0, gb, 128);
    _tile_stored(1, gb + 16, 128);
    _tile_stored(2, ub, 128);
    _tile_stored(3, ub + 16, 128);
  }
}

// y[r, :] += act[r, :] @ down[32 b .. 32 b + 32, :] for the rows of blocks * 16; act [blocks * 16, 32] bf16,
// y float32 with row stride ldy. The sums go through the tiles (loaded from y, stored back).
inline void down_amx(const Call& c, const Bf16Mat& w, int b, int blocks, const bf16* act, __m512i* buf, float* y,
                     size_t ldy) {
  const PairIndex ix;
  const int f0 = b * kBlock;
  const size_t ldb = ldy * sizeof(float);
  if (blocks == 1) _tile_loadd(4, act, 64);
  for (int cb = 0; cb < c.d; cb += kBlock) {
    if (kDownPrefetch > 0) {
      const int ahead = cb + kDownPrefetch * kBlock;
      if (ahead < c.d)
        for (int i = 0; i < kBlock; i += 2) prefetch_rows(w, f0 + i, ahead);
    }
    for (int p = 0; p < 16; ++p) pack_pair(w, f0 + 2 * p, cb, ix, buf + p, buf + 16 + p);
    _tile_loadd(5, buf, 64);
    _tile_loadd(6, buf + 16, 64);
    for (int rb = 0; rb < blocks; ++rb) {
      float* yb = y + size_t(rb) * kTileRows * ldy + cb;
      _tile_loadd(0, yb, ldb);
      _tile_loadd(1, yb + 16, ldb);
      if (blocks > 1) _tile_loadd(4, act + rb * kTileRows * kBlock, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_stored(0, yb, ldb);
      _tile_stored(1, yb + 16, ldb);
    }
  }
}

// The units u0 .. of one expert j (those before hi with c.unit_expert j) of a bf16 call for j's m routed rows,
// on tiles configured by amx_begin; returns the first unit after them. Their down products add up in a per-thread
// [rows, d] float32 buffer (its rows one line longer than d, so a tile's rows do not share a cache set), added
// into partial's routed rows at the end.
inline int units_amx(const Call& c, int u0, int hi, Scratch& s, float* partial, Phases* ph) {
  const int j = c.unit_expert[u0], b0 = c.unit_block[u0];
  int count = 1;
  while (u0 + count < hi && c.unit_expert[u0 + count] == j) ++count;
  const int* rows = c.rows.data() + c.row_off[j];
  const int m = c.row_off[j + 1] - c.row_off[j];
  const Bf16Mat gu = gate_up_mat<Bf16Mat>(c, j), dn = down_mat<Bf16Mat>(c, j);
  const int blocks = (m + kTileRows - 1) / kTileRows;
  const size_t sums = size_t(blocks) * kTileRows * kBlock;  // floats of g (and of u)
  const size_t ldy = size_t(c.d) + 16, ys = size_t(blocks) * kTileRows * ldy;
  const size_t packed = size_t(c.d / 32) * 4 * 256;  // floats of buf: 4 tiles of 1 KB per 32 rows of gate_up
  s.tiles.resize(std::max(s.tiles.size(), 16 + packed + 2 * sums + sums / 2 + ys));
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.tiles.data()) + 63) & ~uintptr_t(63));
  float* y = base;
  float* g = y + ys;
  float* u = g + sums;
  __m512i* buf = reinterpret_cast<__m512i*>(u + sums);
  bf16* act = reinterpret_cast<bf16*>(u + sums + packed);
  const float* coef = c.coef + size_t(j) * c.n;
  int64_t t = ph ? now_ns() : 0;
  std::fill(y, y + ys, 0.0f);
  for (int b = b0; b < b0 + count; ++b) {
    gate_up_amx(c, gu, b, c.hx[j], blocks, buf, g, u);
    if (ph) { const int64_t t1 = now_ns(); ph->gate_up += t1 - t; t = t1; }
    for (int r = 0; r < m; ++r) activation_avx(g + r * kBlock, u + r * kBlock, coef[rows[r]], act + r * kBlock);
    if (ph) { const int64_t t1 = now_ns(); ph->act += t1 - t; t = t1; }
    down_amx(c, dn, b, blocks, act, buf, y, ldy);
    if (ph) { const int64_t t1 = now_ns(); ph->down += t1 - t; t = t1; }
  }
  for (int r = 0; r < m; ++r) {
    float* o = partial + size_t(rows[r]) * c.d;
    const float* yr = y + r * ldy;
    for (int col = 0; col < c.d; col += 16)
      _mm512_storeu_ps(o + col, _mm512_add_ps(_mm512_loadu_ps(o + col), _mm512_load_ps(yr + col)));
  }
  if (ph) ph->down += now_ns() - t;
  return u0 + count;
}

#pragma GCC pop_options
#else
inline bool amx_begin() { return true; }
inline void amx_end() {}
inline int units_amx(const Call&, int u0, int, Scratch&, float*, Phases*) { return u0 + 1; }
#endif

}  // namespace pdscope_cpu_ffn
