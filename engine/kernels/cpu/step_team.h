// The threads of one OpenMP parallel region working through a decode step's layers together
// (decode_stack.h): a barrier between the step's phases instead of a parallel region per
// kernel call, and the split of a phase's items between the threads. Built for the baseline
// x86-64 with bindings.cpp.
#pragma once
#include <immintrin.h>  // _mm_pause, _mm_prefetch (SSE2)
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

namespace preheat {

// Bytes a thread asks the memory for while it waits at a barrier: its share of the next
// product's weights (codes, then their scales), a few lines at a time between looks at the
// barrier. At batch 1 a thread waits through the other's one-row phases (norms, the rotary
// write, quantizing) and through memory imbalance, ~0.1-0.5 ms of a ~4 ms step on the
// GGUF default, while a product's first lines still come cold from DRAM when it starts;
// fetched meanwhile, they are in this core's cache when the product reads them.
struct WaitFetch {
  const char* next = nullptr;  // codes (or bf16 / float32 weights) left to fetch
  int64_t bytes = 0;
  const char* next2 = nullptr;  // then the scales beside int8 codes
  int64_t bytes2 = 0;

  // Up to `lines` more cache lines; false once nothing is left.
  bool some(int lines) {
    for (int i = 0; i < lines; ++i) {
      if (bytes > 0) {
        _mm_prefetch(next, _MM_HINT_T0);
        next += 64;
        bytes -= 64;
      } else if (bytes2 > 0) {
        _mm_prefetch(next2, _MM_HINT_T0);
        next2 += 64;
        bytes2 -= 64;
      } else {
        return false;
      }
    }
    return true;
  }
};

// A barrier for the `n` threads of one parallel region, reused phase after phase. Each thread
// spins on its own core while the others finish a phase (microseconds at decode sizes: a
// futex sleep and wake costs as much), then yields, so that a thread descheduled on a
// machine with more runnable threads than cores still gets its core back. With `fetch`, a
// waiting thread first works through it (WaitFetch) between looks at the barrier.
class SpinBarrier {
 public:
  void wait(int n, WaitFetch* fetch = nullptr) {
    const unsigned phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (fetch != nullptr && fetch->some(FETCH_LINES)) continue;
      if (spins < SPINS_BEFORE_YIELD) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  // ~40 ns a pause on recent cores: ~80 us of spinning before the first yield.
  static constexpr int SPINS_BEFORE_YIELD = 2000;
  // Lines asked for between two looks at the barrier: a waiter leaves soon after the last
  // arrival (4 or 64 measured the same as 16 at batch 1).
  static constexpr int FETCH_LINES = 16;
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
