// The threads of one OpenMP parallel region working through a decode step's layers together
// (decode_stack.h): a barrier between the step's phases instead of a parallel region per
// kernel call, and the split of a phase's items between the threads. Built for the baseline
// x86-64 with bindings.cpp.
#pragma once
#include <immintrin.h>  // _mm_pause (SSE2)
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

namespace preheat {

// A barrier for the `n` threads of one parallel region, reused phase after phase. Each thread
// spins on its own core while the others finish a phase (microseconds at decode sizes: a
// futex sleep and wake costs as much), then yields, so that a thread descheduled on a
// machine with more runnable threads than cores still gets its core back.
class SpinBarrier {
 public:
  void wait(int n) {
    const unsigned phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < SPINS_BEFORE_YIELD) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  // ~40 ns a pause on recent cores: ~80 us of spinning before the first yield.
  static constexpr int SPINS_BEFORE_YIELD = 2000;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<unsigned> phase_{0};
};

// Thread t's part [begin, end) of items [0, n) among nt threads, in parts of at least `grain`
// items: the split at::parallel_for(0, n, grain, ...) makes, so that a phase computes what
// the call it replaces computed, item for item.
inline std::pair<int64_t, int64_t> share_of(int64_t n, int64_t grain, int t, int nt) {
  const int64_t parts = std::min<int64_t>(nt, (n + grain - 1) / grain);
  if (t >= parts) return {n, n};
  const int64_t chunk = (n + parts - 1) / parts;
  return {std::min<int64_t>(n, t * chunk), std::min<int64_t>(n, (t + 1) * chunk)};
}

}  // namespace preheat
