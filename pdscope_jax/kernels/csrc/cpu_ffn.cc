// Routed-expert SwiGLU FFN on the CPU as XLA FFI handlers, reading bf16 weights where they lie.
//
// out[n, :] = sum_j coef[j, n] * (silu(h[n] @ Wg_j) * (h[n] @ Wu_j)) @ Wd_j        (float32 out [N, D])
// gate_up_j [D, 2F] row-major bf16 (gate = columns [0, F), up = [F, 2F)), down_j [F, D] bf16, h [N, D] bf16,
// coef [k, N] float32. Products accumulate in float32; silu runs in float32; the activation is rounded to bf16
// (after scaling by coef) before the down projection. A row whose coef is exactly 0 for expert j skips it;
// an expert with no such row reads none of its bytes.
//
// Work split: a unit is (expert j, 32 consecutive intermediate columns b). The units of all k experts are
// cut into contiguous groups (plan_groups); threads claim groups and, per unit, compute its gate and up
// columns for the routed rows, the activation, and the matching 32 rows of down into the group's [N, D]
// float32 partial sum; one reduction at the end adds the partials in group order. No barrier between
// experts, every weight byte is read once per call, the split balances across experts, and the result does
// not depend on which thread ran which group (bitwise the same for a given pool size). Weights walk row by row
// with software prefetch (a unit's rows are 2F or D elements apart, too far for the hardware prefetchers).
//
// Quantized experts (int8 per output column, int4 in groups of G rows; layouts in ffn_weights.h) compute the
// same with W = q * scale exactly: the integers are read once, turned into bf16 in registers (exact), and the
// float32 sums of each run of rows within one scale group (32 rows; few-row kernels: a slab) are scaled per
// column. The scales are float32 or bf16, one type per call, read where they lie (bf16 widened in registers: exact,
// the same result as their float32 copy). Two adjacent units of one expert share their gate/up pass (half a 64-byte
// line each); with at most 4 routed rows (set_quant_rows: int4 by default) all of a group's units of one expert
// run together on the few-row kernels.
//
// Handlers: pdscope_cpu_ffn_list (h, coef, k gate_ups, k downs -> out) and pdscope_cpu_ffn_stacked
// (h, coef, ids [k] int32, gate_up [E, D, 2F], down [E, F, D] -> out); pdscope_cpu_ffn_quant_list (h, coef,
// k gate_up q, k gate_up scales, k down q, k down scales; attribute bits 8 or 4) and
// pdscope_cpu_ffn_quant_stacked (h, coef, ids, the four stacks; bits). Exported controls: threads, ISA,
// phase profile, the streamed few-row path (off by default), the few-row quantized kernels' row limit, and
// pdscope_cpu_ffn_run for the CUDA bridge.
// Parts: ffn_types.h (the call, scratch, tunables), ffn_plan.h (a call's groups of units), ffn_weights.h (the
// formats), ffn_units.h (one unit: portable and AVX-512 BF16 kernels), ffn_quant.h (int8 and int4 units of at most
// 4 rows, a run at a time), ffn_quant_args.h (the quantized handlers' buffers), ffn_amx.h (bf16 units of several rows
// on AMX-BF16 tiles), ffn_stream.h (few rows, contiguous passes), thread_pool.h; this file runs a call's groups and
// reduces them.

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
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

#include "ffn_amx.h"
#include "ffn_quant.h"
#include "ffn_quant_args.h"
#include "ffn_stream.h"
#include "ffn_types.h"
#include "ffn_plan.h"
#include "ffn_units.h"
#include "thread_pool.h"

namespace ffi = xla::ffi;

namespace {

using namespace pdscope_cpu_ffn;

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
  if (!g_pool) g_pool = std::make_unique<Pool>(default_pool_size());
  return *g_pool;
}

int best_isa() { return !cpu_has_avx512bf16() ? kScalar : amx_permitted() ? kAmxBf16 : kAvx512Bf16; }

int current_isa() {
  int isa = g_isa.load();
  if (isa < 0) g_isa.store(isa = best_isa());
  return isa;
}

// Quantized units, their scales of type S (float or bf16).
template <class S>
int run_quant(const Call& c, int j, int b, int nb, int run, const int* rows, int m, Scratch& s, float* partial,
              Phases* ph) {
  if (c.fmt == kInt8) return run_units<Int8Mat<S>>(c, j, b, nb, run, rows, m, s, partial, ph);
  return run_units<Int4Mat<S>>(c, j, b, nb, run, rows, m, s, partial, ph);
}

// ---------------------------------------------------------------------------------------------------------
void compute_group(void* ctx, int g) {
  Call& c = *static_cast<Call*>(ctx);
  const int lo = c.group_lo[g], hi = c.group_lo[g + 1];
  if (lo == hi) return;
  Scratch& s = tls_scratch;
  s.act.resize(size_t(c.n) * kBlock);
  s.gu.resize(2 * 2 * size_t(std::max(c.n, kGuRows)) * kBlock);  // gate, up: 2 units of n rows, or wide_units(m)
  Phases* ph = c.profile ? &c.group_ns[g] : nullptr;
  const int64_t start = ph ? now_ns() : 0;
  float* partial = c.partials[g];
  std::memset(partial, 0, sizeof(float) * size_t(c.n) * c.d);
  c.used[g] = 1;
  bool tiles = false;  // tiles configured on this thread for this group
  for (int u = lo; u < hi;) {
    const int j = c.unit_expert[u], b = c.unit_block[u];
    const int* rows = c.rows.data() + c.row_off[j];
    const int m = c.row_off[j + 1] - c.row_off[j];
    // Quantized: an even block and the next one of its expert run together (a weight row's 64-byte line holds
    // both units' columns; see gate_up_many), or the few-row kernels take the whole run; bf16 of one or two rows:
    // up to wide_units(m) units share one pass over the weight rows (gate_up_wide). Either way the order of
    // additions into the partial is fixed by the group's units.
    int run = 1;  // the group's units of expert j from u on
    while (u + run < hi && c.unit_expert[u + run] == j) ++run;
    const int nb = c.fmt == kBf16 ? std::min(run, wide_units(m)) : (b % 2 == 0 && run > 1 ? 2 : 1);
    if (c.hx[j]) {  // the group's units of expert j on tiles, together
      tiles = tiles || amx_begin();
      u = units_amx(c, u, hi, s, partial, ph);
      continue;
    }
    if (c.fmt == kBf16)
      u += run_units<Bf16Mat>(c, j, b, nb, run, rows, m, s, partial, ph);
    else if (c.scale_bits == 16)
      u += run_quant<bf16>(c, j, b, nb, run, rows, m, s, partial, ph);
    else
      u += run_quant<float>(c, j, b, nb, run, rows, m, s, partial, ph);
  }
  if (tiles) amx_end();
  if (ph) ph->total = now_ns() - start;
}

constexpr size_t kReduceChunk = 512;  // floats: one decode row's sum (D = 2048) in 4 parallel chunks

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
  if (streams(c)) {
    run_streamed(c, p);
    return;
  }
  gather_rows(c);
  plan_groups(c, int64_t(p.size()));
  const int groups = int(c.group_lo.size()) - 1;
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

// The call's sizes checked, its activations, coefficients and output bound, and run.
ffi::Error checked_run(Call& c, ffi::Buffer<ffi::BF16>& h, ffi::Buffer<ffi::F32>& coef,
                       ffi::ResultBuffer<ffi::F32>& out) {
  if (auto e = check_shapes(c); e.failure()) return e;
  c.h = h.typed_data();
  c.coef = coef.typed_data();
  c.out = out->typed_data();
  run_call(c);
  return ffi::Error::Success();
}

// The activations h [N, D] and coefficients coef [k, N] read into c.n, c.d and c.k; false where they do not fit.
bool read_rows(Call& c, const ffi::Buffer<ffi::BF16>& h, const ffi::Buffer<ffi::F32>& coef) {
  auto hd = h.dimensions(), cd = coef.dimensions();
  if (hd.size() != 2 || cd.size() != 2 || cd[1] != hd[0]) return false;
  c.n = int(hd[0]);
  c.d = int(hd[1]);
  c.k = int(cd[0]);
  return true;
}

ffi::Error ffn_list(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> coef, ffi::RemainingArgs weights,
                    ffi::ResultBuffer<ffi::F32> out) {
  Call c;
  if (!read_rows(c, h, coef)) return ffi::Error::InvalidArgument("pdscope_cpu_ffn_list: h [N, D], coef [k, N]");
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
  return checked_run(c, h, coef, out);
}

ffi::Error ffn_stacked(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::BF16> gate_up, ffi::Buffer<ffi::BF16> down,
                       ffi::ResultBuffer<ffi::F32> out) {
  Call c;
  auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (!read_rows(c, h, coef) || gd.size() != 3 || dd.size() != 3 || ids.element_count() != size_t(c.k))
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_stacked: h [N, D], coef [k, N], ids [k], stacks 3-d");
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
  return checked_run(c, h, coef, out);
}

// h [N, D] bf16, coef [k, N] f32, then k gate_up q, k gate_up scales, k down q, k down scales; attribute bits.
ffi::Error ffn_quant_list(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> coef, ffi::RemainingArgs weights,
                          ffi::ResultBuffer<ffi::F32> out, int32_t bits) {
  Call c;
  if (auto e = quant_format(c, bits); e.failure()) return e;
  if (!read_rows(c, h, coef))
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_quant_list: h [N, D], coef [k, N]");
  if (weights.size() != size_t(4 * c.k))
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_quant_list: expected k gate_up q, k gate_up scales, "
                                       "k down q, k down scales");
  c.f = kBlock;
  for (int j = 0; j < c.k; ++j) {
    auto gq = weights.get<ffi::AnyBuffer>(j), dq = weights.get<ffi::AnyBuffer>(2 * c.k + j);
    auto gs = weights.get<ffi::AnyBuffer>(c.k + j), ds = weights.get<ffi::AnyBuffer>(3 * c.k + j);
    if (!gq.has_value() || !dq.has_value() || !gs.has_value() || !ds.has_value())
      return ffi::Error::InvalidArgument(std::string("pdscope_cpu_ffn_quant_list") + kQuantLayout);
    if (j == 0 && gq->dimensions().size() == 2) c.f = int(gq->dimensions()[1] / 2);
    const int64_t gg = quant_group(c, *gq, *gs, bits, 0, c.d, 2 * int64_t(c.f));
    const int64_t dg = quant_group(c, *dq, *ds, bits, 0, c.f, c.d);
    if (gg == 0 || dg == 0 || (j > 0 && (gg != c.gu_group || dg != c.dn_group)))
      return ffi::Error::InvalidArgument(std::string("pdscope_cpu_ffn_quant_list") + kQuantLayout +
                                         ", the same for every expert");
    c.gu_group = int(gg);
    c.dn_group = int(dg);
    c.gate_up.push_back(gq->untyped_data());
    c.gate_up_scale.push_back(gs->untyped_data());
    c.down.push_back(dq->untyped_data());
    c.down_scale.push_back(ds->untyped_data());
  }
  return checked_run(c, h, coef, out);
}

// h, coef, ids [k] int32, then the stacks gate_up q [E, ...], its scales [E, ...], down q, its scales; bits.
ffi::Error ffn_quant_stacked(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::S32> ids,
                             ffi::AnyBuffer gq, ffi::AnyBuffer gs, ffi::AnyBuffer dq, ffi::AnyBuffer ds,
                             ffi::ResultBuffer<ffi::F32> out, int32_t bits) {
  Call c;
  if (auto e = quant_format(c, bits); e.failure()) return e;
  auto gd = gq.dimensions();
  if (!read_rows(c, h, coef) || gd.size() != 3 || ids.element_count() != size_t(c.k))
    return ffi::Error::InvalidArgument("pdscope_cpu_ffn_quant_stacked: h [N, D], coef [k, N], ids [k], stacks 3-d");
  c.f = int(gd[2] / 2);
  const int64_t experts = gd[0];
  const int64_t gg = quant_group(c, gq, gs, bits, 1, c.d, 2 * int64_t(c.f));
  const int64_t dg = quant_group(c, dq, ds, bits, 1, c.f, c.d);
  if (gg == 0 || dg == 0 || dq.dimensions()[0] != experts)
    return ffi::Error::InvalidArgument(std::string("pdscope_cpu_ffn_quant_stacked") + kQuantLayout +
                                       ", after one leading expert axis");
  if (auto e = check_shapes(c); e.failure()) return e;
  c.gu_group = int(gg);
  c.dn_group = int(dg);
  const size_t e = size_t(std::max<int64_t>(experts, 1));
  const size_t gq_bytes = gq.size_bytes() / e, dq_bytes = dq.size_bytes() / e;
  const size_t gs_bytes = gs.size_bytes() / e, ds_bytes = ds.size_bytes() / e;
  const int32_t* id = ids.typed_data();
  for (int j = 0; j < c.k; ++j) {
    if (id[j] < 0 || id[j] >= experts)
      return ffi::Error::InvalidArgument("pdscope_cpu_ffn_quant_stacked: id out of range");
    c.gate_up.push_back(static_cast<const uint8_t*>(gq.untyped_data()) + id[j] * gq_bytes);
    c.gate_up_scale.push_back(static_cast<const uint8_t*>(gs.untyped_data()) + id[j] * gs_bytes);
    c.down.push_back(static_cast<const uint8_t*>(dq.untyped_data()) + id[j] * dq_bytes);
    c.down_scale.push_back(static_cast<const uint8_t*>(ds.untyped_data()) + id[j] * ds_bytes);
  }
  return checked_run(c, h, coef, out);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_cpu_ffn_quant_list, ffn_quant_list,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_cpu_ffn_quant_stacked, ffn_quant_stacked,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()  // gate_up q
                                  .Arg<ffi::AnyBuffer>()  // its scales, f32 or bf16
                                  .Arg<ffi::AnyBuffer>()  // down q
                                  .Arg<ffi::AnyBuffer>()  // its scales, of the same type
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits"));

extern "C" {

// The instruction set in use: 3 = AMX-BF16 and AVX-512 BF16, 2 = AVX-512 BF16, 0 = portable.
int pdscope_cpu_ffn_isa() { return current_isa(); }

// The best instruction set this CPU supports (what `isa` picks unless forced).
int pdscope_cpu_ffn_best_isa() { return best_isa(); }

// Force an instruction set (0, 2 or 3; 2 and 3 where supported), or -1 for the best one. Returns the one in use.
int pdscope_cpu_ffn_set_isa(int isa) {
  if (isa != kScalar && isa != kAvx512Bf16 && isa != kAmxBf16) isa = -1;
  if (isa > best_isa()) isa = -1;
  if (isa < 0) isa = best_isa();
  g_isa.store(isa);
  return isa;
}

int pdscope_cpu_ffn_threads() { return pool().size(); }

// Use the streamed few-row bf16 path (ffn_stream.h) for calls it takes (1) or never (0); returns the setting.
int pdscope_cpu_ffn_set_stream(int on) {
  g_stream.store(on != 0);
  return g_stream.load() ? 1 : 0;
}

// The fewest routed rows of an expert for its bf16 units to run on AMX tiles, where AMX is in use (n >= 1;
// n <= 0 keeps it); returns the setting.
int pdscope_cpu_ffn_set_amx_rows(int n) {
  if (n > 0) g_amx_rows.store(n);
  return g_amx_rows.load();
}

// The most routed rows of an expert of `bits` (4 or 8) for the few-row quantized kernels (ffn_quant.h; 0 to 4, 0:
// none, the unit kernels instead; n < 0 keeps it); returns the setting (-1 for other bits).
int pdscope_cpu_ffn_set_quant_rows(int bits, int n) {
  if (bits != 4 && bits != 8) return -1;
  std::atomic<int>& rows = g_quant_rows[bits == 4 ? 0 : 1];
  if (n >= 0) rows.store(std::min(n, kQuantRows));
  return rows.load();
}

// Groups of units per pool thread in later calls (n >= 1; n <= 0 keeps it); returns the setting.
int pdscope_cpu_ffn_set_groups(int n) {
  if (n > 0) g_groups_per_thread.store(n);
  return g_groups_per_thread.load();
}

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
  g_pool = std::make_unique<Pool>(n > 0 ? n : default_pool_size());
  return g_pool->size();
}

// One call from outside XLA (the CUDA bridge's worker): h [n, d] bf16, coef [k, n], k gate_up [d, 2f] and k down
// [f, d] addresses stored as `bits` says (16: bf16, scales unused; 8, 4: pdscope_cpu_ffn_quant_list's integers, with k
// scale addresses each, of float32 (scale_bits 32) or bf16 (16), and int4's rows per scale row, gu_group and
// dn_group), out [n, d] float32; the list handlers' math. Returns 0, or 1 when the sizes, format, scale type or
// groups do not fit the kernel.
int pdscope_cpu_ffn_run(const uint16_t* h, const float* coef, int n, int d, int f, int k, int bits, int scale_bits,
                        int gu_group, int dn_group, const void* const* gate_up, const void* const* gate_up_scale,
                        const void* const* down, const void* const* down_scale, float* out) {
  Call c;
  c.n = n, c.d = d, c.f = f, c.k = k, c.h = h, c.coef = coef, c.out = out;
  c.gate_up.assign(gate_up, gate_up + k);
  c.down.assign(down, down + k);
  const bool scales = scale_bits == 32 || scale_bits == 16;
  if (scales && (bits == 8 || (bits == 4 && int4_group(gu_group, d) && int4_group(dn_group, f)))) {
    c.fmt = bits == 8 ? kInt8 : kInt4;
    c.scale_bits = scale_bits;
    c.gu_group = bits == 8 ? d : gu_group, c.dn_group = bits == 8 ? f : dn_group;
    c.gate_up_scale.assign(gate_up_scale, gate_up_scale + k);
    c.down_scale.assign(down_scale, down_scale + k);
  }
  if (c.fmt == kBf16 && bits != 16) return 1;  // another format or scale type, or int4 groups the kernel does not take
  if (check_shapes(c).failure()) return 1;
  run_call(c);
  return 0;
}

// Read `bytes` at `data` once with the pool (one 8-byte load per 64-byte line): a memory bandwidth probe.
void pdscope_cpu_ffn_read(const void* data, size_t bytes) {
  read_once(pool(), static_cast<const uint8_t*>(data), bytes);
}

}  // extern "C"
