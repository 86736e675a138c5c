// The rotary embedding of q or k heads, after Qwen3's per-head RMSNorm where the model has one
// (elementwise.h; cpu_kernels.cpp registers it).

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "elementwise.h"

namespace xllm_elementwise {
namespace {

// A bfloat16 tensor's values as their raw bits.
inline bf16* bits(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

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
        rope_head(in, cr, sr, o, r.width);
      }
    }
  });
}

}  // namespace

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

}  // namespace xllm_elementwise
