// The kernel's problem description, scratch, bf16 helpers and tunables.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace pdscope_cpu_ffn {

using bf16 = uint16_t;
constexpr int kBlock = 32;       // intermediate columns per unit (one 64-byte line of a weight row)
constexpr int kGuRows = 4;       // rows held in registers by the gate/up kernel (4 accumulators each)
constexpr int kDownRows = 8;     // rows held in registers by the down kernel (2 accumulators each)
constexpr int kChunkPairs = 16;  // weight row pairs per chunk of the many-row gate/up (4 KB interleaved)
// bf16 units of m rows that one gate/up pass takes together (gate_up_wide): its 4 * m accumulators a unit stay
// within 16 registers.
constexpr int wide_units(int m) { return m == 1 ? 4 : m == 2 ? 2 : 1; }

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}
// Prefetch distances (0: none): gate/up row pairs ahead, down 32-column blocks ahead.
const int kGuPrefetch = env_int("PDSCOPE_CPU_FFN_PF_GU", 12);
const int kDownPrefetch = env_int("PDSCOPE_CPU_FFN_PF_DOWN", 4);
// Groups of units per pool thread in a call (see run_call; pdscope_cpu_ffn_set_groups changes it).
std::atomic<int> g_groups_per_thread{std::max(env_int("PDSCOPE_CPU_FFN_GROUPS", 4), 1)};
// With AMX in use: the fewest routed rows for which an expert's bf16 units run on AMX tiles (ffn_amx.h);
// fewer rows take the AVX-512 kernels (pdscope_cpu_ffn_set_amx_rows changes it).
std::atomic<int> g_amx_rows{std::max(env_int("PDSCOPE_CPU_FFN_AMX_ROWS", 2), 1)};

// kAmxBf16: the AVX-512 BF16 kernels, and AMX-BF16 tiles for bf16 experts with at least g_amx_rows rows.
enum Isa : int { kScalar = 0, kAvx512Bf16 = 2, kAmxBf16 = 3 };
enum Format : int { kBf16 = 16, kInt8 = 8, kInt4 = 4 };  // the weights' stored format (its bits)

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
  int fmt = kBf16;                      // how gate_up and down are stored (ffn_weights.h)
  std::vector<const void*> gate_up;     // k x [d, 2f] (int4: [d/2, 2f] bytes)
  std::vector<const void*> down;        // k x [f, d] (int4: [f/2, d] bytes)
  std::vector<const void*> gate_up_scale, down_scale;  // quantized: k x [d/gu_group, 2f], k x [f/dn_group, d]
  int scale_bits = 32;                  // quantized: the scales' type, 32 (float32) or 16 (bf16)
  int gu_group = 0, dn_group = 0;       // int4: rows per scale (int8: one scale row, bf16: unused)
  float* out = nullptr;                 // [n, d]
  std::vector<int> rows, row_off;       // routed rows of expert j: rows[row_off[j] .. row_off[j+1])
  std::vector<int> unit_expert, unit_block;
  std::vector<const bf16*> hx;          // AMX: expert j's routed rows of h, [round_up(m_j, 16), d], else null
  size_t hx_ld = 0;                     // elements between rows of hx
  std::vector<int> group_lo;            // group g holds units [group_lo[g], group_lo[g + 1])
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
  std::vector<float> tiles;    // AMX: packed weight tiles, gate and up sums, one output tile (aligned inside)
};

thread_local Scratch tls_scratch;

}  // namespace pdscope_cpu_ffn
