// The kernel's thread pool, kept across calls; its default size; a memory bandwidth probe run on it.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ffn_types.h"

namespace pdscope_cpu_ffn {

// ---------------------------------------------------------------------------------------------------------
// A pool of threads kept across calls. Run(fn, ctx, tasks) runs fn(ctx, i) once for every task i < tasks on
// the caller and the pool's threads, each claiming the next task, and returns when all tasks are done. The
// caller works too and never waits for a thread that has not started: under oversubscription a late thread
// finds the job closed and leaves ctx alone. Idle threads spin briefly (the next layer's call usually follows
// within a millisecond), then sleep on a condition variable.
class Pool {
 public:
  explicit Pool(int n) : size_(std::max(n, 1)), spin_us_(env_int("PDSCOPE_CPU_FFN_SPIN_US", 200)) {
    for (int t = 1; t < size_; ++t) threads_.emplace_back([this] { Work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return size_; }

  void Run(void (*fn)(void*, int), void* ctx, int tasks) {
    std::lock_guard<std::mutex> call(call_mu_);
    fn_ = fn;
    ctx_ = ctx;
    tasks_ = tasks;
    next_.store(0);
    done_.store(0);
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t g = gen_.load() + 1;
      open_.store(g);
      gen_.store(g);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
    Claim();
    for (int i = 0; done_.load() != tasks; ++i) Relax(i);
    open_.store(0);  // then no thread enters; wait for those inside
    for (int i = 0; active_.load() != 0; ++i) Relax(i);
  }

 private:
  void Claim() {
    for (int t = next_.fetch_add(1); t < tasks_; t = next_.fetch_add(1)) {
      fn_(ctx_, t);
      done_.fetch_add(1);
    }
  }

  static void Relax(int i) {
#if defined(__x86_64__)
    if (i < 2000) { _mm_pause(); return; }  // then yield: under oversubscription the awaited thread needs a core
#endif
    std::this_thread::yield();
  }

  void Work() {
    pthread_setname_np(pthread_self(), "pdscope-ffn");  // named in top -H and /proc/<pid>/task
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = gen_.load();
      auto start = std::chrono::steady_clock::now();
      for (int i = 0; g == seen; ++i) {
        if ((i & 255) == 255 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleepers_;
          cv_.wait(lock, [&] { return gen_.load() != seen; });
          --sleepers_;
        }
#if defined(__x86_64__)
        _mm_pause();
#endif
        g = gen_.load();
      }
      seen = g;
      if (stop_.load()) return;
      active_.fetch_add(1);
      if (open_.load() == g) Claim();
      active_.fetch_sub(1);
    }
  }

  const int size_;
  const int spin_us_;
  std::vector<std::thread> threads_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  int sleepers_ = 0;                    // guarded by mu_
  std::atomic<uint64_t> gen_{0};        // bumped per job
  std::atomic<uint64_t> open_{0};       // the job's gen while it may be entered, else 0
  std::atomic<int> active_{0};          // threads inside a job
  std::atomic<int> next_{0}, done_{0};  // tasks claimed, tasks finished
  std::atomic<bool> stop_{false};
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  int tasks_ = 0;
};

// The pool's size unless told: PDSCOPE_CPU_FFN_THREADS, else the CPUs this process may run on.
inline int default_pool_size() {
  if (const char* env = std::getenv("PDSCOPE_CPU_FFN_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                           : int(std::thread::hardware_concurrency());
  // Leave two cores to the process's other busy threads (the one launching the GPU's work, the bridge's worker)
  // where there are many: a pool thread that shares a core with them holds up every call.
  return cpus >= 8 ? cpus - 2 : std::max(cpus, 1);
}

struct ReadArgs {
  const uint8_t* data;
  size_t bytes;
};
constexpr size_t kReadTask = size_t(1) << 20;

inline void read_task(void* ctx, int task) {
  auto* args = static_cast<ReadArgs*>(ctx);
  const size_t lo = size_t(task) * kReadTask, hi = std::min(args->bytes, lo + kReadTask);
  uint64_t acc = 0;
  for (size_t i = lo; i + 8 <= hi; i += 64) {
    uint64_t v;
    std::memcpy(&v, args->data + i, 8);
    acc += v;
  }
  static std::atomic<uint64_t> sink;
  sink.fetch_add(acc, std::memory_order_relaxed);
}

// Read `bytes` at `data` once with the pool's threads (one 8-byte load per 64-byte line): a bandwidth probe.
inline void read_once(Pool& pool, const uint8_t* data, size_t bytes) {
  ReadArgs args{data, bytes};
  pool.Run(read_task, &args, int((bytes + kReadTask - 1) / kReadTask));
}

}  // namespace pdscope_cpu_ffn
