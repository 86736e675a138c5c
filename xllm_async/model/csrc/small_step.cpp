// A decode step's layer loop in one call (model/llama.py, SmallStep.native): the same operators in
// the same order as llama.SmallStep runs them from Python, called here through the dispatcher.
//
// Why: a one-row decode step of SmolLM2-135M is ~85% linear kernels and ~10% host time: ~1,600
// Python calls and ~400 operator calls from Python a step, each a few microseconds. From C++ an
// operator call is a fraction of a microsecond, and the answers are the same bit for bit (the
// same kernels on the same inputs). Only plain decode steps come here: every linear packed for our
// kernel (csrc/linear.cpp) or kept in GGUF blocks for our quantized one (csrc/quant_linear.cpp),
// the keys in a SlabCache and read by our decode attention (csrc/decode_attention.cpp). Beam
// rounds stay on llama.SmallStep. Where every linear is packed for ours and the CPU has no AMX, the
// step goes further: its layers in one OpenMP team, no operator calls (team_step.cpp; `team`).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "team_step.h"

namespace {

using Tensor = at::Tensor;
using Maybe = std::optional<Tensor>;

using namespace xllm_step;  // the flat lists' layout (team_step.h)

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Maybe&, double)> rope;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Maybe&, int64_t)> linear;
  // (registered only where the CPU has AVX512-VNNI: a model asks for it only where it verified)
  std::optional<c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const std::string&, const Maybe&, int64_t)>>
      quant_linear;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, const Maybe&)>
      attention;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

template <typename Signature>
std::optional<c10::TypedOperatorHandle<Signature>> maybe_handle(const char* name) {
  auto found = c10::Dispatcher::singleton().findSchema({name, ""});
  if (!found.has_value()) return std::nullopt;
  return found->typed<Signature>();
}

const Ops& ops() {  // found once, at the first step (every operator is registered by then)
  static const Ops found{
      handle<Tensor(const Tensor&, const Tensor&, double)>("xllm::rms_norm"),
      handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>("xllm::add_rms_norm"),
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Maybe&, double)>("xllm::rope"),
      handle<Tensor(const Tensor&)>("xllm::silu_mul"),
      handle<Tensor(const Tensor&, const Tensor&, const Maybe&, int64_t)>("xllm::linear"),
      maybe_handle<Tensor(const Tensor&, const Tensor&, const std::string&, const Maybe&, int64_t)>("xllm::quant_linear"),
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, const Maybe&)>(
          "xllm::decode_attention"),
  };
  return found;
}

// x [rows, hidden] (the embedded tokens) -> the final norm's output [rows, hidden]. cos/sin: the
// rows' rotary tables (float32 [rows, head_dim]); weights: kEntries a layer, then the final
// norm's; eps: kEpsEntries a layer, then the final norm's; slabs: the batch's cache [layers, 2,
// rows.., kv_heads, capacity, head_dim]; slots: where each (row, key head)'s new key goes in a
// layer's slab seen as [tokens, head_dim]; reads: the keys each row reads, its new one included;
// formats: kLinears a layer (or none: every linear packed for csrc/linear.cpp); sharing: rows that
// read a shared prefix from another row's copy (decode_attend.h), or None.
Tensor small_step(const Tensor& x_in, const Tensor& cos, const Tensor& sin, const c10::List<Maybe>& weights,
                  at::ArrayRef<double> eps, at::IntArrayRef sizes, const Tensor& slabs, const Tensor& slots,
                  const Tensor& reads, double scale, const std::vector<std::string>& formats, bool team,
                  const Maybe& sharing) {
  TORCH_CHECK(sizes.size() == kSizes, "small_step: sizes holds ", int64_t(kSizes), " values");
  const int64_t layers = sizes[kLayers], dim = sizes[kHeadDim];
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kEntries + 1 &&
                  static_cast<int64_t>(eps.size()) == layers * kEpsEntries + 1,
              "small_step: ", int64_t(kEntries), " weights and ", int64_t(kEpsEntries), " eps a layer, then the final norm's");
  TORCH_CHECK(formats.empty() || static_cast<int64_t>(formats.size()) == layers * kLinears,
              "small_step: no formats, or ", int64_t(kLinears), " a layer");
  TORCH_CHECK(slabs.dim() == 6 && slabs.size(0) == layers && slabs.size(1) == 2 && slabs.size(5) == dim,
              "small_step: slabs [layers, 2, rows, kv_heads, capacity, head_dim]");
  if (team && formats.empty()) {  // (every linear packed for ours: one OpenMP team for the step, where it runs)
    if (auto out = team_step(x_in, cos, sin, weights, eps, sizes, slabs, slots, reads, scale, sharing)) return *out;
  }
  const auto& op = ops();
  const std::vector<int64_t> split{sizes[kQSize], sizes[kKvSize], sizes[kKvSize]};
  const std::vector<int64_t> q_shape{-1, sizes[kHeads], dim}, kv_shape{-1, sizes[kKvHeads], dim}, flat{-1, dim};
  auto w = [&](int64_t layer, Entry e) -> Maybe { return weights.get(layer * kEntries + e); };
  auto must = [&](int64_t layer, Entry e) -> Tensor {
    Maybe t = w(layer, e);
    TORCH_CHECK(t.has_value(), "small_step: layer ", layer, " lacks entry ", int64_t(e));
    return *t;
  };
  auto linear = [&](const Tensor& rows, int64_t layer, Linear which, Entry packed, Entry bias, int64_t n) {
    const std::string* format = formats.empty() ? nullptr : &formats[layer * kLinears + which];
    if (format == nullptr || format->empty()) return op.linear.call(rows, must(layer, packed), w(layer, bias), n);
    TORCH_CHECK(op.quant_linear.has_value(), "small_step: no quantized linear in this build");
    return op.quant_linear->call(rows, must(layer, packed), *format, w(layer, bias), n);
  };
  const int64_t qkv_n = sizes[kQSize] + 2 * sizes[kKvSize], hidden = x_in.size(1);
  Tensor x = x_in;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const double* e = eps.data() + layer * kEpsEntries;
    auto parts = linear(op.rms_norm.call(x, must(layer, kInNorm), e[kInEps]), layer, kQkvLinear, kQkv, kQkvBias, qkv_n)
                     .split_with_sizes(split, -1);
    Tensor q = op.rope.call(parts[0].view(q_shape), cos, sin, w(layer, kQNorm), e[kQEps]);
    Tensor k = op.rope.call(parts[1].view(kv_shape), cos, sin, w(layer, kKNorm), e[kKEps]);
    Tensor v = parts[2].view(kv_shape);
    const Tensor slab = slabs.select(0, layer);
    Tensor keys = slab.select(0, 0), values = slab.select(0, 1);
    keys.view(flat).index_copy_(0, slots, k.reshape(flat));  // (attention.Decode.attend)
    values.view(flat).index_copy_(0, slots, v.reshape(flat));
    Tensor attn = op.attention.call(q, keys, values, reads, scale, sharing).view({q.size(0), -1});
    auto [sum, normed] = op.add_rms_norm.call(linear(attn, layer, kOLinear, kO, kOBias, hidden), x, must(layer, kPostNorm),
                                              e[kPostEps]);
    Tensor gate_up = linear(normed, layer, kGateUpLinear, kGateUp, kGateUpBias, 2 * sizes[kIntermediate]);
    x = linear(op.silu_mul.call(gate_up), layer, kDownLinear, kDown, kDownBias, hidden).add_(sum);  // (mlp + x, as SmallStep)
  }
  return op.rms_norm.call(x, *weights.get(layers * kEntries), eps[layers * kEpsEntries]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("small_step(Tensor x, Tensor cos, Tensor sin, Tensor?[] weights, float[] eps, int[] sizes, Tensor slabs, "
        "Tensor slots, Tensor reads, float scale, str[] formats, bool team=True, Tensor? sharing=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("small_step", &small_step); }
