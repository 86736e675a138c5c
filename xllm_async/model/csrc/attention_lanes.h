// A block of up to 32 query rows on 16 float32 lanes (the packed attention kernels' path for
// float32 on every CPU, and for bfloat16 where there is no AMX): scores, the softmax
// (attention_softmax.h), then the sums of values, each loaded vector serving 8 rows.
// Include only under #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_packing.h"
#include "attention_softmax.h"
#include "avx512_bf16.h"

namespace xllm_attention {

// A block's products on 16 float32 lanes, for what AMX does not take: bfloat16 on CPUs with
// AVX512-BF16 but no AMX (AMD EPYC Zen 4/5 here; there torch's fused kernel has no tiles either
// and was half of a bfloat16 prefill: 16 x 320 tokens of the 4-layer model, 12.6 ms a layer,
// perf/RESULTS.md, fourteenth session), and float32 everywhere.
// A step adds, in each lane, a row's value times the lane's: bfloat16 pairs by one dot product
// (two products a lane: 2 dims, or 2 keys' probabilities, against 16 keys' or 16 dims' pairs
// packed side by side), float32 by an FMA. kPair: the products a step adds to a lane.
template <typename T>
struct Lanes;

template <>
struct Lanes<bf16> {
  static constexpr int kPair = 2;
  using Vector = __m512bh;
  static Vector load(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vector broadcast(const bf16* p) { return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void store(bf16* p, __m512 x, __mmask16 live) { xllm_simd::store_bf16(p, x, live); }
};

template <>
struct Lanes<float> {
  static constexpr int kPair = 1;
  using Vector = __m512;
  static Vector load(const float* p) { return _mm512_loadu_ps(p); }
  static Vector broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_fmadd_ps(a, b, acc); }
  static void store(float* p, __m512 x, __mmask16 live) { _mm512_mask_storeu_ps(p, live, x); }
};

// Scores of query rows [0, R) against keys [k0, k0 + 16 N): R x N accumulators, so that each
// loaded vector of keys serves R rows and each broadcast query step N vectors of keys.
template <typename T, int R, int N>
inline void scores_lanes(const T* qs, const T* kp, int64_t wide, int64_t k0, float* scores, int64_t width) {
  using L = Lanes<T>;
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  const T* keys = kp + k0 * wide;  // block k0 / 16 of the packed keys
  for (int64_t p = 0; p < wide / L::kPair; ++p) {
    typename L::Vector kv[N];
    for (int n = 0; n < N; ++n) kv[n] = L::load(keys + n * kKeys * wide + p * L::kPair * kKeys);
    for (int r = 0; r < R; ++r) {
      const typename L::Vector qv = L::broadcast(qs + r * wide + L::kPair * p);
      for (int n = 0; n < N; ++n) acc[r][n] = L::add(acc[r][n], qv, kv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(scores + r * width + k0 + n * kKeys, acc[r][n]);
}

// Outputs of rows [r0, r0 + R) at dims [d0, d0 + 16 N) over their first `keys` keys (a multiple
// of kPair), times each row's 1 / total.
template <typename T, int R, int N>
inline void values_lanes(const Block<T>& b, int r0, const T* probs, const T* vp, int64_t wide, int64_t d0,
                         int64_t width, int64_t keys, int64_t dim, const float* inverse) {
  using L = Lanes<T>;
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; j += L::kPair) {
    const T* at = vp + j * wide + d0 * L::kPair;  // key step j / kPair of the packed values
    typename L::Vector vv[N];
    for (int n = 0; n < N; ++n) vv[n] = L::load(at + n * L::kPair * kKeys);
    for (int r = 0; r < R; ++r) {
      const typename L::Vector pv = L::broadcast(probs + (r0 + r) * width + j);
      for (int n = 0; n < N; ++n) acc[r][n] = L::add(acc[r][n], pv, vv[n]);
    }
  }
  for (int r = 0; r < R && r0 + r < b.rows; ++r) {
    const __m512 scale = _mm512_set1_ps(inverse[r0 + r]);
    for (int n = 0; n < N; ++n) {
      const int64_t d = d0 + n * kKeys;
      if (d < dim) L::store(b.out[r0 + r] + d, _mm512_mul_ps(acc[r][n], scale), xllm_simd::lanes(dim - d));
    }
  }
}

// The keys rows [r0, r0 + count) see, the most of them (a causal block's first rows see fewer
// than its last: each group of rows stops at its own).
template <typename T>
inline int64_t reach(const Block<T>& b, int r0, int count) {
  return *std::max_element(b.seen + r0, b.seen + r0 + count);
}

// A block of up to 32 query rows on lanes, 8 rows at a time: scores against 32 keys a step, the
// softmax, then outputs 32 dims a step (16 for the last of a float32 head whose width is an odd
// multiple of 16). Groups of 8 rows: each vector of keys (or values) loaded serves 8 rows. In
// float32, groups of 4 against 64 keys took a 16 x 320-token prefill with heads of 128 47-55 ms
// here, groups of 8 39-41 (2 threads); bfloat16 got the same sums, 1.02-1.17x sooner.
// Rows past b.rows repeat the last one (attend_rows), so whole groups are always real queries.
template <typename T>
void block_lanes(const Packed<T>& a, Scratch<T>& s, const Block<T>& b) {
  constexpr int kRows = 8, kPair = Lanes<T>::kPair;
  const int64_t wide = a.wide;
  const int64_t width = (b.span + kKeys - 1) / kKeys * kKeys;  // whole vectors of scores
  const T* qs = s.queries.data();
  const T* kp = s.keys.data();
  const T* vp = s.values.data();
  float* scores = s.scores.data();
  T* probs = s.probs.data();
  const int rows = (b.rows + kRows - 1) / kRows * kRows;
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t span = (reach(b, r0, kRows) + kKeys - 1) / kKeys * kKeys;
    int64_t k0 = 0;
    for (; k0 + 2 * kKeys <= span; k0 += 2 * kKeys)
      scores_lanes<T, kRows, 2>(qs + r0 * wide, kp, wide, k0, scores + r0 * width, width);
    if (k0 < span) scores_lanes<T, kRows, 1>(qs + r0 * wide, kp, wide, k0, scores + r0 * width, width);
  }
  float inverse[kBlockRows];
  softmax_rows(b, b.rows, scores, probs, width, a.scale, inverse);
  // Probability rows past b.rows are read by the last group: give them the last real row's, so
  // that no stale scratch (perhaps NaN) is multiplied.
  for (int r = b.rows; r < rows; ++r) std::memcpy(probs + r * width, probs + (b.rows - 1) * width, width * sizeof(T));
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t keys = (reach(b, r0, kRows) + kPair - 1) / kPair * kPair;  // (zeros past what a row sees)
    int64_t d0 = 0;
    for (; d0 + 2 * kKeys <= wide; d0 += 2 * kKeys)
      values_lanes<T, kRows, 2>(b, r0, probs, vp, wide, d0, width, keys, a.dim, inverse);
    if (d0 < wide) values_lanes<T, kRows, 1>(b, r0, probs, vp, wide, d0, width, keys, a.dim, inverse);
  }
}

}  // namespace xllm_attention
