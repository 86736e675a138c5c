// A beam round over the whole vocabulary, one block of its logits at a time (engine/beam.py
// _span_tops): each row's k best logits with their columns, and the row's log-sum-exp, in two
// passes over the block (built with cpu_kernels.cpp into one library).
//
// torch.topk (k = 128 of 16,384 bfloat16 columns) took 30 us a row, and the log-sum-exp's cast,
// max, subtraction, exp and sum five more passes: 215 of a 128-beam request's 470 ms here. Here
// the first pass takes the maximum of every 16 columns; the k-th largest of those maxima is a
// bound that at least k values reach (each of those k groups holds one), so the second pass
// keeps only the values at or above it (AVX512's compress store, a few hundred of 16,384) while
// it sums exp(x - max) for the log-sum-exp, and only those are sorted. xGR's early-terminated
// top-k does the same: most of the vocabulary never reaches a comparison.
//
// Ties rank the lower column first, so a row's answer depends on its logits alone.
//
// Built only where the compiler targets AVX512-BF16 (as the other kernels' vector paths); elsewhere
// the operator is absent and beam.py keeps torch.topk and torch.logsumexp.

#if defined(__AVX512BF16__)

#include <ATen/ATen.h>
#include <torch/library.h>

#include "avx512_bf16.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using bf16 = uint16_t;

struct Candidate {
  float value;
  int32_t column;
};

inline bool better(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.column < b.column);
}

// One row of n logits: its k best (value, column) into values/columns, best first, and its
// log-sum-exp. maxima and kept are the caller's scratch.
void row_topk(const bf16* x, int64_t n, int64_t k, float* values, int64_t* columns, float* lse,
              std::vector<float>& maxima, std::vector<Candidate>& kept) {
  namespace simd = xllm_simd;
  const int64_t groups = (n + 15) / 16;
  maxima.resize(groups);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 peak = lowest;
  for (int64_t g = 0; g < groups; ++g) {
    const __mmask16 live = simd::lanes(n - g * 16);
    __m512 v = _mm512_mask_mov_ps(lowest, live, simd::load_bf16(x + g * 16, live));
    maxima[g] = _mm512_reduce_max_ps(v);
    peak = _mm512_max_ps(peak, v);
  }
  const float row_max = _mm512_reduce_max_ps(peak);
  // The k-th largest group maximum: k groups reach it, so at least k values do (with fewer
  // groups than k, every value is kept).
  float lowest_kept = -std::numeric_limits<float>::infinity();
  if (k <= groups) {
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
    lowest_kept = maxima[k - 1];
  }
  const __m512 bound = _mm512_set1_ps(lowest_kept);
  const __m512 shift = _mm512_set1_ps(row_max);
  __m512 total = _mm512_setzero_ps();
  kept.clear();
  alignas(64) float found[16];
  alignas(64) int32_t where[16];
  const __m512i lane_index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    const __mmask16 live = simd::lanes(n - g * 16);
    __m512 v = simd::load_bf16(x + g * 16, live);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, simd::exp(_mm512_sub_ps(v, shift))));
    const __mmask16 high = _mm512_mask_cmp_ps_mask(live, v, bound, _CMP_GE_OQ);
    if (high) {
      const int count = __builtin_popcount(high);
      _mm512_mask_compressstoreu_ps(found, high, v);
      _mm512_mask_compressstoreu_epi32(where, high, _mm512_add_epi32(lane_index, _mm512_set1_epi32(g * 16)));
      for (int i = 0; i < count; ++i) kept.push_back({found[i], where[i]});
    }
  }
  *lse = row_max + std::log(_mm512_reduce_add_ps(total));
  const int64_t out = std::min<int64_t>(k, static_cast<int64_t>(kept.size()));
  std::partial_sort(kept.begin(), kept.begin() + out, kept.end(), better);
  for (int64_t i = 0; i < out; ++i) {
    values[i] = kept[i].value;
    columns[i] = kept[i].column;
  }
}

// logits [rows, n] bfloat16 (contiguous columns, any row stride), k <= n ->
// (values [rows, k] float32 best first, columns [rows, k] int64, log-sum-exp [rows] float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_logsumexp(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kBFloat16 && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "logits must be a bfloat16 CPU [rows, columns] tensor with contiguous columns");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k > 0 && k <= n && n < (int64_t{1} << 31), "k must be in [1, columns]");
  auto values = at::empty({rows, k}, logits.options().dtype(at::kFloat));
  auto columns = at::empty({rows, k}, logits.options().dtype(at::kLong));
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  const bf16* x = reinterpret_cast<const bf16*>(logits.data_ptr());
  const int64_t stride = logits.stride(0);
  float* v = values.data_ptr<float>();
  int64_t* c = columns.data_ptr<int64_t>();
  float* l = lse.data_ptr<float>();
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    std::vector<float> maxima;
    std::vector<Candidate> kept;
    for (int64_t r = begin; r < end; r += step) row_topk(x + r * stride, n, k, v + r * k, c + r * k, l + r, maxima, kept);
  };
  xllm_parallel::interleaved_items(rows, run);
  return {values, columns, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("topk_logsumexp(Tensor logits, int k) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("topk_logsumexp", &topk_logsumexp); }

#endif  // __AVX512BF16__
