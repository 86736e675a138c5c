// The LM head fused with a top-k pick: linear_topk(x, packed, n, width) is each row's `width` largest
// logits of linear(x, packed, None, n), values (float32) and columns, without the [rows, n] logits
// written and read back; and each row's first NaN column (-1: none). A decode step whose rows all
// sample from their top k (execution/top_sampling.py) needs only that, plus some room for the
// values that tie with the k-th once divided by the temperature.
//
// Exact as head_pick.cpp's greedy pick is: each 64-column block's sums come from the linear's own
// loop (linear_rows.h), rounded as the linear rounds them, so the values are the very logits the
// linear writes. Order: value descending, then column ascending (torch.sort's stable order); a NaN
// never enters the list (the row's first NaN column is reported apart: greedy's pick, and the
// sampler takes such a row's logits). A list holds fewer than `width` only where the row has fewer
// non-NaN columns (the rest: value -inf, column -1).
//
// Threads split the column blocks as the greedy pick does. Each keeps, per row, its own candidates
// (Lists: its width largest so far, and up to as many again above their floor); then one merge per
// row of the threads' candidates, by value and then column: the same lists for any thread count. bfloat16 only where the linear runs our vdpbf16ps loop (as
// linear_argmax: not on AMX); float32 everywhere the library runs.

#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512BF16__)
#include "avx512_bf16.h"
#include "blocked_linear.h"
#include "head_rows.h"
#include "linear_rows.h"

namespace {

using xllm_blocked::kCols;
using xllm_blocked::kRows;
using xllm_linear_rows::kVectors;
constexpr int64_t kNoNan = std::numeric_limits<int64_t>::max();

struct Entry {
  float value;
  int32_t column;
};

// Rank: value descending, then column ascending (values here are never NaN).
inline bool ranks(const Entry& p, const Entry& q) {
  return p.value > q.value || (p.value == q.value && p.column < q.column);
}

// One thread's candidates per row: up to 2 x width entries unsorted, each row's count, and its floor
// (the width-th largest at the last cut; `floored` 0 until the first). A column enters only above
// the floor (met in increasing order, an equal value ranks after those kept); a full row is cut
// back to its width largest (nth_element), so an entry costs O(1) amortized, not a sorted insert.
struct Lists {
  Entry* entries;
  int32_t* count;
  float* floor;
  uint8_t* floored;
  int64_t* nan;  // each row's first NaN column (kNoNan: none)
  int64_t width;

  Lists rows_from(int64_t r) const {
    return Lists{entries + r * 2 * width, count + r, floor + r, floored + r, nan + r, width};
  }

  void offer(int64_t r, float x, int32_t col) const {
    if (floored[r] && !(x > floor[r])) return;
    Entry* e = entries + r * 2 * width;
    e[count[r]++] = Entry{x, col};
    if (count[r] == 2 * width) {
      std::nth_element(e, e + width - 1, e + 2 * width, ranks);
      count[r] = int32_t(width);
      floor[r] = e[width - 1].value;
      floored[r] = 1;
    }
  }
};

// Rows [0, R) of a block's sums (rounded as the linear stores them) into their lists: a vector's
// lanes go one by one only where one is above its row's floor (rare once it has one).
template <int R>
void keep(const __m512 (&sums)[R][kVectors], int64_t n0, int64_t cols, const Lists& lists) {
  alignas(64) float lane[16];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors && v * 16 < cols; ++v) {
      const __mmask16 live = xllm_simd::lanes(cols - v * 16);
      const __m512 x = sums[r][v];
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(live, x, x, _CMP_UNORD_Q);
      if (nan) lists.nan[r] = std::min<int64_t>(lists.nan[r], n0 + v * 16 + __builtin_ctz(nan));
      __mmask16 more = live & ~nan;
      if (lists.floored[r]) more = _mm512_mask_cmp_ps_mask(more, x, _mm512_set1_ps(lists.floor[r]), _CMP_GT_OQ);
      if (!more) continue;
      _mm512_store_ps(lane, x);
      for (unsigned m = more; m; m &= m - 1) {
        const int l = __builtin_ctz(m);
        lists.offer(r, lane[l], int32_t(n0 + v * 16 + l));
      }
    }
  }
}

// Each thread's share of the column blocks (the greedy pick's split), a chunk at a time kept in L2
// while every row block passes it; then the threads' lists merged per row.
template <typename Top>
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_all(const char* a, int64_t elem, int64_t m, int64_t k, int64_t n,
                                                       const char* w, int64_t col_blocks, int64_t width,
                                                       const Top& top) {
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t block_bytes = elem * k * kCols;
  const int64_t chunk = std::max<int64_t>(1, xllm_blocked::kWeightChunk / block_bytes);
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, col_blocks)));
  std::vector<Entry> entries(size_t(used * m * 2 * width));
  std::vector<int32_t> counts(size_t(used * m), 0);
  std::vector<float> floors(size_t(used * m), 0.f);
  std::vector<uint8_t> floored(size_t(used * m), 0);
  std::vector<int64_t> nans(size_t(used * m), kNoNan);

  auto run = [&](int t, int nt) {
    const Lists lists{entries.data() + t * m * 2 * width, counts.data() + t * m, floors.data() + t * m,
                      floored.data() + t * m, nans.data() + t * m, width};
    const int64_t first = col_blocks * t / nt, last = col_blocks * (t + 1) / nt;
    for (int64_t c0 = first; c0 < last; c0 += chunk) {
      const int64_t c1 = std::min(last, c0 + chunk);
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const int64_t r0 = rb * kRows, rows = std::min(kRows, m - r0);
        for (int64_t cb = c0; cb < c1; ++cb)
          top(a + r0 * k * elem, rows, w + cb * block_bytes, lists.rows_from(r0), cb * kCols,
              std::min(kCols, n - cb * kCols));
      }
    }
  };
  if (used > 1) {
#pragma omp parallel num_threads(used)
    run(omp_get_thread_num(), omp_get_num_threads());
  } else {
    run(0, 1);
  }

  auto out_values = at::full({m, width}, -std::numeric_limits<float>::infinity(), at::kFloat);
  auto out_indices = at::full({m, width}, -1, at::kLong);
  auto out_nan = at::empty({m}, at::kLong);
  float* ov = out_values.data_ptr<float>();
  int64_t* oi = out_indices.data_ptr<int64_t>();
  int64_t* on = out_nan.data_ptr<int64_t>();
  std::vector<Entry> all;
  for (int64_t r = 0; r < m; ++r) {
    all.clear();
    int64_t nan = kNoNan;
    for (int t = 0; t < used; ++t) {
      nan = std::min(nan, nans[t * m + r]);
      const Entry* e = entries.data() + (t * m + r) * 2 * width;
      all.insert(all.end(), e, e + counts[t * m + r]);
    }
    const size_t kept = std::min<size_t>(all.size(), size_t(width));
    std::partial_sort(all.begin(), all.begin() + kept, all.end(), ranks);
    for (size_t i = 0; i < kept; ++i) ov[r * width + i] = all[i].value, oi[r * width + i] = all[i].column;
    on[r] = nan == kNoNan ? -1 : nan;
  }
  return {out_values, out_indices, out_nan};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_topk(const at::Tensor& input, const at::Tensor& packed,
                                                           int64_t n, int64_t width) {
  const bool f32 = input.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || input.scalar_type() == at::kBFloat16) && input.dim() == 2,
              "linear_topk: 2-d bfloat16 or float32 rows");
  TORCH_CHECK(packed.scalar_type() == input.scalar_type(), "linear_topk: the weight was packed for another dtype");
  auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t col_blocks = packed.size(0);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == k * kCols && col_blocks * kCols >= n && n > 0,
              "linear_topk: weight packed for another shape");
  TORCH_CHECK(width >= 1 && width <= n && width <= 4096, "linear_topk: width 1..min(n, 4096)");
  const auto* a = static_cast<const char*>(x.data_ptr());
  const auto* w = static_cast<const char*>(packed.data_ptr());
  if (f32) return top_all(a, 4, m, k, n, w, col_blocks, width, xllm_head_rows::F32<Lists>{k});
#if defined(__AMX_BF16__)
  TORCH_CHECK(false, "linear_topk: bfloat16 rows only where the linear runs AVX512-BF16 (not AMX's brgemm)");
  return {};
#else
  return top_all(a, 2, m, k, n, w, col_blocks, width, xllm_head_rows::Bf16<Lists>{k});
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("linear_topk(Tensor x, Tensor packed, int n, int width) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("linear_topk", &linear_topk);
}

#endif
