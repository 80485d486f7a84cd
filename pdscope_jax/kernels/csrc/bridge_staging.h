// The host memory a bridge (host_experts_cuda.cc) shares with the GPU: one pinned, device-mapped block holding
// one layer's inputs (h, ids, coef, copy_ids), a ring of kAheadRing slots of ahead ids, a ring of kBeginRing MoE
// positions (one per begin), the host's result, and the "go", "done" and "copied" words, each part 64-byte
// aligned; each with its host and device address.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_driver.h"

namespace pdscope_cuda {

constexpr uint64_t kAheadRing = 4;  // begins whose ahead ids may be staged before the worker has read them
constexpr uint64_t kBeginRing = 4096;  // begins enqueued and not yet served, at most (each stages its position)

struct Staging {
  uint16_t* h = nullptr;
  int32_t* ids = nullptr;
  int32_t* copy_ids = nullptr;
  int32_t* ahead_ids = nullptr;  // kAheadRing x max_picks, slot seq % kAheadRing
  int32_t* layers = nullptr;  // kBeginRing, slot seq % kBeginRing
  float* coef = nullptr;
  float* out = nullptr;
  volatile uint32_t* go = nullptr;
  volatile uint32_t* done = nullptr;
  volatile uint32_t* copied = nullptr;
  CUdeviceptr h_dev = 0, ids_dev = 0, copy_ids_dev = 0, ahead_ids_dev = 0, layers_dev = 0, coef_dev = 0, out_dev = 0,
              go_dev = 0, done_dev = 0, copied_dev = 0;

  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (block_) driver().host_free(block_);
  }

  // Allocate and lay out the block (a CUDA context current) for up to max_rows rows of hidden size d and
  // max_picks picks a layer; zeroed. 0 on success.
  CUresult Allocate(int max_rows, int max_picks, int d) {
    const Driver& dv = driver();
    const size_t h_bytes = align(sizeof(uint16_t) * max_rows * d), ids_bytes = align(sizeof(int32_t) * max_picks);
    const size_t coef_bytes = align(sizeof(float) * max_picks * max_rows);
    const size_t out_bytes = align(sizeof(float) * max_rows * d);
    const size_t layers_bytes = align(sizeof(int32_t) * kBeginRing);
    const size_t total = h_bytes + (2 + kAheadRing) * ids_bytes + layers_bytes + coef_bytes + out_bytes + 3 * 64;
    CUresult r = dv.host_alloc(&block_, total, kHostAllocPortable | kHostAllocDeviceMap);
    CUdeviceptr base = 0;
    if (r == 0) r = dv.host_device_pointer(&base, block_, 0);
    if (r != 0) return r;
    std::memset(block_, 0, total);
    char* host = static_cast<char*>(block_);
    size_t at = 0;
    auto take = [&](size_t bytes, CUdeviceptr& dev) {
      char* p = host + at;
      dev = base + at;
      at += bytes;
      return p;
    };
    h = reinterpret_cast<uint16_t*>(take(h_bytes, h_dev));
    ids = reinterpret_cast<int32_t*>(take(ids_bytes, ids_dev));
    copy_ids = reinterpret_cast<int32_t*>(take(ids_bytes, copy_ids_dev));
    ahead_ids = reinterpret_cast<int32_t*>(take(kAheadRing * ids_bytes, ahead_ids_dev));
    ahead_stride_ = ids_bytes / sizeof(int32_t);
    layers = reinterpret_cast<int32_t*>(take(layers_bytes, layers_dev));
    coef = reinterpret_cast<float*>(take(coef_bytes, coef_dev));
    out = reinterpret_cast<float*>(take(out_bytes, out_dev));
    go = reinterpret_cast<volatile uint32_t*>(take(64, go_dev));
    done = reinterpret_cast<volatile uint32_t*>(take(64, done_dev));
    copied = reinterpret_cast<volatile uint32_t*>(take(64, copied_dev));
    return 0;
  }

  // The ahead ids' slot of begin number `seq`.
  int32_t* ahead_slot(uint64_t seq) const { return ahead_ids + (seq % kAheadRing) * ahead_stride_; }
  // The MoE position of begin number `seq`.
  int32_t* layer_slot(uint64_t seq) const { return layers + seq % kBeginRing; }

 private:
  static size_t align(size_t bytes) { return (bytes + 63) / 64 * 64; }
  void* block_ = nullptr;
  size_t ahead_stride_ = 0;  // int32s per slot of the ahead ids
};

}  // namespace pdscope_cuda
