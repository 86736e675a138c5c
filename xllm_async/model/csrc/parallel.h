// Work items over the calling thread's OpenMP threads (as many as torch.set_num_threads gave that
// execution slot), for the attention and beam kernels.

#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace xllm_parallel {

// Items [0, n) interleaved over the threads: body(first, n, step) runs once per thread, on items
// first, first + step, ... (so it can keep scratch for all of them), and neighbouring items, a
// long prompt and a short one, land on different threads. One thread, or already inside a
// parallel region: body(0, n, 1) here.
template <typename Body>
void interleaved_items(int64_t n, const Body& body) {
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), n));
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
    body(omp_get_thread_num(), n, omp_get_num_threads());
  } else {
    body(0, n, 1);
  }
}

// Items [0, n) claimed one at a time by the threads as they come free: body(take) runs once per
// thread (so it can keep scratch), and take() returns the next unclaimed item, -1 once none is
// left. For items of uneven cost, heaviest first: the last to finish then starts a light one.
template <typename Body>
void claimed_items(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  auto take = [&]() -> int64_t {
    const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
    return item < n ? item : -1;
  };
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), n));
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
    body(take);
  } else {
    body(take);
  }
}

// The threads a parallel call here would run on (1 inside a parallel region).
inline int available_threads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

}  // namespace xllm_parallel
