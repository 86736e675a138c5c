// A ranking request's candidate rows (model/candidate_prefill.py): stage 2 of their staged
// attention, each row against its ancestors' keys and its own (a few: the tree's depth), merged
// with stage 1 (the row against its prompt's keys: prefix_attention.cpp's out and log-sum-exp),
// in one pass over the rows, float32 inside. In torch operators the same took a dozen passes per
// depth over every row (gathers, tiny batched products, the softmax, the merge, casts): on the
// medium Qwen3 with 1,000 item candidates, more time than stage 1 itself.
//
// Rows are independent, so a row's result never depends on the rows beside it.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace {

constexpr int64_t kOneThreadRowHeads = 16384;

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
void candidate_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ancestors,
                    const at::Tensor& out1, const at::Tensor& lse1, float scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  const int64_t depth = ancestors.size(1), group = heads / kv_heads;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const T* op = reinterpret_cast<const T*>(out1.data_ptr());
  const float* lp = lse1.data_ptr<float>();
  const int64_t* ap = ancestors.data_ptr<int64_t>();
  T* dst = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out1.stride(0), os1 = out1.stride(1);
  const int64_t ls0 = lse1.stride(0), ls1 = lse1.stride(1);
  constexpr int64_t kRows = 16;  // rows a work item
  const int64_t items = (rows + kRows - 1) / kRows;
  auto body = [&](int64_t first, int64_t n, int64_t step) {
    std::vector<float> query(dim), acc(dim), scores(depth);
    for (int64_t item = first; item < n; item += step) {
      for (int64_t r = item * kRows; r < std::min(rows, (item + 1) * kRows); ++r) {
        const int64_t* chain = ap + r * depth;
        int64_t seen = 0;
        while (seen < depth && chain[seen] >= 0) ++seen;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t kvh = h / group;
          const T* qr = qp + r * qs0 + h * qs1;
          for (int64_t d = 0; d < dim; ++d) query[d] = widen(qr[d]);
          const float prompt_lse = lp[r * ls0 + h * ls1];
          float peak = prompt_lse;
          for (int64_t j = 0; j < seen; ++j) {
            const T* kr = kp + chain[j] * ks0 + kvh * ks1;
            float dot = 0.f;
            for (int64_t d = 0; d < dim; ++d) dot += query[d] * widen(kr[d]);
            scores[j] = dot * scale;
            peak = std::max(peak, scores[j]);
          }
          // Stage 1's out is already normalised over the prompt's keys: it weighs e^(lse1 - peak).
          float weight = std::exp(prompt_lse - peak), total = weight;
          const T* o1 = op + r * os0 + h * os1;
          for (int64_t d = 0; d < dim; ++d) acc[d] = weight * widen(o1[d]);
          for (int64_t j = 0; j < seen; ++j) {
            const T* vr = vp + chain[j] * vs0 + kvh * vs1;
            const float w = std::exp(scores[j] - peak);
            total += w;
            for (int64_t d = 0; d < dim; ++d) acc[d] += w * widen(vr[d]);
          }
          const float inverse = 1.f / total;
          T* o = dst + (r * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[d] * inverse);
        }
      }
    }
  };
  // A few thousand rows take well under a millisecond on one core (1,330 rows of 8 heads, 0.6 ms):
  // a second thread saves less than waking it costs, and where the other core is busy the call
  // waited for it (2 vCPU shared: 0.4 ms at best, 8 ms median). More rows go over the threads.
  if (rows * heads < kOneThreadRowHeads) {
    body(0, items, 1);
  } else {
    xllm_parallel::interleaved_items(items, body);
  }
}

// Candidate rows q [rows, heads, dim] and their own keys/values k, v [rows, kv_heads, dim] (any
// row and head strides, contiguous dim), each row's ancestors among the rows, root first and
// itself last, -1 after them (ancestors [rows, depth], int64), and stage 1's out [rows, heads,
// dim] (q's dtype) and log-sum-exp [rows, heads] (float32) -> the rows' attention over their
// prompt's keys and their own, [rows, heads, dim] in q's dtype.
at::Tensor candidate_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& ancestors, const at::Tensor& out1, const at::Tensor& lse1,
                               double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q must be bfloat16 or float32");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  for (const at::Tensor* x : {&q, &k, &v, &out1}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type() && x->dim() == 3 &&
                    x->size(0) == rows && x->size(2) == dim && x->stride(2) == 1,
                "q, k, v and out1 must be CPU tensors of q's dtype, [rows, heads, dim], contiguous dim");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && heads % k.size(1) == 0, "k and v: [rows, kv_heads, dim] alike");
  TORCH_CHECK(out1.size(1) == heads, "out1 must be [rows, heads, dim]");
  TORCH_CHECK(lse1.scalar_type() == at::kFloat && lse1.dim() == 2 && lse1.size(0) == rows && lse1.size(1) == heads,
              "lse1 must be float32 [rows, heads]");
  TORCH_CHECK(ancestors.scalar_type() == at::kLong && ancestors.dim() == 2 && ancestors.size(0) == rows &&
                  ancestors.is_contiguous(),
              "ancestors must be contiguous int64 [rows, depth]");
  TORCH_CHECK(rows == 0 || (ancestors.min().item<int64_t>() >= -1 && ancestors.max().item<int64_t>() < rows),
              "ancestors must name rows (or -1)");
  auto out = at::empty({rows, heads, dim}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    candidate_into<at::BFloat16>(q, k, v, ancestors, out1, lse1, static_cast<float>(scale), out);
  } else {
    candidate_into<float>(q, k, v, ancestors, out1, lse1, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("candidate_attention(Tensor q, Tensor k, Tensor v, Tensor ancestors, Tensor out1, Tensor lse1, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("candidate_attention", &candidate_attention); }
