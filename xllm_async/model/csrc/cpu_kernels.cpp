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
//
// This file registers them (rms_norm.cpp, rope.cpp and silu_mul.cpp compute them, on what
// elementwise.h shares), and it holds the library's one TORCH_LIBRARY(xllm): every other file adds
// its operators to the namespace as a fragment.

#include <torch/library.h>

#include "elementwise.h"

TORCH_LIBRARY(xllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor? norm_weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("rms_norm", &xllm_elementwise::rms_norm);
  m.impl("add_rms_norm", &xllm_elementwise::add_rms_norm);
  m.impl("rope", &xllm_elementwise::rope);
  m.impl("silu_mul", &xllm_elementwise::silu_mul);
}
