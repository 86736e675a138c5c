// A beam round over the whole vocabulary, one block of its logits at a time (engine/beam.py
// _span_tops): each row's k best logits with their columns, and the row's log-sum-exp, in two
// passes over the block (built with cpu_kernels.cpp into one library).
//
// torch.topk (k = 128 of 16,384 bfloat16 columns) took 30 us a row, and the log-sum-exp's cast,
// max, subtraction, exp and sum five more passes: 215 of a 128-beam request's 470 ms here. Here
// the first pass splits the row into sets of 16 values (lane j of 16 consecutive vectors: a
// vertical max, no horizontal reduction) and takes each set's maximum; any value that at least k
// set maxima reach is a bound that at least k values reach, so the second pass keeps only the
// values at or above it (AVX512's compress store, a hundred or two of 16,384) while it sums
// exp(x - max) for the log-sum-exp, and only those are ranked. xGR's early-terminated top-k does
// the same: most of the vocabulary never reaches a comparison.
//
// The bound is found by bisecting between the lowest and highest set maximum with vector counts,
// and the kept values are ranked by counting, eight integer keys at a time: std::nth_element over
// the 1,024 maxima and a sort of the kept values spent 3.7 of the 4.8 cycles a value with their
// mispredicted branches (AMD EPYC); now 1.5 in all, the same answers.
//
// Ties rank the lower column first, so a row's answer depends on its logits alone. NaN ranks above
// every number, as torch.topk has it (beam.py's fallback), and a row holding one has a NaN
// log-sum-exp, as torch.logsumexp gives: a broken forward's scores show as NaN, never as
// columns read from memory no one wrote.
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
#include <cstring>
#include <limits>
#include <vector>

namespace {

using bf16 = uint16_t;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Candidate {
  float value;
  int32_t column;
};

// A row's scratch, kept across its thread's rows.
struct Scratch {
  std::vector<float> maxima;
  std::vector<Candidate> kept;
  std::vector<uint64_t> keys;
};

// How many of the maxima (count: a multiple of 16, 64-byte aligned) are at least t.
inline int64_t reaching(const float* maxima, int64_t count, float t) {
  const __m512 bound = _mm512_set1_ps(t);
  int64_t reached = 0;
  for (int64_t i = 0; i < count; i += 16)
    reached += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_load_ps(maxima + i), bound, _CMP_GE_OQ));
  return reached;
}

// A candidate as one integer in the order wanted, smallest first: the higher value, then the
// lower column (-0 equal to 0, as float comparison has it; every NaN above +inf, whatever its sign
// and payload). Distinct, since columns are.
inline uint64_t rank_key(const Candidate& c) {
  uint32_t bits;
  std::memcpy(&bits, &c.value, sizeof bits);
  if (bits == 0x80000000u) bits = 0;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t ascending = nan ? ~uint32_t{0} : (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(~ascending) << 32) | static_cast<uint32_t>(c.column);
}

// The value that at least k of the set maxima reach, as high as a few bisection steps find (not
// the exact k-th largest: a little below it keeps a few more values, never fewer than needed).
// With fewer sets than k (or fewer than k finite), every value is kept. Never NaN: a NaN maximum
// reaches no bound, and a NaN midpoint is never taken.
float bound_of(const float* maxima, int64_t sets, int64_t k, float lowest_finite, float highest) {
  if (k > sets) return -kInf;
  if (reaching(maxima, sets, highest) >= k) return highest;
  float lo = lowest_finite, hi = highest;
  if (reaching(maxima, sets, lo) < k) return -kInf;
  for (int step = 0; step < 12; ++step) {
    const float mid = 0.5f * (lo + hi);
    (reaching(maxima, sets, mid) >= k ? lo : hi) = mid;
  }
  return lo;
}

// The kept candidates' best `out` into values/columns, best first. A candidate's place is how many
// keys are below its own, counted eight at a time; a row of equal values (thousands kept) sorts.
void rank_kept(Scratch& s, int64_t out, float* values, int64_t* columns) {
  const int64_t m = static_cast<int64_t>(s.kept.size());
  const int64_t padded = (m + 7) / 8 * 8;
  s.keys.resize(padded);
  for (int64_t i = 0; i < m; ++i) s.keys[i] = rank_key(s.kept[i]);
  std::fill(s.keys.begin() + m, s.keys.end(), ~uint64_t{0});
  if (m > 1024) {
    std::vector<int64_t> order(m);
    for (int64_t i = 0; i < m; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + out, order.end(),
                      [&](int64_t a, int64_t b) { return s.keys[a] < s.keys[b]; });
    for (int64_t i = 0; i < out; ++i) {
      values[i] = s.kept[order[i]].value;
      columns[i] = s.kept[order[i]].column;
    }
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    const __m512i own = _mm512_set1_epi64(static_cast<long long>(s.keys[i]));
    int place = 0;
    for (int64_t j = 0; j < padded; j += 8)
      place += __builtin_popcount(_mm512_cmplt_epu64_mask(_mm512_loadu_si512(s.keys.data() + j), own));
    if (place < out) {
      values[place] = s.kept[i].value;
      columns[place] = s.kept[i].column;
    }
  }
}

// Slots [ranked, k) that no kept value filled: -inf and the lowest columns not already given, so
// every slot holds a column of the row. The bound keeps at least k values (k set maxima reach it,
// or it is -inf and keeps every one), so this is a guard, not a path a row takes.
void fill_unranked(int64_t n, int64_t ranked, int64_t k, float* values, int64_t* columns) {
  std::vector<bool> given(n, false);
  for (int64_t i = 0; i < ranked; ++i) given[columns[i]] = true;
  for (int64_t c = 0, i = ranked; i < k && c < n; ++c) {
    if (given[c]) continue;
    values[i] = -kInf;
    columns[i++] = c;
  }
}

// One row of n logits: its k best (value, column) into values/columns, best first, and its
// log-sum-exp.
void row_topk(const bf16* x, int64_t n, int64_t k, float* values, int64_t* columns, float* lse, Scratch& s) {
  namespace simd = xllm_simd;
  const __m512 lowest = _mm512_set1_ps(-kInf);
  const int64_t vectors = (n + 15) / 16;
  const int64_t sets = (vectors + 15) / 16 * 16;  // a multiple of 16: a tail's sets hold -inf
  s.maxima.resize(sets + 16);
  float* maxima = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.maxima.data()) + 63) & ~uintptr_t{63});
  __m512 peak = lowest, least = _mm512_set1_ps(kInf);
  for (int64_t c = 0; c < vectors; c += 16) {
    __m512 top = lowest;
    for (int64_t g = c, end = std::min(vectors, c + 16); g < end; ++g) {
      const __mmask16 live = simd::lanes(n - g * 16);
      top = _mm512_max_ps(top, _mm512_mask_mov_ps(lowest, live, simd::load_bf16(x + g * 16, live)));
    }
    _mm512_store_ps(maxima + c, top);
    peak = _mm512_max_ps(peak, top);
    least = _mm512_mask_min_ps(least, _mm512_cmp_ps_mask(top, lowest, _CMP_NEQ_OQ), least, top);
  }
  const float row_max = _mm512_reduce_max_ps(peak);
  const __m512 bound = _mm512_set1_ps(bound_of(maxima, sets, k, _mm512_reduce_min_ps(least), row_max));
  const __m512 shift = _mm512_set1_ps(row_max);
  __m512 total = _mm512_setzero_ps();
  s.kept.clear();
  alignas(64) float found[16];
  alignas(64) int32_t where[16];
  const __m512i lane_index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t g = 0; g < vectors; ++g) {
    const __mmask16 live = simd::lanes(n - g * 16);
    __m512 v = simd::load_bf16(x + g * 16, live);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, simd::exp(_mm512_sub_ps(v, shift))));
    // At or above the bound, or NaN (not-less-than, unordered: true for NaN; the bound is never NaN).
    const __mmask16 high = _mm512_mask_cmp_ps_mask(live, v, bound, _CMP_NLT_UQ);
    if (high) {
      const int count = __builtin_popcount(high);
      _mm512_mask_compressstoreu_ps(found, high, v);
      _mm512_mask_compressstoreu_epi32(where, high, _mm512_add_epi32(lane_index, _mm512_set1_epi32(g * 16)));
      for (int i = 0; i < count; ++i) s.kept.push_back({found[i], where[i]});
    }
  }
  const int64_t ranked = std::min<int64_t>(k, static_cast<int64_t>(s.kept.size()));
  rank_kept(s, ranked, values, columns);
  // (exp clamps its argument from below with a max that drops NaN: a NaN is found in the ranking.)
  const bool has_nan = ranked > 0 && std::isnan(values[0]);
  *lse = has_nan ? std::numeric_limits<float>::quiet_NaN() : row_max + std::log(_mm512_reduce_add_ps(total));
  if (ranked < k) fill_unranked(n, ranked, k, values, columns);
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
    Scratch scratch;
    for (int64_t r = begin; r < end; r += step) row_topk(x + r * stride, n, k, v + r * k, c + r * k, l + r, scratch);
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
