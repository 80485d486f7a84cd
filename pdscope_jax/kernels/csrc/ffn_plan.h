// A call's groups of units: how the pool's threads share its work.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ffn_types.h"

namespace pdscope_cpu_ffn {

// The call's groups of units (c.group_lo), claimed by the pool's threads in order. More groups than threads: a
// thread the OS preempts or wakes late holds up the call by one small group, not a 1/threads share (the GPU runtime's
// and the host's own threads share the cores with the pool). bf16 units of one or two rows, off AMX tiles: groups of
// wide_units first (one gate/up pass each), then one unit a group for the last `threads` units, which balance the
// threads; other calls: g_groups_per_thread equal groups per thread.
void plan_groups(Call& c, int64_t threads) {
  const int64_t units = int64_t(c.unit_expert.size());
  int rows_max = 0;
  bool tiles = false;  // an expert on AMX tiles: its units run together anyway (ffn_amx.h)
  for (int j = 0; j < c.k; ++j) {
    rows_max = std::max(rows_max, c.row_off[j + 1] - c.row_off[j]);
    tiles = tiles || c.hx[j] != nullptr;
  }
  const int64_t wide = c.fmt == kBf16 && !tiles ? wide_units(rows_max) : 1;
  c.group_lo.clear();
  if (wide > 1) {
    const int64_t paired = std::max<int64_t>(units - threads, 0) / wide * wide;
    for (int64_t u = 0; u < paired; u += wide) c.group_lo.push_back(int(u));
    for (int64_t u = paired; u < units; ++u) c.group_lo.push_back(int(u));
  } else {
    const int64_t groups = std::min(units, threads * g_groups_per_thread.load());
    for (int64_t g = 0; g < groups; ++g) c.group_lo.push_back(int(units * g / groups));
  }
  c.group_lo.push_back(int(units));
}

}  // namespace pdscope_cpu_ffn
