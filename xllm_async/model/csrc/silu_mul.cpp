// SwiGLU's activation, SiLU(gate) x up, over the fused gate/up rows (elementwise.h; cpu_kernels.cpp
// registers it).

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#include "elementwise.h"

namespace xllm_elementwise {
namespace {

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
      silu_mul_span(g, u, o, n);
#else
      for (int64_t i = 0; i < n; ++i) {
        float v = to_float(g[i]);
        o[i] = to_bf16(round_bf16(v / (1.f + vector_exp(-v))) * to_float(u[i]));
      }
#endif
    }
  });
}

}  // namespace

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

}  // namespace xllm_elementwise
