// The packed attention kernels' softmax over a block's scores (attention_amx.h and
// attention_lanes.h compute the scores and the sums of values around it).
// Include only under #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_packing.h"
#include "avx512_bf16.h"

namespace xllm_attention {

// The largest of n > 0 scores, 16 lanes at a time (a scalar max is a 4-cycle chain per value,
// and the compiler keeps it scalar: it may not reorder max where NaNs are honoured).
inline float row_max(const float* x, int64_t n) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) peak = _mm512_max_ps(peak, _mm512_loadu_ps(x + j));
  if (j < n) {
    __mmask16 tail = xllm_simd::lanes(n - j);
    peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, x + j));
  }
  return _mm512_reduce_max_ps(peak);
}

// 2^t for t <= 0: 2^(t - n) by a degree-4 polynomial on [-1/2, 1/2] (within 4e-6, far inside the
// bfloat16 the probabilities are rounded to), times 2^n by scalef (0 for very negative t). Half
// the instructions of the full-precision exp, and the softmax is most of this kernel's work.
inline __m512 exp2_softmax(__m512 t) {
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.009676046747f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05592211929f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402210717f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931210235f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.000000076f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of each row's scores over the keys it sees, times `scale` inside the exponential, up
// to `width` (a multiple of 16) with zeros past what the row sees; inverse[r] = 1 / the row's
// float32 sum. Probabilities in T: in bfloat16 rounded as torch's kernel rounds them before
// multiplying the values, their exponential the short exp2_softmax (far inside that rounding);
// in float32 kept as they are, their exponential the full-precision one (the tests compare
// float32 with transformers token for token).
template <typename T>
void softmax_rows(const Block<T>& b, int count, const float* scores, T* probs, int64_t width, float scale,
                  float* inverse) {
  constexpr bool kHalf = std::is_same_v<T, bf16>;
  const float unit = kHalf ? scale * 1.44269504088896341f : scale;  // e^(x scale) = 2^(x scale log2(e))
  const __m512 vscale = _mm512_set1_ps(unit);
  for (int r = 0; r < count; ++r) {
    const float* sr = scores + r * width;
    T* pr = probs + r * width;
    const int64_t seen = b.seen[r];
    const float peak = row_max(sr, seen) * unit;  // in the exponential's units
    const __m512 shift = _mm512_set1_ps(peak);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += kKeys) {
      const int64_t left = seen - j;
      __m512 e = _mm512_setzero_ps();
      if (left > 0) {
        const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vscale, shift);
        if constexpr (kHalf) {
          e = exp2_softmax(t);
        } else {
          e = xllm_simd::exp(t);
        }
        if (left < kKeys) e = _mm512_maskz_mov_ps(xllm_simd::lanes(left), e);
        total = _mm512_add_ps(total, e);
      }
      if constexpr (kHalf) {
        xllm_simd::store_bf16(pr + j, e, 0xFFFF);
      } else {
        _mm512_storeu_ps(pr + j, e);
      }
    }
    const float sum = _mm512_reduce_add_ps(total);
    inverse[r] = 1.f / sum;
    if (b.lse[r] != nullptr) {  // ln of sum e^(x scale)
      *b.lse[r] = (kHalf ? peak * 0.693147180559945309f : peak) + std::log(sum);
    }
  }
}

}  // namespace xllm_attention
