// The elementwise kernels' row arithmetic (declared in elementwise.h), compiled once for every
// caller: the operators and the one-team step run the same machine code, so the same bits.

#include "elementwise.h"

namespace xllm_elementwise {

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))): transformers' Qwen3/Llama RMSNorm in bfloat16
// (T = bf16); in float32 (T = float) the same with nothing rounded.
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
#if defined(__AVX512BF16__)
  using L = Lanes<T>;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = L::load(x + i, xllm_simd::lanes(n - i));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 live = xllm_simd::lanes(n - i);
    __m512 normed = L::round(_mm512_mul_ps(L::load(x + i, live), scale));
    L::store(out + i, _mm512_mul_ps(L::load(w + i, live), normed), live);
  }
#else
  static_assert(std::is_same_v<T, bf16>, "float32 only on the vector path");
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    float v = to_float(x[i]);
    sum += v * v;
  }
  float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(to_float(w[i]) * round_bf16(to_float(x[i]) * scale));
#endif
}

// One head's rotary embedding by halves (Llama/Qwen): out = bf16(bf16(x * c) + bf16(rotate_half(x) *
// s)), c and s the bfloat16-rounded cos/sin of its token (float32 [width]), as eager does (float32:
// nothing rounded).
template <typename T>
void rope_head(const T* in, const float* cr, const float* sr, T* o, int64_t width) {
  const int64_t half = width / 2;
#if defined(__AVX512BF16__)
  using L = Lanes<T>;
  for (int64_t i = 0; i < half; i += 16) {  // both halves, 16 lanes of each at a time
    __mmask16 live = xllm_simd::lanes(half - i);
    __m512 first = L::load(in + i, live), second = L::load(in + half + i, live);
    __m512 c1 = L::round(_mm512_maskz_loadu_ps(live, cr + i));
    __m512 s1 = L::round(_mm512_maskz_loadu_ps(live, sr + i));
    __m512 c2 = L::round(_mm512_maskz_loadu_ps(live, cr + half + i));
    __m512 s2 = L::round(_mm512_maskz_loadu_ps(live, sr + half + i));
    __m512 minus_second = _mm512_sub_ps(_mm512_setzero_ps(), second);
    L::store(o + i, _mm512_add_ps(L::round(_mm512_mul_ps(first, c1)), L::round(_mm512_mul_ps(minus_second, s1))),
             live);
    L::store(o + half + i, _mm512_add_ps(L::round(_mm512_mul_ps(second, c2)), L::round(_mm512_mul_ps(first, s2))),
             live);
  }
#else
  for (int64_t i = 0; i < half; ++i) {  // the first half turns with minus the second
    float v = to_float(in[i]), rotated = -to_float(in[i + half]);
    o[i] = to_bf16(round_bf16(v * round_bf16(cr[i])) + round_bf16(rotated * round_bf16(sr[i])));
  }
  for (int64_t i = half; i < width; ++i) {  // and the second half with the first
    float v = to_float(in[i]), rotated = to_float(in[i - half]);
    o[i] = to_bf16(round_bf16(v * round_bf16(cr[i])) + round_bf16(rotated * round_bf16(sr[i])));
  }
#endif
}

// One row of residual + x (rounded to bfloat16, as the eager add) into s, and its RMSNorm into o.
template <typename T>
void add_norm_row(const T* a, const T* b, const T* w, T* s, T* o, int64_t n, float eps) {
#if defined(__AVX512BF16__)
  using L = Lanes<T>;
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 live = xllm_simd::lanes(n - i);
    L::store(s + i, _mm512_add_ps(L::load(b + i, live), L::load(a + i, live)), live);
  }
#else
  for (int64_t i = 0; i < n; ++i) s[i] = to_bf16(to_float(b[i]) + to_float(a[i]));
#endif
  norm_row(s, w, o, n, eps);
}

#if defined(__AVX512BF16__)
// SwiGLU's activation over n values of a row: o = bf16(bf16(silu(g)) * u) (float32: nothing
// rounded), 16 at a time (a scalar loop is bound by its exp and division: 1.2x eager; this one
// by memory). Each value on its own: any span of a row gives the same bits.
template <typename T>
void silu_mul_span(const T* __restrict g, const T* __restrict u, T* __restrict o, int64_t n) {
  using L = Lanes<T>;
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 live = xllm_simd::lanes(n - i);
    __m512 v = L::load(g + i, live);
    __m512 e = xllm_simd::exp(_mm512_sub_ps(_mm512_setzero_ps(), v));
    __m512 silu = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));  // (v / inf = -0, as torch)
    L::store(o + i, _mm512_mul_ps(L::round(silu), L::load(u + i, live)), live);
  }
}
#endif

#if defined(__AVX512BF16__)
template <typename T>
void add_span(const T* a, const T* b, T* out, int64_t n) {
  using L = Lanes<T>;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = xllm_simd::lanes(n - i);
    L::store(out + i, _mm512_add_ps(L::load(a + i, live), L::load(b + i, live)), live);
  }
}

#define XLLM_ROWS(T)                                                                      \
  template void norm_row<T>(const T*, const T*, T*, int64_t, float);                      \
  template void rope_head<T>(const T*, const float*, const float*, T*, int64_t);          \
  template void add_norm_row<T>(const T*, const T*, const T*, T*, T*, int64_t, float);    \
  template void silu_mul_span<T>(const T*, const T*, T*, int64_t);                        \
  template void add_span<T>(const T*, const T*, T*, int64_t);
XLLM_ROWS(bf16)
XLLM_ROWS(float)
#undef XLLM_ROWS
#else
template void norm_row<bf16>(const bf16*, const bf16*, bf16*, int64_t, float);
template void rope_head<bf16>(const bf16*, const float*, const float*, bf16*, int64_t);
template void add_norm_row<bf16>(const bf16*, const bf16*, const bf16*, bf16*, bf16*, int64_t, float);
#endif

}  // namespace xllm_elementwise
