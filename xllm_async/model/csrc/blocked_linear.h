// The loop of our blocked linears over packed weights: rows in blocks of 32, columns in blocks of
// 64, a chunk of column blocks kept in a thread's L2 while every row block passes it, and the
// threads sharing out rows or columns. linear.cpp runs its packed weights through it;
// quant_widened.cpp runs GGUF blocks it widens to bfloat16 a chunk at a time.

#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace xllm_blocked {

constexpr int64_t kCols = 64;  // a column block: one packed weight block
constexpr int64_t kRows = 32;  // rows a block product (on AMX: two tiles of 16)
// Packed weights a thread keeps in its L2 while every row block passes them (bytes).
constexpr int64_t kWeightChunk = 1 << 20;

// One thread's share: row blocks [row_first, row_last) x column blocks [col_first, col_last).
struct Share {
  int64_t row_first, row_last, col_first, col_last;
};

// x [m, k] (T: at::BFloat16 or float) times the packed column blocks into out [m, n] (O: its raw
// type). weights(c0, c1): column blocks [c0, c1), k x kCols elements each, one after another (the
// packed weight itself, or a thread's scratch the blocks were made into); product(a, rows, w, out,
// n0, cols): rows [0, rows) of a times one block, into out from column n0 (cols of them real);
// Product::finish() once a thread is done.
template <typename T, typename O, typename Product, typename Weights>
void blocked_linear(const T* a, O* o, int64_t m, int64_t k, int64_t n, int64_t col_blocks, const Product& product,
                    const Weights& weights) {
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t chunk = std::max<int64_t>(1, kWeightChunk / (int64_t(sizeof(T)) * k * kCols));  // kept in L2

  auto run = [&](const Share& s) {
    for (int64_t c0 = s.col_first; c0 < s.col_last; c0 += chunk) {
      const int64_t c1 = std::min(s.col_last, c0 + chunk);
      const T* w = weights(c0, c1);
      for (int64_t rb = s.row_first; rb < s.row_last; ++rb) {
        const int64_t r0 = rb * kRows, rows = std::min(kRows, m - r0);
        for (int64_t cb = c0; cb < c1; ++cb)  // a row's columns of this chunk in one run
          product(a + r0 * k, rows, w + (cb - c0) * k * kCols, o + r0 * n, cb * kCols,
                  std::min(kCols, n - cb * kCols));
      }
    }
    Product::finish();
  };

  // Threads split the rows (each reads all the weights and its own rows) where the rows outnumber
  // the columns, as in a long prefill through a narrow layer; otherwise the columns (each reads
  // all the rows and its share of the weights), as in a decode step: whichever reads less.
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = m > n && row_blocks >= threads;
  const int used = static_cast<int>(std::min<int64_t>(threads, by_rows ? row_blocks : col_blocks));
  auto share = [&](int t, int nt) {
    if (by_rows) return Share{row_blocks * t / nt, row_blocks * (t + 1) / nt, 0, col_blocks};
    return Share{0, row_blocks, col_blocks * t / nt, col_blocks * (t + 1) / nt};
  };
  if (used > 1) {
#pragma omp parallel num_threads(used)
    run(share(omp_get_thread_num(), omp_get_num_threads()));
  } else {
    run(share(0, 1));
  }
}

}  // namespace xllm_blocked
