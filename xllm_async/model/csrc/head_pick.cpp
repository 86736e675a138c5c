// The LM head fused with a greedy pick: linear_argmax(x, packed, n) is argmax over the columns of
// linear(x, packed, None, n), each row's index of its largest logit, without the [rows, n] logits
// written and read back (SmolLM2's 49,152 columns: 96 KB a row in bfloat16, and the float32 copy
// and numpy's pass after it). A decode step whose rows are all greedy needs only that.
//
// Exact: each 64-column block's sums come from the linear's own loop (linear_rows.h) and are
// rounded as the linear rounds them (bfloat16: once, to nearest even; float32: not at all), so
// the pick is the argmax of the very logits the linear writes, numpy's way: the first index on
// ties, and a NaN (the first one) above everything.
//
// Threads split the column blocks as blocked_linear.h does for a decode step. Each keeps, per
// row, a best per vector lane (lane j: columns j mod 16, met in increasing order, so a strict
// "greater" keeps the first of equals) and the first NaN it met; after the threads, one scalar
// merge per row takes the largest value, then the lowest index: the same answer for any thread
// count.
//
// bfloat16 only where the linear runs our vdpbf16ps loop (AVX512-BF16 without AMX): on AMX it runs
// torch's brgemm, whose sums may round differently, so the operator refuses bfloat16 there and
// model/cpu_kernels.py leaves those models on the logits path. float32 runs everywhere the
// library does (the float32 linear is the same FMA loop on every CPU).

#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
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
constexpr int kLanes = 16;
constexpr int64_t kNoNan = std::numeric_limits<int64_t>::max();

// One thread's running bests: value and index [rows][16] (index -1: nothing met in that lane yet),
// and each row's first NaN column (kNoNan: none).
struct Best {
  float* value;
  int32_t* index;
  int64_t* nan;

  Best rows_from(int64_t r) const { return Best{value + r * kLanes, index + r * kLanes, nan + r}; }
};

// Rows [0, R) of a block's sums (already rounded as the linear stores them) into their bests.
template <int R>
inline void keep(const __m512 (&sums)[R][kVectors], int64_t n0, int64_t cols, const Best& best) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < R; ++r) {
    __m512 value = _mm512_loadu_ps(best.value + r * kLanes);
    __m512i index = _mm512_loadu_si512(best.index + r * kLanes);
    for (int v = 0; v < kVectors && v * 16 < cols; ++v) {
      const __mmask16 live = xllm_simd::lanes(cols - v * 16);
      const __m512 x = sums[r][v];
      const __mmask16 unset = _mm512_mask_cmplt_epi32_mask(live, index, _mm512_setzero_si512());
      const __mmask16 more = _mm512_mask_cmp_ps_mask(live, x, value, _CMP_GT_OQ) | unset;
      value = _mm512_mask_mov_ps(value, more, x);
      index = _mm512_mask_mov_epi32(index, more, _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(n0 + v * 16))));
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(live, x, x, _CMP_UNORD_Q);
      if (nan) best.nan[r] = std::min<int64_t>(best.nan[r], n0 + v * 16 + __builtin_ctz(nan));
    }
    _mm512_storeu_ps(best.value + r * kLanes, value);
    _mm512_storeu_si512(best.index + r * kLanes, index);
  }
}

// Each thread's share of the column blocks (blocked_linear.h's split for a decode step), a chunk
// at a time kept in L2 while every row block passes it; then the threads' bests merged per row.
template <typename Pick>
at::Tensor pick_all(const char* a, int64_t elem, int64_t m, int64_t k, int64_t n, const char* w, int64_t col_blocks,
                    const Pick& pick) {
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t block_bytes = elem * k * kCols;
  const int64_t chunk = std::max<int64_t>(1, xllm_blocked::kWeightChunk / block_bytes);
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, col_blocks)));
  std::vector<float> values(size_t(used * m * kLanes), 0.f);
  std::vector<int32_t> indices(size_t(used * m * kLanes), -1);
  std::vector<int64_t> nans(size_t(used * m), kNoNan);

  auto run = [&](int t, int nt) {
    const Best best{values.data() + t * m * kLanes, indices.data() + t * m * kLanes, nans.data() + t * m};
    const int64_t first = col_blocks * t / nt, last = col_blocks * (t + 1) / nt;
    for (int64_t c0 = first; c0 < last; c0 += chunk) {
      const int64_t c1 = std::min(last, c0 + chunk);
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const int64_t r0 = rb * kRows, rows = std::min(kRows, m - r0);
        for (int64_t cb = c0; cb < c1; ++cb)
          pick(a + r0 * k * elem, rows, w + cb * block_bytes, best.rows_from(r0), cb * kCols,
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

  auto out = at::empty({m}, at::kLong);
  auto* picked = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    int64_t nan = kNoNan, index = -1;
    float value = 0.f;
    for (int t = 0; t < used; ++t) {
      nan = std::min(nan, nans[t * m + r]);
      for (int l = 0; l < kLanes; ++l) {
        const size_t at = size_t((t * m + r) * kLanes + l);
        const int64_t i = indices[at];
        if (i < 0) continue;
        if (index < 0 || values[at] > value || (values[at] == value && i < index)) value = values[at], index = i;
      }
    }
    picked[r] = nan != kNoNan ? nan : std::max<int64_t>(index, 0);
  }
  return out;
}

at::Tensor linear_argmax(const at::Tensor& input, const at::Tensor& packed, int64_t n) {
  const bool f32 = input.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || input.scalar_type() == at::kBFloat16) && input.dim() == 2,
              "linear_argmax: 2-d bfloat16 or float32 rows");
  TORCH_CHECK(packed.scalar_type() == input.scalar_type(), "linear_argmax: the weight was packed for another dtype");
  auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t col_blocks = packed.size(0);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == k * kCols && col_blocks * kCols >= n && n > 0,
              "linear_argmax: weight packed for another shape");
  const auto* a = static_cast<const char*>(x.data_ptr());
  const auto* w = static_cast<const char*>(packed.data_ptr());
  if (m == 0) return at::empty({0}, at::kLong);
  if (f32) return pick_all(a, 4, m, k, n, w, col_blocks, xllm_head_rows::F32<Best>{k});
#if defined(__AMX_BF16__)
  TORCH_CHECK(false, "linear_argmax: bfloat16 rows only where the linear runs AVX512-BF16 (not AMX's brgemm)");
  return at::Tensor();
#else
  return pick_all(a, 2, m, k, n, w, col_blocks, xllm_head_rows::Bf16<Best>{k});
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("linear_argmax(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("linear_argmax", &linear_argmax);
}

#endif
