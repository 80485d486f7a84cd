// The bridge itself (host_experts_cuda.cc holds its FFI handlers and C entry points): per bridge, the pinned
// staging, the CUDA stream and events of its copies, and the worker thread that serves each begin in sequence
// (the copies of copy_ids and ahead_ids, then the CPU expert kernel over the host picks, then "done"); the
// protocol is described at the top of host_experts_cuda.cc.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bridge_staging.h"
#include "cuda_driver.h"
#include "xla/ffi/api/ffi.h"

namespace pdscope_cuda {

namespace ffi = xla::ffi;

constexpr uint64_t kRing = kBeginRing;
constexpr size_t kTimeline = 8192;  // layers the timeline keeps (the latest)
constexpr int64_t kWatchdogNs = int64_t(30) * 1000 * 1000 * 1000;

// cpu_ffn.cc's pdscope_cpu_ffn_run: (h, coef, n, d, f, k, bits, scale_bits, gu_group, dn_group, gate_up, gate_up
// scales, down, down scales, out) -> 0 on success.
using RunFn = int (*)(const uint16_t*, const float*, int, int, int, int, int, int, int, int, const void* const*,
                      const void* const*, const void* const*, const void* const*, float*);

// Where a bridge's experts lie in host memory, at [layer * experts + expert]: gate_up [d, 2f] and down [f, d] as
// `bits` says (16: bf16; 8 or 4: cpu_ffn.cc's integers with scales of float32 (scale_bits 32) or bf16 (16), the
// kernel reading either where it lies, int4 with rows per scale row gu_group / dn_group; then the worker computes
// them but copies none: its copies fill bf16 rows).
struct HostExperts {
  int bits = 16, scale_bits = 32, gu_group = 0, dn_group = 0;
  std::vector<const void*> gate_up, down;
  std::vector<const void*> gate_up_scale, down_scale;  // empty for bf16
};

struct Desc {
  int64_t layer = 0;
  int n = 0, u = 0, c = 0, a = 0;  // rows, host picks, copy rows, rows copied ahead (of layer + 1)
  CUdeviceptr gate_up_dst = 0, down_dst = 0;  // begin's outputs the copies fill
  CUdeviceptr ahead_gate_up_dst = 0, ahead_down_dst = 0;  // the ahead outputs
  CUdeviceptr from_gate_up = 0, from_down = 0;  // the layer before's ahead outputs (rows taken by -2 - id)
  int from_rows = 0;
};

// One served layer in the timeline: when the worker saw "go" and when it wrote "done" (steady clock, ns).
struct Served {
  int64_t layer = 0, experts = 0, go_ns = 0, done_ns = 0;
};

class Bridge {
 public:
  Bridge(int layers, int experts, int d, int f, int max_rows, int max_picks, HostExperts w, RunFn run)
      : layers_(layers), experts_(experts), d_(d), f_(f), max_rows_(max_rows), max_picks_(max_picks),
        w_(std::move(w)), run_(run) {}

  ~Bridge() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    if (copy_stream_ && ctx_ && driver().ctx_push(ctx_) == 0) {
      driver().stream_destroy(copy_stream_);
      CUcontext popped;
      driver().ctx_pop(&popped);
    }
  }

  // Allocate the mapped staging under the device's primary context and start the worker. "" on success.
  std::string Start(int ordinal) {
    const Driver& dv = driver();
    if (!dv.problem.empty()) return dv.problem;
    CUresult r = dv.init(0);
    int device = 0;
    CUcontext ctx = nullptr;
    if (r == 0) r = dv.device_get(&device, ordinal);
    if (r == 0) r = dv.primary_ctx_retain(&ctx, device);
    if (r == 0) r = dv.ctx_push(ctx);
    if (r != 0) return "CUDA context: " + cu_message(r);
    r = s_.Allocate(max_rows_, max_picks_, d_);
    if (r == 0) r = dv.stream_create(&copy_stream_, kStreamNonBlocking);
    ctx_ = ctx;
    CUcontext popped;
    dv.ctx_pop(&popped);
    if (r != 0) return "pinned staging and copy stream: " + cu_message(r);
    worker_ = std::thread([this] { Work(); });
    return "";
  }

  ffi::Error Begin(CUstream stream, ffi::AnyBuffer h, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> coef,
                   ffi::AnyBuffer picks, ffi::Buffer<ffi::S32> copy_ids, ffi::Buffer<ffi::S32> ahead_ids,
                   ffi::AnyBuffer from_gate_ups, ffi::AnyBuffer from_downs, ffi::Buffer<ffi::S32> layer,
                   ffi::Result<ffi::AnyBuffer> h_out, ffi::Result<ffi::AnyBuffer> picks_out,
                   ffi::Result<ffi::AnyBuffer> gate_ups, ffi::Result<ffi::AnyBuffer> downs,
                   ffi::Result<ffi::AnyBuffer> ahead_gate_ups, ffi::Result<ffi::AnyBuffer> ahead_downs) {
    auto hd = h.dimensions(), cd = coef.dimensions();
    const int64_t c = int64_t(copy_ids.element_count()), a = int64_t(ahead_ids.element_count());
    if (h.element_type() != ffi::DataType::BF16 || hd.size() != 2 || hd[1] != d_ || hd[0] > max_rows_ ||
        cd.size() != 2 || (cd[0] > 0 && cd[1] != hd[0]) || cd[0] != int64_t(ids.element_count()) ||
        cd[0] > max_picks_ || c > max_picks_ || a > max_picks_ || layer.element_count() != 1 ||
        (w_.bits != 16 && (c > 0 || a > 0)) ||
        !rows_of_experts(*gate_ups, *downs, c) || !rows_of_experts(*ahead_gate_ups, *ahead_downs, a) ||
        from_gate_ups.dimensions().size() == 0 ||
        !rows_of_experts(from_gate_ups, from_downs, from_gate_ups.dimensions()[0]))
      return ffi::Error::InvalidArgument("pdscope_host_experts_begin: h [N<=" + std::to_string(max_rows_) + ", " +
                                         std::to_string(d_) + "] bf16, ids [U<=" + std::to_string(max_picks_) +
                                         "], coef [U, N], copy_ids [C], ahead_ids [A], from_* and outputs [B, C "
                                         "or A, D, 2F] and [B, C or A, F, D] bf16, layer [1] s32; C = A = 0 "
                                         "where the experts are quantized");
    uint64_t seq;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return enqueued_ - served_ < kRing || stop_; });
      seq = ++enqueued_;
      ring_[seq % kRing] = Desc{-1, int(hd[0]), int(cd[0]), int(c), int(a), dev(*gate_ups), dev(*downs),
                                dev(*ahead_gate_ups), dev(*ahead_downs), dev(from_gate_ups), dev(from_downs),
                                int(from_gate_ups.dimensions()[0])};
      enqueued_at_ns_ = now_ns();
    }
    cv_.notify_all();
    last_begin_ = seq;
    const Driver& dv = driver();
    CUresult r = dv.dtoh(s_.layer_slot(seq), dev(layer), sizeof(int32_t), stream);
    if (r == 0 && cd[0] > 0) r = dv.dtoh(s_.h, dev(h), h.size_bytes(), stream);
    if (r == 0 && ids.size_bytes()) r = dv.dtoh(s_.ids, dev(ids), ids.size_bytes(), stream);
    if (r == 0 && coef.size_bytes()) r = dv.dtoh(s_.coef, dev(coef), coef.size_bytes(), stream);
    if (r == 0 && c > 0) r = dv.dtoh(s_.copy_ids, dev(copy_ids), copy_ids.size_bytes(), stream);
    if (r == 0 && a > 0) r = dv.dtoh(s_.ahead_slot(seq), dev(ahead_ids), ahead_ids.size_bytes(), stream);
    if (r == 0) r = dv.dtod(dev(*h_out), dev(h), h.size_bytes(), stream);
    if (r == 0 && picks.size_bytes()) r = dv.dtod(dev(*picks_out), dev(picks), picks.size_bytes(), stream);
    if (r == 0) r = dv.write32(stream, s_.go_dev, uint32_t(seq), kWriteDefault);
    if (r != 0) return ffi::Error::Internal("pdscope_host_experts_begin: " + cu_message(r));
    return ffi::Error::Success();
  }

  // (fetched's from_* are arguments only to stay allocated until here)
  ffi::Error Fetched(CUstream stream, ffi::AnyBuffer gate_ups, ffi::AnyBuffer downs,
                     ffi::Result<ffi::AnyBuffer> gate_ups_out, ffi::Result<ffi::AnyBuffer> downs_out) {
    if (last_begin_ == 0 || gate_ups.size_bytes() != gate_ups_out->size_bytes() ||
        downs.size_bytes() != downs_out->size_bytes())
      return ffi::Error::InvalidArgument("pdscope_host_experts_fetched: begin's copy outputs, after a begin");
    const Driver& dv = driver();
    CUresult r = dv.wait32(stream, s_.copied_dev, uint32_t(last_begin_), kWaitGeq);
    // XLA aliases the outputs to the inputs; where it did not, the rows are copied over
    if (r == 0 && dev(*gate_ups_out) != dev(gate_ups) && gate_ups.size_bytes())
      r = dv.dtod(dev(*gate_ups_out), dev(gate_ups), gate_ups.size_bytes(), stream);
    if (r == 0 && dev(*downs_out) != dev(downs) && downs.size_bytes())
      r = dv.dtod(dev(*downs_out), dev(downs), downs.size_bytes(), stream);
    if (r != 0) return ffi::Error::Internal("pdscope_host_experts_fetched: " + cu_message(r));
    return ffi::Error::Success();
  }

  ffi::Error End(CUstream stream, ffi::Result<ffi::Buffer<ffi::F32>> y) {
    auto yd = y->dimensions();
    if (yd.size() != 2 || yd[1] != d_ || yd[0] > max_rows_ || last_begin_ == 0)
      return ffi::Error::InvalidArgument("pdscope_host_experts_end: y [N, D] f32 after a begin");
    const Driver& dv = driver();
    CUresult r = dv.wait32(stream, s_.done_dev, uint32_t(last_begin_), kWaitGeq);
    if (r == 0) r = dv.htod(dev(*y), s_.out, y->size_bytes(), stream);
    if (r != 0) return ffi::Error::Internal("pdscope_host_experts_end: " + cu_message(r));
    return ffi::Error::Success();
  }

  int64_t faults() const { return faults_.load(); }
  int64_t served() {
    std::lock_guard<std::mutex> lock(mu_);
    return int64_t(served_);
  }
  double busy_seconds() const { return busy_ns_.load() * 1e-9; }

  // The latest served layers, oldest first, as (layer, experts, go ns, done ns) into out[4 * i ..]; -> count.
  int64_t timeline(int64_t* out, int64_t max) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t n = std::min<uint64_t>({served_, kTimeline, uint64_t(std::max<int64_t>(max, 0))});
    for (uint64_t i = 0; i < n; ++i) {
      const Served& e = timeline_[(served_ - n + i + 1) % kTimeline];
      out[4 * i] = e.layer, out[4 * i + 1] = e.experts, out[4 * i + 2] = e.go_ns, out[4 * i + 3] = e.done_ns;
    }
    return int64_t(n);
  }

 private:
  // Whether gate_ups [rows, D, 2F] and downs [rows, F, D] are bf16 buffers of `rows` experts.
  bool rows_of_experts(const ffi::AnyBuffer& gate_ups, const ffi::AnyBuffer& downs, int64_t rows) const {
    auto gd = gate_ups.dimensions(), dd = downs.dimensions();
    return gate_ups.element_type() == ffi::DataType::BF16 && downs.element_type() == ffi::DataType::BF16 &&
           gd.size() == 3 && gd[0] == rows && gd[1] == d_ && gd[2] == 2 * f_ && dd.size() == 3 && dd[0] == rows &&
           dd[1] == f_ && dd[2] == d_;
  }
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  template <typename B>
  static CUdeviceptr dev(const B& buffer) {
    return CUdeviceptr(reinterpret_cast<uintptr_t>(buffer.untyped_data()));
  }

  void Work() {
    pthread_setname_np(pthread_self(), "pdscope-bridge");
    driver().ctx_set_current(ctx_);  // the copies are issued from this thread
    for (;;) {
      uint64_t want;
      Desc desc;
      int64_t since;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || enqueued_ > served_; });
        if (stop_) return;
        want = served_ + 1;
        desc = ring_[want % kRing];
        since = enqueued_at_ns_;
      }
      // Spin on "go" (the GPU reaches this layer within microseconds to milliseconds), then back off.
      bool seen = false;
      for (int64_t spins = 0;; ++spins) {
        if (int32_t(*s_.go - uint32_t(want)) >= 0) {
          seen = true;
          break;
        }
        if (spins < 200000) {
#if defined(__x86_64__)
          _mm_pause();
#endif
        } else {
          if (stop_requested()) return;
          if (now_ns() - since > kWatchdogNs) break;
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
      if (seen) {  // a layer out of range (or, copying ahead, the last) is served as a fault
        std::atomic_thread_fence(std::memory_order_acquire);
        desc.layer = *s_.layer_slot(want);
        seen = desc.layer >= 0 && desc.layer < layers_ && (desc.a == 0 || desc.layer + 1 < layers_);
      }
      const int64_t t0 = now_ns();
      int experts = 0;
      if (desc.c > 0 || desc.a > 0) Copy(desc, want, seen);
      if (seen) {
        experts = Compute(desc);
      } else {
        faults_.fetch_add(1);
        std::memset(s_.out, 0, sizeof(float) * size_t(desc.n) * d_);
      }
      std::atomic_thread_fence(std::memory_order_seq_cst);
      *s_.done = uint32_t(want);
      const int64_t t1 = now_ns();
      busy_ns_.fetch_add(t1 - t0);
      {
        std::lock_guard<std::mutex> lock(mu_);
        served_ = want;
        timeline_[want % kTimeline] = Served{desc.layer, experts, t0, t1};
      }
      cv_.notify_all();
    }
  }

  bool stop_requested() { std::lock_guard<std::mutex> lock(mu_); return stop_; }

  // Issue the copies of the layer's copy_ids into begin's outputs on the copy stream (from the host, or from the
  // layer before's ahead outputs), then the write of "copied" (ordered after them by the stream), then the copies
  // of the next layer's ahead_ids; with no "go" seen (a fault), only the write, so the GPU goes on. Both lists
  // are read before any copy is issued.
  void Copy(const Desc& desc, uint64_t want, bool seen) {
    const std::vector<int32_t> copy_ids(s_.copy_ids, s_.copy_ids + desc.c);
    const std::vector<int32_t> ahead_ids(s_.ahead_slot(want), s_.ahead_slot(want) + desc.a);
    CUresult r = 0;
    if (seen) r = CopyRows(desc.layer, copy_ids, desc.gate_up_dst, desc.down_dst, &desc);
    if (r != 0) faults_.fetch_add(1);
    if (desc.c > 0 && driver().write32(copy_stream_, s_.copied_dev, uint32_t(want), kWriteDefault) != 0) {
      faults_.fetch_add(1);
      *s_.copied = uint32_t(want);  // the GPU must not wait forever; the rows are then wrong (a fault)
    }
    if (seen && CopyRows(desc.layer + 1, ahead_ids, desc.ahead_gate_up_dst, desc.ahead_down_dst, nullptr) != 0)
      faults_.fetch_add(1);  // the next layer's rows taken from these are wrong
  }

  // Copies into row i of gate_up_dst / down_dst on the copy stream: `layer`'s expert ids[i] from the host where
  // ids[i] >= 0; with `from`, row -2 - ids[i] of its from_* where ids[i] <= -2 (on the GPU); else nothing.
  CUresult CopyRows(int64_t layer, const std::vector<int32_t>& ids, CUdeviceptr gate_up_dst, CUdeviceptr down_dst,
                    const Desc* from) {
    const Driver& dv = driver();
    const size_t gu_bytes = sizeof(uint16_t) * size_t(d_) * 2 * f_, dn_bytes = sizeof(uint16_t) * size_t(f_) * d_;
    CUresult r = 0;
    for (size_t i = 0; r == 0 && i < ids.size(); ++i) {
      const int64_t row = -2 - int64_t(ids[i]);
      if (from && row >= 0 && row < from->from_rows) {
        r = dv.dtod(gate_up_dst + i * gu_bytes, from->from_gate_up + row * gu_bytes, gu_bytes, copy_stream_);
        if (r == 0) r = dv.dtod(down_dst + i * dn_bytes, from->from_down + row * dn_bytes, dn_bytes, copy_stream_);
        continue;
      }
      if (ids[i] < 0 || ids[i] >= experts_) continue;
      const size_t at = size_t(layer) * experts_ + ids[i];
      r = dv.htod(gate_up_dst + i * gu_bytes, w_.gate_up[at], gu_bytes, copy_stream_);
      if (r == 0) r = dv.htod(down_dst + i * dn_bytes, w_.down[at], dn_bytes, copy_stream_);
    }
    return r;
  }

  // -> the experts computed.
  int Compute(const Desc& desc) {
    std::vector<const void*> gu, dn;
    std::vector<const void*> gus, dns;  // quantized: the picks' scales
    std::vector<float> coef;
    const bool scaled = w_.bits != 16;
    for (int u = 0; u < desc.u; ++u) {
      const int32_t id = s_.ids[u];
      if (id < 0 || id >= experts_) continue;
      const size_t at = size_t(desc.layer) * experts_ + id;
      gu.push_back(w_.gate_up[at]);
      dn.push_back(w_.down[at]);
      if (scaled) gus.push_back(w_.gate_up_scale[at]), dns.push_back(w_.down_scale[at]);
      coef.insert(coef.end(), s_.coef + size_t(u) * desc.n, s_.coef + size_t(u + 1) * desc.n);
    }
    if (desc.u == 0) return 0;  // this layer's host part is nothing (no end waits for it)
    if (gu.empty() || run_(s_.h, coef.data(), desc.n, d_, f_, int(gu.size()), w_.bits, w_.scale_bits, w_.gu_group,
                           w_.dn_group, gu.data(), gus.data(), dn.data(), dns.data(), s_.out) != 0) {
      if (!gu.empty()) faults_.fetch_add(1);
      std::memset(s_.out, 0, sizeof(float) * size_t(desc.n) * d_);
    }
    return int(gu.size());
  }

  const int layers_, experts_, d_, f_, max_rows_, max_picks_;
  const HostExperts w_;
  const RunFn run_;
  CUcontext ctx_ = nullptr;
  CUstream copy_stream_ = nullptr;  // the worker's: the copies of begin's copy_ids and the "copied" writes
  Staging s_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t enqueued_ = 0, served_ = 0;
  int64_t enqueued_at_ns_ = 0;
  Desc ring_[kRing];
  Served timeline_[kTimeline];  // guarded by mu_
  uint64_t last_begin_ = 0;  // touched by the handlers' thread only
  std::atomic<int64_t> faults_{0}, busy_ns_{0};
  std::thread worker_;
};

}  // namespace pdscope_cuda
