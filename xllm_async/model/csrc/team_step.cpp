// A decode step's layers in one OpenMP team (small_step.cpp hands it the step where it can run).
//
// Why: a one-row SmolLM2 step through small_step.cpp's operator calls is ~10 operator calls, ~15
// tensor views and ~10 allocations a layer, and a parallel region for each linear and the
// attention (a fork and a join each): 20-30 us a layer of host work, ~0.6-0.9 ms of a ~10 ms step
// on the EPYC Zen 4, during which nothing reads weights. Here the step's threads are one team for
// all its layers, meeting at a barrier between phases, on buffers made once a step:
//   norm (rows) | qkv (columns) | rotary, cache write and attention ((row, key head) items) |
//   o (columns) | residual + norm (rows) | gate/up (columns) | SiLU x up (columns) | down (columns) |
//   residual + the next norm (rows)
// The linears are shared out by 16-column vectors, not 64-column blocks (the o and down
// projections' 9 blocks left one thread 5 and the other 4).
//
// The same arithmetic as the operators, so the same bits (tests/test_cpu_kernels.py compares the
// generic forward, SmallStep's Python loop and this): linear_rows.h's block products, elementwise.h's
// rows, decode_attend.h's items; each value is computed by one thread, whichever. Only on CPUs
// without AMX (whose linear is oneDNN's brgemm, linear.cpp) and for linears packed for ours.

#include "team_step.h"

#include <torch/library.h>

#include <atomic>

namespace xllm_step {
// Steps the team ran, for the tests (that a step they compare took this path, not the operators').
std::atomic<int64_t> team_steps_run{0};
}  // namespace xllm_step

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("team_steps() -> int", []() -> int64_t { return xllm_step::team_steps_run.load(); });
}

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)

#include <omp.h>

#include <cstring>
#include <vector>

#include "decode_attend.h"
#include "decode_keys.h"
#include "elementwise.h"
#include "linear_rows.h"

namespace xllm_step {
namespace {

using xllm_elementwise::bf16;
using Maybe = std::optional<at::Tensor>;

struct LayerRefs {  // one layer's tensors as pointers (T: their element type)
  const void *in_norm, *qkv, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
  const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;  // float32 copies, or null
  float in_eps, q_eps, k_eps, post_eps;
};

struct Shape {
  int64_t rows, hidden, q_size, kv_size, heads, kv_heads, dim, inter;
};

template <typename T>
at::Tensor run(const at::Tensor& x_in, const float* cos, const float* sin, const std::vector<LayerRefs>& layers,
               const T* final_norm, float final_eps, const Shape& s, const at::Tensor& slabs, const int64_t* slots,
               const int64_t* reads, const int64_t* source, const int64_t* shared, float scale) {
  using namespace xllm_elementwise;
  using xllm_linear_rows::share_of_linear;
  const int64_t rows = s.rows, hidden = s.hidden, dim = s.dim, kv_heads = s.kv_heads;
  const int64_t qkv_n = s.q_size + 2 * s.kv_size, group = s.heads / kv_heads, inter = s.inter;
  auto buffer = [&](int64_t width) { return at::empty({rows, width}, x_in.options()); };
  at::Tensor normed = buffer(hidden), qkv = buffer(qkv_n), q = buffer(s.q_size), attn = buffer(s.q_size),
             o = buffer(hidden), sum = buffer(hidden), gate_up = buffer(2 * inter), act = buffer(inter),
             down = buffer(hidden), x = buffer(hidden), out = buffer(hidden);
  T *normed_p = reinterpret_cast<T*>(normed.data_ptr()), *qkv_p = reinterpret_cast<T*>(qkv.data_ptr()),
    *q_p = reinterpret_cast<T*>(q.data_ptr()), *attn_p = reinterpret_cast<T*>(attn.data_ptr()),
    *o_p = reinterpret_cast<T*>(o.data_ptr()), *sum_p = reinterpret_cast<T*>(sum.data_ptr()),
    *gate_up_p = reinterpret_cast<T*>(gate_up.data_ptr()), *act_p = reinterpret_cast<T*>(act.data_ptr()),
    *down_p = reinterpret_cast<T*>(down.data_ptr()), *x_p = reinterpret_cast<T*>(x.data_ptr()),
    *out_p = reinterpret_cast<T*>(out.data_ptr());
  const T* first_x = reinterpret_cast<const T*>(x_in.data_ptr());
  auto* slab_base = reinterpret_cast<T*>(slabs.data_ptr());

#pragma omp parallel num_threads(omp_get_max_threads())
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;  // this thread's rows in row phases
    const int64_t c0 = inter * t / nt, c1 = inter * (t + 1) / nt;  // and its columns of SiLU x up
    std::vector<float> scores;
    T head_normed[1024];
    for (int64_t r = r0; r < r1; ++r)
      norm_row(first_x + r * hidden, static_cast<const T*>(layers[0].in_norm), normed_p + r * hidden, hidden,
               layers[0].in_eps);
#pragma omp barrier
    for (size_t index = 0; index < layers.size(); ++index) {
      const LayerRefs& l = layers[index];
      const T* residual = index == 0 ? first_x : x_p;
      share_of_linear(normed_p, rows, hidden, static_cast<const T*>(l.qkv), qkv_p, qkv_n, l.qkv_bias, t, nt);
#pragma omp barrier
      T* keys = slab_base + index * slabs.stride(0);
      T* values = keys + slabs.stride(1);
      const xllm_decode::Step<T> a{q_p, keys, values, attn_p, reads, s.q_size, dim, slabs.stride(2), slabs.stride(3),
                                   slabs.stride(2), slabs.stride(3), s.heads, kv_heads, dim, scale, source, shared};
      for (int64_t item = t; item < rows * kv_heads; item += nt) {  // (row, key head), interleaved
        const int64_t row = item / kv_heads, head = item % kv_heads;
        const float *cr = cos + row * dim, *sr = sin + row * dim;
        const T* in = qkv_p + row * qkv_n;
        auto rotate = [&](const T* src, const void* norm, float eps, T* dst) {  // (q/k norm, then the rotary)
          if (norm != nullptr) {
            norm_row(src, static_cast<const T*>(norm), head_normed, dim, eps);
            src = head_normed;
          }
          rope_head(src, cr, sr, dst, dim);
        };
        for (int64_t g = head * group; g < (head + 1) * group; ++g)
          rotate(in + g * dim, l.q_norm, l.q_eps, q_p + row * s.q_size + g * dim);
        const int64_t slot = slots[item];  // (row, key head)'s new key in the layer's slab seen as [tokens, dim]
        rotate(in + s.q_size + head * dim, l.k_norm, l.k_eps, keys + slot * dim);
        std::memcpy(values + slot * dim, in + s.q_size + s.kv_size + head * dim, dim * sizeof(T));
        xllm_decode::attend_item<T>(a, row, head, scores);
      }
#pragma omp barrier
      share_of_linear(attn_p, rows, s.q_size, static_cast<const T*>(l.o), o_p, hidden, l.o_bias, t, nt);
#pragma omp barrier
      for (int64_t r = r0; r < r1; ++r)
        add_norm_row(o_p + r * hidden, residual + r * hidden, static_cast<const T*>(l.post_norm), sum_p + r * hidden,
                     normed_p + r * hidden, hidden, l.post_eps);
#pragma omp barrier
      share_of_linear(normed_p, rows, hidden, static_cast<const T*>(l.gate_up), gate_up_p, 2 * inter, l.gate_up_bias,
                      t, nt);
#pragma omp barrier
      for (int64_t r = 0; r < rows && c0 < c1; ++r)
        silu_mul_span(gate_up_p + r * 2 * inter + c0, gate_up_p + r * 2 * inter + inter + c0, act_p + r * inter + c0,
                      c1 - c0);
#pragma omp barrier
      share_of_linear(act_p, rows, inter, static_cast<const T*>(l.down), down_p, hidden, l.down_bias, t, nt);
#pragma omp barrier
      const bool last = index + 1 == layers.size();
      for (int64_t r = r0; r < r1; ++r) {  // (mlp + x, as SmallStep), then the next layer's norm or the final one
        add_span(down_p + r * hidden, sum_p + r * hidden, x_p + r * hidden, hidden);
        norm_row(x_p + r * hidden, last ? final_norm : static_cast<const T*>(layers[index + 1].in_norm),
                 (last ? out_p : normed_p) + r * hidden, hidden, last ? final_eps : layers[index + 1].in_eps);
      }
#pragma omp barrier
    }
  }
  return out;
}

}  // namespace

std::optional<at::Tensor> team_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                    const c10::List<Maybe>& weights, at::ArrayRef<double> eps, at::IntArrayRef sizes,
                                    const at::Tensor& slabs, const at::Tensor& slots, const at::Tensor& reads,
                                    double scale, const Maybe& sharing) {
  const auto dtype = x.scalar_type();
  const Shape s{x.size(0), x.size(1), sizes[kQSize], sizes[kKvSize], sizes[kHeads], sizes[kKvHeads], sizes[kHeadDim],
                sizes[kIntermediate]};
  const int64_t layers = sizes[kLayers], qkv_n = s.q_size + 2 * s.kv_size;
  // Where any of this does not hold, small_step.cpp's operator calls run the step (and check it).
  if ((dtype != at::kBFloat16 && dtype != at::kFloat) || !x.is_contiguous() || s.rows < 1 || s.dim % 32 != 0 ||
      s.dim > 256 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.heads / s.kv_heads > 8 ||
      s.q_size != s.heads * s.dim || s.kv_size != s.kv_heads * s.dim || slabs.scalar_type() != dtype ||
      slabs.dim() != 6 || slabs.size(5) != s.dim || slabs.stride(5) != 1 || slabs.stride(4) != s.dim ||
      slabs.stride(3) != slabs.size(4) * s.dim || slabs.stride(2) != s.kv_heads * slabs.stride(3) ||
      slabs.size(2) < s.rows || slabs.size(3) != s.kv_heads || !cos.is_contiguous() || !sin.is_contiguous() ||
      cos.scalar_type() != at::kFloat || cos.numel() != s.rows * s.dim || sin.sizes() != cos.sizes() ||
      slots.scalar_type() != at::kLong || !slots.is_contiguous() || slots.numel() != s.rows * s.kv_heads ||
      reads.scalar_type() != at::kLong || !reads.is_contiguous() || reads.numel() != s.rows)
    return std::nullopt;
  const int64_t capacity = slabs.size(4), tokens = slabs.size(2) * s.kv_heads * capacity;
  const int64_t *slot = slots.data_ptr<int64_t>(), *read = reads.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    if (slot[i] < 0 || slot[i] >= tokens) return std::nullopt;
  for (int64_t r = 0; r < s.rows; ++r)
    if (read[r] < 1 || read[r] > capacity) return std::nullopt;
  const int64_t *source, *shared;
  if (!xllm_decode::sharing_lists(sharing, s.rows, read, source, shared)) return std::nullopt;
  std::vector<at::Tensor> biases;  // (float32 copies, kept alive for the call)
  auto tensor = [&](int64_t layer, Entry e) { return weights.get(layer * kEntries + e); };
  auto norm = [&](int64_t layer, Entry e, int64_t n, bool needed, bool& ok) -> const void* {
    Maybe w = tensor(layer, e);
    if (!w.has_value()) {
      ok = ok && !needed;
      return nullptr;
    }
    ok = ok && w->scalar_type() == dtype && w->is_contiguous() && w->numel() == n;
    return w->data_ptr();
  };
  auto packed = [&](int64_t layer, Entry e, int64_t k, int64_t n, bool& ok) -> const void* {
    Maybe w = tensor(layer, e);
    ok = ok && w.has_value() && w->scalar_type() == dtype && w->is_contiguous() && w->dim() == 2 &&
         w->size(1) == k * xllm_linear_rows::kCols && w->size(0) * xllm_linear_rows::kCols >= n;
    return ok ? w->data_ptr() : nullptr;
  };
  auto bias = [&](int64_t layer, Entry e, int64_t n, bool& ok) -> const float* {
    Maybe b = tensor(layer, e);
    if (!b.has_value() || !b->defined()) return nullptr;
    ok = ok && b->dim() == 1 && b->size(0) == n;
    if (!ok) return nullptr;
    biases.push_back(b->to(at::kFloat).contiguous());  // (as linear.cpp adds it: in float32)
    return biases.back().data_ptr<float>();
  };
  std::vector<LayerRefs> refs(layers);
  bool ok = true;
  for (int64_t i = 0; i < layers && ok; ++i) {
    const double* e = eps.data() + i * kEpsEntries;
    refs[i] = LayerRefs{norm(i, kInNorm, s.hidden, true, ok), packed(i, kQkv, s.hidden, qkv_n, ok),
                        norm(i, kQNorm, s.dim, false, ok), norm(i, kKNorm, s.dim, false, ok),
                        packed(i, kO, s.q_size, s.hidden, ok), norm(i, kPostNorm, s.hidden, true, ok),
                        packed(i, kGateUp, s.hidden, 2 * s.inter, ok), packed(i, kDown, s.inter, s.hidden, ok),
                        bias(i, kQkvBias, qkv_n, ok), bias(i, kOBias, s.hidden, ok),
                        bias(i, kGateUpBias, 2 * s.inter, ok), bias(i, kDownBias, s.hidden, ok),
                        static_cast<float>(e[kInEps]), static_cast<float>(e[kQEps]), static_cast<float>(e[kKEps]),
                        static_cast<float>(e[kPostEps])};
  }
  Maybe final_norm = weights.get(layers * kEntries);
  if (!ok || !final_norm.has_value() || final_norm->scalar_type() != dtype || final_norm->numel() != s.hidden ||
      !final_norm->is_contiguous())
    return std::nullopt;
  const float final_eps = static_cast<float>(eps[layers * kEpsEntries]);
  team_steps_run.fetch_add(1, std::memory_order_relaxed);
  if (dtype == at::kFloat)
    return run<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), refs, final_norm->data_ptr<float>(), final_eps,
                      s, slabs, slot, read, source, shared, static_cast<float>(scale));
  return run<bf16>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), refs,
                   reinterpret_cast<const bf16*>(final_norm->data_ptr()), final_eps, s, slabs, slot, read, source,
                   shared, static_cast<float>(scale));
}

}  // namespace xllm_step

#else  // no AVX512-BF16, or AMX (whose linear this step does not compute)

namespace xllm_step {

std::optional<at::Tensor> team_step(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const c10::List<std::optional<at::Tensor>>&, at::ArrayRef<double>,
                                    at::IntArrayRef, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    double, const std::optional<at::Tensor>&) {
  return std::nullopt;
}

}  // namespace xllm_step

#endif
