// 16-lane float32 helpers for the kernels' AVX512-BF16 paths (elementwise, attention, linear).
// Include only under #if defined(__AVX512BF16__).
//
// bfloat16 values are raw uint16_t in memory, as in the kernels' scalar code; here 16 of them at
// a time, widened to float32 exactly and rounded back to nearest even as torch rounds
// (vcvtneps2bf16), so each vector step rounds where the scalar step it replaces does.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace xllm_simd {

// The first n (1-16) lanes of a step: a tail shorter than 16 loads and stores only its own.
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

inline __m512 load_bf16(const uint16_t* p, __mmask16 live) {
  __m256i raw = _mm256_maskz_loadu_epi16(live, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

inline void store_bf16(uint16_t* p, __m512 x, __mmask16 live) { _mm256_mask_storeu_epi16(p, live, to_bf16(x)); }

// x rounded to bfloat16 and back: where the eager code holds an intermediate in bfloat16.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

// exp (Cephes' expf, as vector_exp in silu_mul.cpp): 2^n times a degree-6 polynomial of the
// remainder |r| <= ln2/2; 2^n by scalef, so large x reaches inf and very negative x 0 as in torch.
inline __m512 exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace xllm_simd
