// What csrc/small_step.cpp's call carries (its flat lists' layout), and the one-team step
// (team_step.cpp) it hands a decode step to where that can run it.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace xllm_step {

// Each layer's entries in `weights` (a None where a model has no such tensor).
enum Entry : int64_t {
  kInNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kEntries
};
// Each layer's entries in `eps`.
enum Eps : int64_t { kInEps, kQEps, kKEps, kPostEps, kEpsEntries };
// What `sizes` holds.
enum Size : int64_t { kLayers, kQSize, kKvSize, kHeads, kKvHeads, kHeadDim, kIntermediate, kSizes };
// A layer's linears, each with its format in `formats` ("": packed for csrc/linear.cpp; else the
// GGUF block format csrc/quant_linear.cpp takes).
enum Linear : int64_t { kQkvLinear, kOLinear, kGateUpLinear, kDownLinear, kLinears };

// The step's layers in one OpenMP team (team_step.cpp), where every linear is packed for our
// AVX512 loops (no AMX, no GGUF blocks) and the shapes fit; nullopt where it cannot run it.
std::optional<at::Tensor> team_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                    const c10::List<std::optional<at::Tensor>>& weights, at::ArrayRef<double> eps,
                                    at::IntArrayRef sizes, const at::Tensor& slabs, const at::Tensor& slots,
                                    const at::Tensor& reads, double scale, const std::optional<at::Tensor>& sharing);

}  // namespace xllm_step
