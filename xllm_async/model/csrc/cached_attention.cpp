// Causal attention for prompts whose first keys came from the prefix cache (model/prefix_cache.py,
// model/attention.py PackedPrefill with a cache), bfloat16 or float32 on CPU, one call for a whole
// batch: each prompt's new queries against its cache rows, the cached keys and its own, so that
// every query's sums are those varlen_attention (varlen_attention.cpp, whose blocks this runs:
// attention_rows.h) gives the same token of the whole prompt.

#if defined(__AVX512BF16__)

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "attention_rows.h"
#include "parallel.h"

namespace {

using namespace xllm_attention;

template <typename T>
void cached_into(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::IntArrayRef q_lengths,
                 at::IntArrayRef kv_lengths, const std::vector<int64_t>& starts, float scale, bool last_only,
                 at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = keys.size(1), dim = q.size(2);
  Packed<T> a{elements<T>(q), nullptr, nullptr, reinterpret_cast<T*>(out.data_ptr()), q.stride(0), 0, 0, heads,
              kv_heads, dim, wide_for<T>(dim), scale};
  const std::vector<QueryPiece> pieces =
      query_pieces(q_lengths, kv_lengths, kv_heads, heads / kv_heads, last_only, xllm_parallel::available_threads());
  xllm_parallel::claimed_items(static_cast<int64_t>(pieces.size()), [&](const auto& take) {
    Worker<T> w;
    for (int64_t item; (item = take()) >= 0;) {
      const QueryPiece& p = pieces[item];
      const int64_t n = q_lengths[p.seq], start = starts[p.seq];
      const KeySpan<T> kv{elements<T>(keys) + p.seq * keys.stride(0) + p.head * keys.stride(1),
                          elements<T>(values) + p.seq * values.stride(0) + p.head * values.stride(1), dim, dim};
      attend_one(a, w.s, kv, kv_lengths[p.seq], start, n, p.head, p.first, p.end, last_only ? p.seq : start + p.first);
    }
  });
}

// Prompts whose first keys came from the prefix cache: q [tokens, heads, dim] holds only each
// prompt's last q_lengths[i] tokens, packed end to end; keys/values [prompts, kv_heads, capacity,
// dim] are their cache rows (tokens contiguous, any row and head stride), kv_lengths[i] keys each,
// the new ones already written -> [tokens, heads, dim], or [prompts, heads, dim] for each one's
// last token. Each query's sums are those varlen_attention gives the same token of the whole prompt.
at::Tensor varlen_attention_cached(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                   at::IntArrayRef q_lengths, at::IntArrayRef kv_lengths, double scale,
                                   bool last_only) {
  const int64_t dim = q.size(-1);
  check_dtype(q);
  check_tokens(q, "q", dim, q);
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  const int64_t prompts = static_cast<int64_t>(q_lengths.size());
  for (const at::Tensor* x : {&keys, &values}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type(),
                "keys and values must be CPU tensors of q's dtype");
    TORCH_CHECK(x->dim() == 4 && x->size(3) == dim && x->stride(3) == 1 && x->stride(2) == dim &&
                    x->sizes() == keys.sizes() && x->size(0) >= prompts,
                "keys and values must be [prompts, kv_heads, capacity, dim] alike with contiguous tokens");
  }
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = keys.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must group over key heads");
  TORCH_CHECK(static_cast<int64_t>(kv_lengths.size()) == prompts, "a key length for every prompt");
  std::vector<int64_t> starts;
  int64_t total = 0;
  for (int64_t i = 0; i < prompts; ++i) {
    TORCH_CHECK(q_lengths[i] > 0, "every prompt needs a token");
    TORCH_CHECK(kv_lengths[i] >= q_lengths[i] && kv_lengths[i] <= keys.size(2),
                "a prompt's keys are its queries and what precedes them, within the cache's capacity");
    starts.push_back(total);
    total += q_lengths[i];
  }
  TORCH_CHECK(total == tokens, "query lengths must add up to the tokens");
  auto out = at::empty({last_only ? prompts : tokens, heads, dim}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
    cached_into<bf16>(q, keys, values, q_lengths, kv_lengths, starts, static_cast<float>(scale), last_only, out);
  } else {
    cached_into<float>(q, keys, values, q_lengths, kv_lengths, starts, static_cast<float>(scale), last_only, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("varlen_attention_cached(Tensor q, Tensor keys, Tensor values, int[] q_lengths, int[] kv_lengths, "
        "float scale, bool last_only) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("varlen_attention_cached", &varlen_attention_cached); }

#endif  // __AVX512BF16__
