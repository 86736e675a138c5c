// What the fused elementwise kernels share (rms_norm.cpp, rope.cpp, silu_mul.cpp; cpu_kernels.cpp
// registers them): bfloat16 as raw bits and its rounding, their rows split over the threads, a
// tensor seen as rows, the dtype check, 16 lanes of either dtype, and one row's RMSNorm (the norm
// kernels' and Qwen3's per-head norm before the rotary embedding).

#pragma once

#include <ATen/ATen.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <type_traits>

#if defined(__AVX512BF16__)
#include "avx512_bf16.h"
#endif

namespace xllm_elementwise {

// bfloat16 values as their raw 16 bits: loops over plain integers and floats are what the
// compiler vectorizes (c10::bf16's class and std::exp/std::fmin calls kept it from it).
using bf16 = uint16_t;

inline float to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Round to nearest even, as torch does (NaN handling aside: these values are finite).
inline bf16 to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

inline float round_bf16(float v) { return to_float(to_bf16(v)); }

// Rows split over the calling thread's OpenMP threads (as many as torch.set_num_threads gave that
// execution slot), with OpenMP itself: ATen's parallel_for is inline code that would compile its
// own copy of ATen's per-thread bookkeeping into this library, and we need none of it.
template <typename Body>
void parallel_rows(int64_t rows, int64_t grain, const Body& body) {
  int64_t chunks = std::min<int64_t>(omp_get_max_threads(), (rows + grain - 1) / grain);
  if (chunks <= 1 || omp_in_parallel()) {
    body(0, rows);
    return;
  }
  int64_t per = (rows + chunks - 1) / chunks;
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    int64_t begin = omp_get_thread_num() * per;
    int64_t end = std::min(rows, begin + per);
    if (begin < end) body(begin, end);
  }
}

// A tensor seen as rows of `width` contiguous values: [rows, width] or [rows, heads, width] with
// any row stride (q and k are views of the fused qkv output).
struct Rows {
  int64_t rows, heads, width, row_stride, head_stride;
};

inline Rows rows_of(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "expected [rows, width] or [rows, heads, width]");
  TORCH_CHECK(x.stride(-1) == 1, "the last dimension must be contiguous");
  if (x.dim() == 2) return {x.size(0), 1, x.size(1), x.stride(0), 0};
  return {x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1)};
}

inline void check_bf16(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CPU tensor");
}

// Whether a kernel's tensors are float32 (else bfloat16): all of them alike, float32 only where the
// vector paths exist.
inline bool is_float32(const at::Tensor& x, std::initializer_list<const at::Tensor*> others, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
#if defined(__AVX512BF16__)
  const bool f32 = x.scalar_type() == at::kFloat;
#else
  const bool f32 = false;
#endif
  if (!f32) check_bf16(x, name);
  for (const at::Tensor* t : others)
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == x.scalar_type(), "every tensor must be of ", name, "'s dtype");
  return f32;
}

#if defined(__AVX512BF16__)
// 16 lanes of T (bf16 or float) as float32, and back: bfloat16 rounds where the eager code holds
// a bfloat16 intermediate, float32 never does.
template <typename T>
struct Lanes;

template <>
struct Lanes<bf16> {
  static __m512 load(const bf16* p, __mmask16 live) { return xllm_simd::load_bf16(p, live); }
  static void store(bf16* p, __m512 x, __mmask16 live) { xllm_simd::store_bf16(p, x, live); }
  static __m512 round(__m512 x) { return xllm_simd::round_bf16(x); }
};

template <>
struct Lanes<float> {
  static __m512 load(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
  static void store(float* p, __m512 x, __mmask16 live) { _mm512_mask_storeu_ps(p, live, x); }
  static __m512 round(__m512 x) { return x; }
};
#endif

// One row's (or head's) arithmetic, each defined once, out of line, in elementwise_rows.cpp: the
// operators (rms_norm.cpp, rope.cpp, silu_mul.cpp) and the one-team step (team_step.cpp) call the
// same machine code. (Built with -ffast-math, an inline copy in each caller could be compiled to
// another order of additions: the team step's final norm once read a few ulps off the operator's.)
// T: bf16 or float (float only where AVX512-BF16 is).

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))): transformers' Qwen3/Llama RMSNorm in bfloat16
// (T = bf16); in float32 (T = float) the same with nothing rounded.
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps);

// One head's rotary embedding by halves (Llama/Qwen): out = bf16(bf16(x * c) + bf16(rotate_half(x) *
// s)), c and s the bfloat16-rounded cos/sin of its token (float32 [width]), as eager does (float32:
// nothing rounded).
template <typename T>
void rope_head(const T* in, const float* cr, const float* sr, T* o, int64_t width);

// One row of residual + x (rounded to bfloat16, as the eager add) into s, and its RMSNorm into o.
template <typename T>
void add_norm_row(const T* a, const T* b, const T* w, T* s, T* o, int64_t n, float eps);

// SwiGLU's activation over n values of a row: o = bf16(bf16(silu(g)) * u) (float32: nothing rounded).
// Each value on its own: any span of a row gives the same bits. (AVX512-BF16 only.)
template <typename T>
void silu_mul_span(const T* g, const T* u, T* o, int64_t n);

// a + b into out, n values (bf16: rounded once, as the eager add_; float32: a + b).
template <typename T>
void add_span(const T* a, const T* b, T* out, int64_t n);

// The operators (cpu_kernels.cpp registers them): rms_norm's x [rows, width] or [rows, heads,
// width], rope's [rows, heads, width], add_rms_norm's and silu_mul's [rows, width].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // rms_norm.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);  // rms_norm.cpp
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const c10::optional<at::Tensor>& norm_weight, double eps);  // rope.cpp
at::Tensor silu_mul(const at::Tensor& gate_up);  // silu_mul.cpp

}  // namespace xllm_elementwise
