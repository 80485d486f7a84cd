// Routed experts computed by the host's CPU from inside a CUDA program, while the GPU goes on with its own work.
//
// Three XLA FFI handlers (platform CUDA) bracket a layer's GPU-side expert work in one program:
//   begin(h [N, D] bf16, ids [U] s32, coef [U, N] f32, picks [P] s32, copy_ids [C] s32, ahead_ids [A] s32,
//         from_gate_ups [B, D, 2F] bf16, from_downs [B, F, D] bf16, layer [1] s32: the MoE position)
//       -> (h', picks', gate_ups [C, D, 2F] bf16, downs [C, F, D] bf16, ahead gate_ups [A, ...], ahead downs)
//     enqueues on the program's stream: copies of h, ids, coef, copy_ids and layer into pinned host staging, copies
//     of h and picks into h' and picks' (the GPU work that follows reads those, so it is ordered after begin),
//     and a write of the call's sequence number into a pinned "go" word (U = 0: the host computes nothing;
//     C = 0: nothing is copied);
//   fetched(gate_ups, downs, from_gate_ups, from_downs) -> (gate_ups, downs), aliased: a wait until the pinned
//     "copied" word reaches that sequence number. Then begin's outputs hold, in row c, expert copy_ids[c] where
//     copy_ids[c] >= 0, and row -2 - copy_ids[c] of from_* where copy_ids[c] <= -2 (from_* are the ahead outputs
//     of the layer before's begin: experts copied a layer ahead, moved on the GPU); from_* are passed again so
//     that they stay allocated until those moves are done.
//   end(dep: any buffer) -> y [N, D] f32
//     enqueues a wait until the pinned "done" word reaches that sequence number, then a copy of the host's
//     result into y (`dep` is the GPU work end must follow).
// A worker thread per bridge sees "go", issues the copies of the experts copy_ids from the host's copy into begin's
// outputs on its own stream followed by a write of "copied" (DMA: the program has no conditional to size its copies, so
// the host thread that launches it never waits for the GPU), then those of the next layer's ahead_ids into the ahead
// outputs (a prediction: they overlap this layer's work and the next one's routing; the next layer's rows taken from
// them are moved on the same stream, so after them), then computes out[n] = sum_u coef[u, n] * expert(ids[u])(h[n])
// over the valid ids (>= 0) of that layer with the CPU expert kernel (cpu_ffn.cc's pdscope_cpu_ffn_run, passed in
// as a function pointer; bf16, int8 or int4 experts, the quantized ones, with float32 or bf16 scales, computed,
// never copied), and writes "done". Handlers only enqueue: no host thread ever waits for the GPU, and the GPU
// waits where the program needs a result. Ordering: begin and end alternate in program order and a program's handlers
// run in order on one host thread, so each fetched and end waits for the latest begin. The staging is reused by the
// next begin only after the stream passed this layer's fetched (the worker reads copy_ids before it issues the copies)
// and end (h, ids and coef are read while computing); a layer with no host experts needs no end. Ahead ids are staged
// in a ring of kAheadRing slots by sequence number: the worker reads a begin's slot before it writes that begin's
// "copied", which the next layer's fetched waits for before any later begin. The worker serves begins in sequence; each
// begin's (N, U, C, A) sit in a ring read by sequence number, its layer (a value of the program, so that one traced
// layer serves every position) in the staging's ring, read once "go" is seen. A worker that sees no "go" for
// kWatchdogNs after its begin was enqueued, or a layer out of range, writes "done" anyway and counts a fault (the
// program's result is then wrong, and `pdscope_host_experts_faults` says so) rather than leave the GPU waiting.
// CUDA is reached through the driver library (libcuda.so.1, dlopen), so this builds without the CUDA toolkit;
// creating a bridge fails (returns -1, with a reason) where no driver or no stream memory operations exist.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host_bridge.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace pdscope_cuda;

std::mutex g_mu;
std::vector<std::unique_ptr<Bridge>> g_bridges;
std::string g_problem;

Bridge* bridge(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  return handle >= 0 && size_t(handle) < g_bridges.size() ? g_bridges[handle].get() : nullptr;
}

ffi::Error begin(CUstream stream, ffi::AnyBuffer h, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> coef,
                 ffi::AnyBuffer picks, ffi::Buffer<ffi::S32> copy_ids, ffi::Buffer<ffi::S32> ahead_ids,
                 ffi::AnyBuffer from_gate_ups, ffi::AnyBuffer from_downs, ffi::Buffer<ffi::S32> layer,
                 ffi::Result<ffi::AnyBuffer> h_out, ffi::Result<ffi::AnyBuffer> picks_out,
                 ffi::Result<ffi::AnyBuffer> gate_ups, ffi::Result<ffi::AnyBuffer> downs,
                 ffi::Result<ffi::AnyBuffer> ahead_gate_ups, ffi::Result<ffi::AnyBuffer> ahead_downs, int64_t handle) {
  Bridge* b = bridge(handle);
  if (!b) return ffi::Error::InvalidArgument("pdscope_host_experts_begin: no bridge " + std::to_string(handle));
  return b->Begin(stream, h, ids, coef, picks, copy_ids, ahead_ids, from_gate_ups, from_downs, layer, h_out,
                  picks_out, gate_ups, downs, ahead_gate_ups, ahead_downs);
}

ffi::Error fetched(CUstream stream, ffi::AnyBuffer gate_ups, ffi::AnyBuffer downs, ffi::AnyBuffer, ffi::AnyBuffer,
                   ffi::Result<ffi::AnyBuffer> gate_ups_out, ffi::Result<ffi::AnyBuffer> downs_out, int64_t handle) {
  Bridge* b = bridge(handle);
  if (!b) return ffi::Error::InvalidArgument("pdscope_host_experts_fetched: no bridge " + std::to_string(handle));
  return b->Fetched(stream, gate_ups, downs, gate_ups_out, downs_out);
}

ffi::Error end(CUstream stream, ffi::AnyBuffer, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t handle) {
  Bridge* b = bridge(handle);
  if (!b) return ffi::Error::InvalidArgument("pdscope_host_experts_end: no bridge " + std::to_string(handle));
  return b->End(stream, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_host_experts_begin, begin,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()  // h
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coef
                                  .Arg<ffi::AnyBuffer>()  // picks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // copy_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ahead_ids
                                  .Arg<ffi::AnyBuffer>()  // from_gate_ups
                                  .Arg<ffi::AnyBuffer>()  // from_downs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]: the MoE position
                                  .Ret<ffi::AnyBuffer>()  // h_out
                                  .Ret<ffi::AnyBuffer>()  // picks_out
                                  .Ret<ffi::AnyBuffer>()  // gate_ups
                                  .Ret<ffi::AnyBuffer>()  // downs
                                  .Ret<ffi::AnyBuffer>()  // ahead_gate_ups
                                  .Ret<ffi::AnyBuffer>()  // ahead_downs
                                  .Attr<int64_t>("handle"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_host_experts_fetched, fetched,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()  // gate_ups (aliased to gate_ups_out)
                                  .Arg<ffi::AnyBuffer>()  // downs (aliased to downs_out)
                                  .Arg<ffi::AnyBuffer>()  // begin's ahead_gate_ups (read only to keep them allocated)
                                  .Arg<ffi::AnyBuffer>()  // begin's ahead_downs (likewise)
                                  .Ret<ffi::AnyBuffer>()  // gate_ups_out
                                  .Ret<ffi::AnyBuffer>()  // downs_out
                                  .Attr<int64_t>("handle"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdscope_host_experts_end, end,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("handle"));

extern "C" {

// A bridge for `layers` MoE layers of `experts` experts (hidden d, intermediate f), at most max_rows rows and
// max_picks picks a layer; gate_up / down: layers * experts host addresses of [d, 2f] / [f, d] weights that outlive
// the bridge, stored as `bits` says (HostExperts in host_bridge.h: 16 bf16; 8 or 4 with as many scale addresses
// in gate_up_scale / down_scale, of float32 (scale_bits 32) or bf16 (16), and int4's groups, else those null);
// run: pdscope_cpu_ffn_run; ordinal: the CUDA device. Returns its handle, or -1 (`pdscope_host_experts_problem`
// says why).
int64_t pdscope_host_experts_create(int layers, int experts, int d, int f, int max_rows, int max_picks,
                                    const void* const* gate_up, const void* const* down, int bits, int scale_bits,
                                    int gu_group, int dn_group, const void* const* gate_up_scale,
                                    const void* const* down_scale, void* run, int ordinal) {
  const size_t n = size_t(layers) * experts;
  HostExperts w;  // (assign, not braces: a braced pair of pointers would be a list of those two pointers)
  w.bits = bits, w.scale_bits = scale_bits, w.gu_group = gu_group, w.dn_group = dn_group;
  w.gate_up.assign(gate_up, gate_up + n);
  w.down.assign(down, down + n);
  if (bits != 16) {
    w.gate_up_scale.assign(gate_up_scale, gate_up_scale + n);
    w.down_scale.assign(down_scale, down_scale + n);
  }
  auto b = std::make_unique<Bridge>(layers, experts, d, f, max_rows, max_picks, std::move(w),
                                    reinterpret_cast<RunFn>(run));
  std::string problem = b->Start(ordinal);
  std::lock_guard<std::mutex> lock(g_mu);
  g_problem = problem;
  if (!problem.empty()) return -1;
  g_bridges.push_back(std::move(b));
  return int64_t(g_bridges.size() - 1);
}

// Why the last create failed ("" if it did not).
const char* pdscope_host_experts_problem() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_problem.c_str();
}

// Stop the bridge's worker and free its staging (no program using it may be pending).
void pdscope_host_experts_destroy(int64_t handle) {
  std::unique_ptr<Bridge> gone;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (handle >= 0 && size_t(handle) < g_bridges.size()) gone = std::move(g_bridges[handle]);
  }
}

// Layers served, layers the watchdog or a kernel error failed, and seconds the worker spent computing.
void pdscope_host_experts_stats(int64_t handle, int64_t* served, int64_t* faults, double* busy) {
  Bridge* b = bridge(handle);
  *served = b ? b->served() : 0;
  *faults = b ? b->faults() : 0;
  *busy = b ? b->busy_seconds() : 0.0;
}

// The bridge's latest served layers (at most max), oldest first, 4 int64 each: MoE position, experts computed,
// and the steady-clock ns when the worker saw "go" and wrote "done". Returns how many were written.
int64_t pdscope_host_experts_timeline(int64_t handle, int64_t* out, int64_t max) {
  Bridge* b = bridge(handle);
  return b ? b->timeline(out, max) : 0;
}

}  // extern "C"
