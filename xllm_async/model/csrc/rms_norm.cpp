// RMSNorm over rows, and residual add + RMSNorm in one pass (the layer's norms; elementwise.h holds
// the row's norm they share with rope.cpp, cpu_kernels.cpp registers them).

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "elementwise.h"

namespace xllm_elementwise {
namespace {

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
      add_norm_row(a + row * sa, b + row * sb, w, s + row * n, o + row * n, n, static_cast<float>(eps));
    }
  });
}

}  // namespace

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

}  // namespace xllm_elementwise
