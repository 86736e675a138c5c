// One work item of the decode attention (decode_attention.cpp): one row's query heads that share
// a key head against a span of that row's keys, at most kChunk of them. It leaves either the
// finished output (a row that fits one span) or a partial in float32 (its spans' largest score,
// sum of exponentials and unnormalised weighted values) that decode_attention.cpp merges.
// Include only under #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "avx512_bf16.h"

namespace xllm_decode {

using bf16 = uint16_t;

constexpr int kMaxGroup = 8;    // query heads a key head may serve here
constexpr int kMaxWidth = 256;  // head width
// Keys a work item reads at most. A constant, never derived from the batch or the threads: where
// a row's keys are cut decides its summation order, so a row's answer stays the same bits
// whatever rows share its call and however many threads run it. 512, by measurement on the EPYC
// (perf/experiments/decode_attention_bench.py, 2 threads): a span costs its own start (each
// span's keys and values are streams the prefetcher picks up anew), so 128-key spans read 1.2-1.3x
// slower than 256 from a cold cache, and 256 ~0.8-0.9x slower than 512 at 8 rows of 512-1024
// keys, where the items are already many; at one row splitting only evened the threads out.
constexpr int64_t kChunk = 512;

// What a dot-product step is in each element type (T: bf16 or float): a vector of 32 bfloat16
// values (16 pairs) or of 16 floats, and the products it adds into 16 float32 lanes.
template <typename T>
struct Dot;

template <>
struct Dot<bf16> {
  using Vector = __m512bh;
  static constexpr int64_t kStep = 32;
  static Vector load(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  // The first 16 values, the rest zero (a head 16 wider than a multiple of 32: its products add 0).
  static Vector load_half(const bf16* p) { return (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, p); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void store(bf16* p, __m512 x) { xllm_simd::store_bf16(p, x, 0xFFFF); }
  // 32 values of a key, widened exactly: the even ones (a shift) and the odd ones (a mask), two
  // instructions for 32 where widening in order takes a shuffle and a shift for 16; `restore`
  // puts the lanes back in order once, at the end.
  static void widen(const bf16* p, __m512& even, __m512& odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // 16 values widened in order (the last 16 of a head 16 wider than a multiple of 32).
  static __m512 widen16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
  }
  static void restore(__m512& even, __m512& odd) {
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512 a = _mm512_permutex2var_ps(even, low, odd), b = _mm512_permutex2var_ps(even, high, odd);
    even = a;
    odd = b;
  }
};

template <>
struct Dot<float> {
  using Vector = __m512;
  static constexpr int64_t kStep = 16;
  static Vector load(const float* p) { return _mm512_loadu_ps(p); }
  static Vector load_half(const float* p) { return _mm512_loadu_ps(p); }  // (never called: kStep is 16)
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_fmadd_ps(a, b, acc); }
  static void store(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
  static void widen(const float* p, __m512& first, __m512& second) {
    first = _mm512_loadu_ps(p);
    second = _mm512_loadu_ps(p + 16);
  }
  static __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
  static void restore(__m512&, __m512&) {}
};

template <typename T>
struct Step {
  const T* q;
  const T* keys;
  const T* values;
  T* out;
  const int64_t* lengths;
  int64_t q_row, q_head;  // q strides (row, head)
  int64_t k_row, k_head;  // keys/values strides (row, key head); tokens are dim apart
  int64_t v_row, v_head;
  int64_t heads, kv_heads, dim;
  float scale;
  // Rows that share a prompt's prefix (SlabCache.sharing): row r's keys [0, shared[r]) are the same
  // as row source[r]'s, which it reads instead, so that a prefix shared by several rows is read
  // from memory once a layer rather than once a row. Only whole spans under shared[r] are read
  // there, so a row's sums are the same bits either way. nullptr: every row reads its own.
  const int64_t* source = nullptr;
  const int64_t* shared = nullptr;
};

// v[i]'s 16 lanes summed, for each i: lane i of the result. Pairs of vectors, then pairs of those,
// fold their lanes together (unpack, then 128-bit lane shuffles): 15 additions for 16 sums.
inline __m512 sum16(const __m512 v[16]) {
  __m512 s[8], t[4], w[2];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: its four floats' sum for v[4i] .. v[4i+3]
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // [t0's lanes 0+1, t0's 2+3, t1's 0+1, t1's 2+3] (and t2, t3)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Values [d0, d0 + 16 V) of n keys weighted by G heads' probabilities, the G x V sums held in
// registers (a runtime group or width left them on the stack: a load and a store around every
// FMA, most of the old kernel's time). Then either out (1 / total[g] applied, T) or a partial's
// float32 values, in order.
template <typename T, int G, int V>
void weigh_values(const T* values, int64_t n, int64_t dim, int64_t d0, const float (*probs)[kChunk],
                  const float* inverse, T* const* out, float* const* partial) {
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < V; ++k) acc[g][k] = _mm512_setzero_ps();
  const T* v = values + d0;
  for (int64_t j = 0; j < n; ++j, v += dim) {
    __m512 x[V];
    if constexpr (V == 1) {
      x[0] = Dot<T>::widen16(v);
    } else {
      for (int k = 0; k < V; k += 2) Dot<T>::widen(v + 16 * k, x[k], x[k + 1]);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g][j]);
      for (int k = 0; k < V; ++k) acc[g][k] = _mm512_fmadd_ps(p, x[k], acc[g][k]);
    }
  }
  for (int g = 0; g < G; ++g) {
    if constexpr (V > 1)
      for (int k = 0; k < V; k += 2) Dot<T>::restore(acc[g][k], acc[g][k + 1]);
    if (partial != nullptr) {
      for (int k = 0; k < V; ++k) _mm512_storeu_ps(partial[g] + d0 + 16 * k, acc[g][k]);
    } else {
      const __m512 scale = _mm512_set1_ps(inverse[g]);
      for (int k = 0; k < V; ++k) Dot<T>::store(out[g] + d0 + 16 * k, _mm512_mul_ps(acc[g][k], scale));
    }
  }
}

// Row `row`'s G query heads of key head kv_head against its keys [begin, end) (at most kChunk).
// partial == nullptr: the row's whole attention, written to a.out. Otherwise partial receives
// [G peaks][G totals][G x dim weighted values], all float32, the values not yet divided.
// C: the head's vectors (dim / Dot<T>::kStep) where known when compiled, else 0. Known, its loops
// unroll and a block's 16 sums stay in registers; at run time they went through memory, a store
// and a load around every product (8 rows of 1,100 keys: ~2x the time).
template <typename T, int G, int C>
void attend_keys(const Step<T>& a, int64_t row, int64_t kv_head, int64_t begin, int64_t end, float* partial) {
  using D = Dot<T>;
  const int64_t dim = C > 0 ? C * D::kStep : a.dim, n = end - begin, chunks = dim / D::kStep;
  // A bfloat16 head 16 wider than a multiple of 32 (48, 80, ...): its last 16 values in a half vector.
  const bool half = C == 0 && dim % D::kStep != 0;
  const int64_t from = a.shared != nullptr && end <= a.shared[row] ? a.source[row] : row;  // (whose copy it reads)
  const T* keys = a.keys + from * a.k_row + kv_head * a.k_head + begin * dim;
  const T* values = a.values + from * a.v_row + kv_head * a.v_head + begin * dim;
  typename D::Vector q[G][kMaxWidth / D::kStep];
  for (int g = 0; g < G; ++g) {
    const T* qg = a.q + row * a.q_row + (kv_head * G + g) * a.q_head;
    for (int64_t c = 0; c < chunks; ++c) q[g][c] = D::load(qg + c * D::kStep);
    if (half) q[g][chunks] = D::load_half(qg + chunks * D::kStep);
  }
  // Scores 16 keys at a time: each key's dot product with a query head is a vector of partial
  // sums, and 16 of them reduce together into one vector of 16 scores (sum16), where reducing each
  // on its own cost most of the step (a horizontal sum per key and query head). A query head's 16
  // keys are read from L1 once per head of the group.
  alignas(64) float probs[G][kChunk];
  __m512 peaks[G];
  for (int g = 0; g < G; ++g) peaks[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 live = xllm_simd::lanes(n - j0);
    const T* kj[16];
    for (int j = 0; j < 16; ++j) kj[j] = keys + std::min<int64_t>(j0 + j, n - 1) * dim;  // (past n: the last, masked)
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) acc[j] = D::add(acc[j], D::load(kj[j] + c * D::kStep), q[g][c]);
        if (half) acc[j] = D::add(acc[j], D::load_half(kj[j] + chunks * D::kStep), q[g][chunks]);
      }
      const __m512 s = _mm512_mul_ps(sum16(acc), scale);
      _mm512_mask_storeu_ps(probs[g] + j0, live, s);
      peaks[g] = _mm512_mask_max_ps(peaks[g], live, peaks[g], s);
    }
  }
  float peak[G], total[G], inverse[G];
  for (int g = 0; g < G; ++g) {
    peak[g] = _mm512_reduce_max_ps(peaks[g]);
    __m512 sum = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(peak[g]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = xllm_simd::lanes(n - j);
      __m512 e = _mm512_maskz_mov_ps(live, xllm_simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, probs[g] + j), shift)));
      _mm512_mask_storeu_ps(probs[g] + j, live, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
    inverse[g] = 1.f / total[g];
  }
  T* out[G];
  float* sums[G];
  for (int g = 0; g < G; ++g) {
    out[g] = a.out + (row * a.heads + kv_head * G + g) * dim;
    sums[g] = partial == nullptr ? nullptr : partial + 2 * G + g * dim;
  }
  float* const* into = partial == nullptr ? nullptr : sums;
  // 64 values at a time where G x 4 sums fit the registers, else (and for a 32-wide rest) 32, then
  // a 16-wide rest alone.
  constexpr int kWide = G <= 4 ? 4 : 2;
  int64_t d0 = 0;
  for (; d0 + 16 * kWide <= dim; d0 += 16 * kWide)
    weigh_values<T, G, kWide>(values, n, dim, d0, probs, inverse, out, into);
  if (d0 + 32 <= dim) {
    weigh_values<T, G, 2>(values, n, dim, d0, probs, inverse, out, into);
    d0 += 32;
  }
  if (d0 < dim) weigh_values<T, G, 1>(values, n, dim, d0, probs, inverse, out, into);
  if (partial != nullptr) {
    for (int g = 0; g < G; ++g) {
      partial[g] = peak[g];
      partial[G + g] = total[g];
    }
  }
}

}  // namespace xllm_decode
