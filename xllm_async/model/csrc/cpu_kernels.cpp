// Fused elementwise kernels for a bfloat16 forward on CPU (model/cpu_kernels.py builds and loads
// this file). In bfloat16 a prefill spends half its time in elementwise operators, each a full
// pass over memory: RMSNorm alone is seven (cast, square, mean, add, rsqrt, multiply, cast back,
// weight). Each kernel here is one pass over its rows, in float32 inside, and rounds to bfloat16
// where the eager code it replaces does, so its answers stay those of that code (and of
// transformers) to the last bit wherever no reduction is involved.
//
// Where the CPU has AVX512-BF16 each kernel also takes float32 (since the sixteenth session): the
// same passes with nothing rounded, as the eager float32 code computes them (a norm's sum of
// squares in another order).
//
// Rows are independent, so a row's result never depends on the batch around it.

#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#if defined(__AVX512BF16__)
#include "avx512_bf16.h"
#endif

namespace {

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

// exp for SiLU (std::exp is a call per value: 5x slower than torch's own silu): Cephes' expf,
// 2^n times a degree-6 polynomial on |r| <= ln2/2, within 2 float ulps; the input is clamped
// where float would overflow.
inline float vector_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

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

Rows rows_of(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "expected [rows, width] or [rows, heads, width]");
  TORCH_CHECK(x.stride(-1) == 1, "the last dimension must be contiguous");
  if (x.dim() == 2) return {x.size(0), 1, x.size(1), x.stride(0), 0};
  return {x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1)};
}

inline bf16* bits(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

void check_bf16(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CPU tensor");
}

// Whether a kernel's tensors are float32 (else bfloat16): all of them alike, float32 only where the
// vector paths exist.
bool is_float32(const at::Tensor& x, std::initializer_list<const at::Tensor*> others, const char* name) {
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

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))): transformers' Qwen3/Llama RMSNorm in bfloat16
// (T = bf16); in float32 (T = float) the same with nothing rounded.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
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

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  Rows r = rows_of(x);
  const auto* src = reinterpret_cast<const T*>(x.data_ptr());
  const auto* w = reinterpret_cast<const T*>(weight.data_ptr());
  auto* dst = reinterpret_cast<T*>(out.data_ptr());
  parallel_rows(r.rows * r.heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t row = i / r.heads, head = i % r.heads;
      norm_row(src + row * r.row_stride + head * r.head_stride, w, dst + i * r.width, r.width,
               static_cast<float>(eps));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool f32 = is_float32(x, {&weight}, "x");
  Rows r = rows_of(x);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == r.width, "weight must match the last dimension");
  auto out = at::empty(x.sizes(), x.options());
#if defined(__AVX512BF16__)
  if (f32) {
    rms_norm_rows<float>(x, weight, out, eps);
    return out;
  }
#endif
  rms_norm_rows<bf16>(x, weight, out, eps);
  return out;
}

// residual + x (rounded to bfloat16, as the eager add), and its RMSNorm: one pass for both.
template <typename T>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, at::Tensor& sum,
                       at::Tensor& out, double eps) {
  int64_t rows = x.size(0), n = x.size(1);
  const auto* a = reinterpret_cast<const T*>(x.data_ptr());
  const auto* b = reinterpret_cast<const T*>(residual.data_ptr());
  const auto* w = reinterpret_cast<const T*>(weight.data_ptr());
  auto* s = reinterpret_cast<T*>(sum.data_ptr());
  auto* o = reinterpret_cast<T*>(out.data_ptr());
  int64_t sa = x.stride(0), sb = residual.stride(0);
  parallel_rows(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
#if defined(__AVX512BF16__)
      using L = Lanes<T>;
      for (int64_t i = 0; i < n; i += 16) {
        __mmask16 live = xllm_simd::lanes(n - i);
        L::store(s + row * n + i, _mm512_add_ps(L::load(b + row * sb + i, live), L::load(a + row * sa + i, live)), live);
      }
#else
      for (int64_t i = 0; i < n; ++i) s[row * n + i] = to_bf16(to_float(b[row * sb + i]) + to_float(a[row * sa + i]));
#endif
      norm_row(s + row * n, w, o + row * n, n, static_cast<float>(eps));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  const bool f32 = is_float32(x, {&residual, &weight}, "x");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes(), "x and residual must be [rows, width] alike");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1, "the last dimension must be contiguous");
  int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must match the last dimension");
  auto sum = at::empty({rows, n}, x.options());
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  if (f32) {
    add_rms_norm_rows<float>(x, residual, weight, sum, out, eps);
    return {sum, out};
  }
#endif
  add_rms_norm_rows<bf16>(x, residual, weight, sum, out, eps);
  return {sum, out};
}

// Rotary embedding by halves (Llama/Qwen), optionally after a per-head RMSNorm (Qwen3's q/k norm):
// out = bf16(bf16(x * c) + bf16(rotate_half(x) * s)), c and s the bfloat16 cos/sin, as eager does
// (float32: nothing rounded). cos, sin: float32 [rows, width] (one row per token, shared by its heads).
template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const T* w, at::Tensor& out,
               double eps) {
  Rows r = rows_of(x);
  const auto* src = reinterpret_cast<const T*>(x.data_ptr());
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  auto* dst = reinterpret_cast<T*>(out.data_ptr());
  int64_t half = r.width / 2;
  parallel_rows(r.rows, 16, [&](int64_t begin, int64_t end) {
    T normed[1024];
    for (int64_t row = begin; row < end; ++row) {
      const float* cr = c + row * r.width;
      const float* sr = s + row * r.width;
      for (int64_t head = 0; head < r.heads; ++head) {
        const T* in = src + row * r.row_stride + head * r.head_stride;
        if (w != nullptr) {
          norm_row(in, w, normed, r.width, static_cast<float>(eps));
          in = normed;
        }
        T* o = dst + (row * r.heads + head) * r.width;
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
        for (int64_t i = half; i < r.width; ++i) {  // and the second half with the first
          float v = to_float(in[i]), rotated = to_float(in[i - half]);
          o[i] = to_bf16(round_bf16(v * round_bf16(cr[i])) + round_bf16(rotated * round_bf16(sr[i])));
        }
#endif
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const c10::optional<at::Tensor>& norm_weight, double eps) {
  const bool f32 = norm_weight.has_value() ? is_float32(x, {&*norm_weight}, "x") : is_float32(x, {}, "x");
  Rows r = rows_of(x);
  TORCH_CHECK(x.dim() == 3, "expected [rows, heads, width]");
  TORCH_CHECK(r.width % 2 == 0 && r.width <= 1024, "head width must be even and at most 1024");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == r.rows && cos.size(-1) == r.width && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [rows, width]");
  if (norm_weight.has_value())
    TORCH_CHECK(norm_weight->is_contiguous() && norm_weight->numel() == r.width, "norm_weight must match the head width");
  auto out = at::empty({r.rows, r.heads, r.width}, x.options());
#if defined(__AVX512BF16__)
  if (f32) {
    rope_rows<float>(x, cos, sin, norm_weight.has_value() ? norm_weight->data_ptr<float>() : nullptr, out, eps);
    return out;
  }
#endif
  rope_rows<bf16>(x, cos, sin, norm_weight.has_value() ? bits(*norm_weight) : nullptr, out, eps);
  return out;
}

// SwiGLU's activation on the fused gate/up output [rows, 2 * n]: bf16(bf16(silu(gate)) * up)
// (float32: nothing rounded).
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const auto* src = reinterpret_cast<const T*>(gate_up.data_ptr());
  auto* dst = reinterpret_cast<T*>(out.data_ptr());
  parallel_rows(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* __restrict g = src + row * stride;
      const T* __restrict u = g + n;
      T* __restrict o = dst + row * n;
#if defined(__AVX512BF16__)
      // 16 at a time: the scalar loop below is bound by its exp and division (1.2x eager); this
      // one by memory.
      using L = Lanes<T>;
      for (int64_t i = 0; i < n; i += 16) {
        __mmask16 live = xllm_simd::lanes(n - i);
        __m512 v = L::load(g + i, live);
        __m512 e = xllm_simd::exp(_mm512_sub_ps(_mm512_setzero_ps(), v));
        __m512 silu = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));  // (v / inf = -0, as torch)
        L::store(o + i, _mm512_mul_ps(L::round(silu), L::load(u + i, live)), live);
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        float v = to_float(g[i]);
        o[i] = to_bf16(round_bf16(v / (1.f + vector_exp(-v))) * to_float(u[i]));
      }
#endif
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const bool f32 = is_float32(gate_up, {}, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "expected [rows, 2 * n] with a contiguous last dimension");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
#if defined(__AVX512BF16__)
  if (f32) {
    silu_mul_rows<float>(gate_up, out);
    return out;
  }
#endif
  silu_mul_rows<bf16>(gate_up, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(xllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor? norm_weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
}
