// Causal attention over packed prompts in bfloat16 or float32 on CPU, one call for a whole batch
// (model/attention.py PackedPrefill; built with cpu_kernels.cpp into one library).
//
// torch's fused CPU attention took a third of a bfloat16 prefill here (16 x 320 tokens, head
// width 32: 7.6 ms a layer, Intel Xeon with AMX). Three costs made it:
// - it computes its blocks of scores whole, so a causal prompt shorter than its key block (512)
//   pays for all its L^2 scores where L^2/2 are used;
// - prompts of different lengths are a call per length, each padded to a multiple of 16 tokens
//   (attention.py, ATTENTION_MULTIPLE) with a copy of its queries, keys and values;
// - the softmax between its two products is a few passes over the block of scores.
// Here, for each prompt and key head, keys and values are packed once into the layout AMX's
// tile product takes, then blocks of 16 query rows (all the query heads that share the key head)
// go over exactly the keys they may see, in whole tiles: scores (one tile product), softmax in
// float32 on 16 lanes, probabilities rounded to bfloat16 as torch rounds them, then their sum of
// values (a second tile product). Each prompt's rows are computed apart from the others', so a
// prompt's result never depends on the batch around it. 16 x 320 tokens: 4.2 ms a layer.
//
// Two ways to compute a block's products, picked when the library is compiled (-march=native):
// - bfloat16 on CPUs with AMX: tile products (block_amx);
// - bfloat16 on CPUs with AVX512-BF16 but no AMX (AMD EPYC Zen 4/5 here), and float32 on every
//   CPU the library is built for: products on 16 float32 lanes (block_lanes), dot products of
//   bfloat16 pairs over the same packed keys and values, FMAs over float32 ones.
// Elsewhere the operators are absent and attention.py keeps torch's kernel (an AVX512-BF16
// version measured slower than torch's kernel with AMX on the Intel Xeon, so CPUs with AMX keep
// the tiles).
//
// The kernel's parts are headers that the operators over cached prefixes (cached_attention.cpp)
// and a beam round's prompt stage (prefix_attention.cpp) share: the packed layouts
// (attention_packing.h), the softmax (attention_softmax.h), a block's products on AMX tiles
// (attention_amx.h) or on lanes (attention_lanes.h), and a key head's rows block by block
// (attention_rows.h). This file is the prefill operator: varlen_attention.

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
void varlen_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                 const std::vector<int64_t>& starts, float scale, bool last_only, at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  Packed<T> a{elements<T>(q), elements<T>(k), elements<T>(v), reinterpret_cast<T*>(out.data_ptr()),
              q.stride(0), k.stride(0), v.stride(0), heads, kv_heads, dim, wide_for<T>(dim), scale};
  const std::vector<QueryPiece> pieces =
      query_pieces(lengths, lengths, kv_heads, heads / kv_heads, last_only, xllm_parallel::available_threads());
  xllm_parallel::claimed_items(static_cast<int64_t>(pieces.size()), [&](const auto& take) {
    Worker<T> w;
    for (int64_t item; (item = take()) >= 0;) {
      const QueryPiece& p = pieces[item];
      const int64_t n = lengths[p.seq], start = starts[p.seq];
      const KeySpan<T> kv{a.k + start * a.k_stride + p.head * dim, a.v + start * a.v_stride + p.head * dim, a.k_stride,
                          a.v_stride};
      attend_one(a, w.s, kv, n, start, n, p.head, p.first, p.end, last_only ? p.seq : start + p.first);
    }
  });
}

// q [tokens, heads, dim], k/v [tokens, kv_heads, dim] (any token stride), prompts of `lengths`
// packed end to end -> [tokens, heads, dim], or [prompts, heads, dim] for each one's last token;
// all bfloat16 or all float32.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                            double scale, bool last_only) {
  const int64_t dim = q.size(-1);
  check_dtype(q);
  check_tokens(q, "q", dim, q);
  check_tokens(k, "k", dim, q);
  check_tokens(v, "v", dim, q);
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  const bool half = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && v.size(1) == kv_heads, "query heads must group over key heads");
  TORCH_CHECK(!half || k.stride(0) % 2 == 0, "bfloat16 keys are gathered in pairs: their token stride must be even");
  std::vector<int64_t> starts;
  int64_t total = 0;
  for (int64_t n : lengths) {
    TORCH_CHECK(n > 0, "every prompt needs a token");
    starts.push_back(total);
    total += n;
  }
  TORCH_CHECK(total == tokens && k.size(0) >= tokens && v.size(0) >= tokens, "lengths must add up to the tokens");
  auto out = at::empty({last_only ? static_cast<int64_t>(starts.size()) : tokens, heads, dim}, q.options());
  if (half) {
    TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
    varlen_into<bf16>(q, k, v, lengths, starts, static_cast<float>(scale), last_only, out);
  } else {
    varlen_into<float>(q, k, v, lengths, starts, static_cast<float>(scale), last_only, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, int[] lengths, float scale, bool last_only) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("varlen_attention", &varlen_attention); }

#endif  // __AVX512BF16__
