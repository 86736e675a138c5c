// A beam round's prompt stage on CPU, bfloat16 or float32: every beam of a request against all of
// its prompt's keys, no mask, with each row's log-sum-exp to merge with the beams' own tokens
// (model/attention.py BeamDecode). The same blocks as the packed prefill (varlen_attention.cpp,
// attention_rows.h), a key head's keys packed once for all its beams.

#if defined(__AVX512BF16__)

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "attention_rows.h"
#include "parallel.h"

namespace {

using namespace xllm_attention;

template <typename T>
void prefix_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& out,
                 at::Tensor& lse) {
  const int64_t beams = q.size(0), heads = q.size(1), kv_heads = k.size(0), length = k.size(1), dim = q.size(2);
  Packed<T> a{elements<T>(q), nullptr, nullptr, reinterpret_cast<T*>(out.data_ptr()), q.stride(0), 0, 0, heads,
              kv_heads, dim, wide_for<T>(dim), scale};
  float* lse_at = lse.data_ptr<float>();
  const int64_t group = heads / kv_heads, padded = (length + 31) / 32 * 32;
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    Worker<T> w;
    w.s.fit(padded, a.wide);
    for (int64_t kv_head = begin; kv_head < end; kv_head += step) {
      pack(a, w.s, {elements<T>(k) + kv_head * k.stride(0), elements<T>(v) + kv_head * v.stride(0), dim, dim}, length,
           padded);
      attend_rows(a, w.s, beams * group, [&](int64_t row, Block<T>& b, int i) {
        int64_t beam = row / group, head = kv_head * group + row % group;
        copy_query(a, w.s, i, a.q + beam * a.q_stride + head * dim);
        b.out[i] = a.out + (beam * heads + head) * dim;
        b.lse[i] = lse_at + beam * heads + head;
        b.seen[i] = length;
      });
    }
  };
  xllm_parallel::interleaved_items(kv_heads, run);
}

// A beam round's prompt stage: every beam of a request (q [beams, heads, dim], any beam stride)
// against all of the request's prompt keys k/v [kv_heads, length, dim] (a cache slab: tokens
// contiguous, any head stride), no mask -> (out [beams, heads, dim], and each row's log-sum-exp
// [beams, heads] in float32, to merge with the beams' own tokens). All beams of a key head share
// one packing of its keys and values: 128 beams x 2 heads are 8 blocks of 32 rows against it.
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale) {
  const int64_t dim = q.size(-1);
  check_dtype(q);
  check_tokens(q, "q", dim, q);
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type(),
                "k and v must be CPU tensors of q's dtype");
    TORCH_CHECK(x->dim() == 3 && x->size(2) == dim && x->stride(2) == 1 && x->stride(1) == dim &&
                    x->sizes() == k.sizes(),
                "k and v must be [kv_heads, tokens, dim] alike with contiguous tokens");
  }
  const int64_t beams = q.size(0), heads = q.size(1), kv_heads = k.size(0), length = k.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must group over key heads");
  TORCH_CHECK(length > 0, "the prompt needs a token");
  auto out = at::empty({beams, heads, dim}, q.options());
  auto lse = at::empty({beams, heads}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
    prefix_into<bf16>(q, k, v, static_cast<float>(scale), out, lse);
  } else {
    prefix_into<float>(q, k, v, static_cast<float>(scale), out, lse);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("prefix_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("prefix_attention", &prefix_attention); }

#endif  // __AVX512BF16__
