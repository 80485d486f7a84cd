// The kernel's thread pool, kept across calls.
// Part of cpu_ffn.cc (one translation unit); see its header comment for the contract.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include <pthread.h>
#include <vector>

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

}  // namespace pdscope_cpu_ffn
