// The loop of our blocked linears over packed weights: rows in blocks of 32, columns in blocks of
// 64, a chunk of column blocks kept in a thread's L2 while every row block passes it, and the
// threads sharing out its tiles by rows or by columns. linear.cpp runs its packed weights through it;
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

// One thread's share: tiles [first, last) of the (row block, column block) grid, numbered
// row-major where the threads split the rows (tile = row block x col_blocks + column block) and
// column-major where they split the columns (column block x row_blocks + row block). Shares of
// whole tiles rather than of whole rows or columns: SmolLM2's o and down projections have 9 column
// blocks, and a prefill's rows split by columns left one thread 5 and the other 4 (the tile
// between them is done by one, its rows by whichever holds them).
struct Share {
  int64_t first, last;
  bool by_rows;
  int64_t row_blocks, col_blocks;
  int64_t tile(int64_t rb, int64_t cb) const { return by_rows ? rb * col_blocks + cb : cb * row_blocks + rb; }
  bool holds(int64_t rb, int64_t cb) const {
    const int64_t t = tile(rb, cb);
    return first <= t && t < last;
  }
};

// x [m, k] (T: at::BFloat16 or float) times the packed column blocks into out [m, n] (O: its raw
// type). weights(c0, c1): column blocks [c0, c1), k x kCols elements each, one after another (the
// packed weight itself, or a thread's scratch the blocks were made into); product(a, rows, w, out,
// n0, cols): rows [0, rows) of a times one block, into out from column n0 (cols of them real);
// Product::finish() once a thread is done. A tile's sums are the same whichever thread makes it.
template <typename T, typename O, typename Product, typename Weights>
void blocked_linear(const T* a, O* o, int64_t m, int64_t k, int64_t n, int64_t col_blocks, const Product& product,
                    const Weights& weights) {
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t chunk = std::max<int64_t>(1, kWeightChunk / (int64_t(sizeof(T)) * k * kCols));  // kept in L2

  auto run = [&](const Share& s) {
    // The rows and columns its tiles lie in: whole ones, and at most a part of one at each end.
    const int64_t lines = s.by_rows ? col_blocks : row_blocks;
    const int64_t outer_first = s.first / lines, outer_last = s.last > s.first ? (s.last - 1) / lines + 1 : outer_first;
    const int64_t row_first = s.by_rows ? outer_first : 0, row_last = s.by_rows ? outer_last : row_blocks;
    const int64_t col_first = s.by_rows ? 0 : outer_first, col_last = s.by_rows ? col_blocks : outer_last;
    for (int64_t c0 = col_first; c0 < col_last; c0 += chunk) {
      const int64_t c1 = std::min(col_last, c0 + chunk);
      const T* w = weights(c0, c1);
      for (int64_t rb = row_first; rb < row_last; ++rb) {
        const int64_t r0 = rb * kRows, rows = std::min(kRows, m - r0);
        for (int64_t cb = c0; cb < c1; ++cb)  // a row's columns of this chunk in one run
          if (s.holds(rb, cb))
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
  const int64_t tiles = row_blocks * col_blocks;
  const int used = static_cast<int>(std::min<int64_t>(threads, tiles));
  auto share = [&](int t, int nt) { return Share{tiles * t / nt, tiles * (t + 1) / nt, by_rows, row_blocks, col_blocks}; };
  if (used > 1) {
#pragma omp parallel num_threads(used)
    run(share(omp_get_thread_num(), omp_get_num_threads()));
  } else {
    run(share(0, 1));
  }
}

}  // namespace xllm_blocked
