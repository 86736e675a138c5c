// A decode step's attention on CPU, in bfloat16 or float32: one new query per row against its own
// slab of the cache, every row in one call (model/attention.py Decode; built with cpu_kernels.cpp
// into one library). Rows whose prompts begin alike may read that prefix from one row's slab
// (`sharing`, decode_keys.h Step::source): read from memory once a layer, not once a row.
//
// Rows of a continuous batch have different lengths, and torch's fused kernel took a call per run
// of equal lengths, ~28 us each (one row, 3 key heads of 64, 256 keys): with 8 clients, 8 calls a
// layer, 240 a SmolLM2 step. Here each (row, key head) reads its keys once for all the query
// heads that share it: dot products on AVX512-BF16 (two bfloat16 products into each float32
// lane; in float32 one product a lane, by FMAs), softmax in float32, then the values weighted in
// float32. The few rows of a decode step leave nothing worth tiling, so no packing: the keys are
// read where they lie (decode_keys.h).
//
// A row's keys past kChunk (512) are cut into spans of kChunk, each its own work item (one row of
// 1024 keys and 3 key heads is 6 items, not 3 for 2 threads), merged in span order by their
// largest scores. Each row is computed apart and where its keys are cut is a constant, so its result never
// depends on the rows beside it or on the threads.
//
// Built only where the compiler targets AVX512-BF16; elsewhere the operator is absent and
// attention.py keeps torch's kernel.

#if defined(__AVX512BF16__)

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include "decode_attend.h"
#include "decode_keys.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

namespace {

using namespace xllm_decode;

template <typename T>
using Attend = void (*)(const Step<T>&, int64_t, int64_t, int64_t, int64_t, float*);

// The item's code for this many query heads a key head and this head width: compiled for widths
// of 64 and 128 (SmolLM2's, Qwen3's), else taking the width at run time.
template <typename T, int... G>
Attend<T> for_shape(int64_t group, int64_t dim, std::integer_sequence<int, G...>) {
  constexpr int step = static_cast<int>(Dot<T>::kStep);
  Attend<T> any[] = {&attend_keys<T, G + 1, 0>...};
  Attend<T> of_64[] = {&attend_keys<T, G + 1, 64 / step>...};
  Attend<T> of_128[] = {&attend_keys<T, G + 1, 128 / step>...};
  return (dim == 64 ? of_64 : dim == 128 ? of_128 : any)[group - 1];
}

// A row's spans, in order: its keys' weighted values are the spans' weighted values, each scaled
// by e^(its peak - the largest peak), summed in span order, over the spans' totals scaled alike.
template <typename T>
void merge(const Step<T>& a, int64_t row, int64_t kv_head, const float* first, int64_t spans) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim, size = group * (2 + dim);
  for (int64_t g = 0; g < group; ++g) {
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < spans; ++c) peak = std::max(peak, first[c * size + g]);
    __m512 acc[kMaxWidth / 16];
    for (int64_t d = 0; d < dim / 16; ++d) acc[d] = _mm512_setzero_ps();
    float total = 0.f;
    for (int64_t c = 0; c < spans; ++c) {
      const float* span = first + c * size;
      const float weight = std::exp(span[g] - peak);
      total += weight * span[group + g];
      const __m512 w = _mm512_set1_ps(weight);
      const float* sums = span + 2 * group + g * dim;
      for (int64_t d = 0; d < dim / 16; ++d) acc[d] = _mm512_fmadd_ps(w, _mm512_loadu_ps(sums + d * 16), acc[d]);
    }
    T* o = a.out + (row * a.heads + kv_head * group + g) * dim;
    const __m512 inverse = _mm512_set1_ps(1.f / total);
    for (int64_t d = 0; d < dim / 16; ++d) Dot<T>::store(o + d * 16, _mm512_mul_ps(acc[d], inverse));
  }
}

struct Item {
  int64_t row, kv_head, begin, end;
  int64_t slot;   // its partial's index among the call's, or -1: the row's whole attention
  int64_t merge;  // its (row, key head)'s index among the merges, or -1
};

struct Merge {
  int64_t row, kv_head, slot, spans;  // its first partial, and how many
};

// Work items: each (row, key head) whose keys fit one span is one item, a longer one an item per
// kChunk keys (the last shorter), each leaving a partial; whichever thread finishes a (row, key
// head)'s last span merges its partials, in span order. One row of 3 key heads and 1024 keys is 6
// items for 2 threads where it was 3 (one thread did 2 while the other waited). The threads claim
// items as they go (a counter, not a fixed share): on a shared machine a thread that lost its core
// a while leaves its items to the other rather than the call waiting on it. Which thread computes
// an item changes nothing in it.
template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* n,
                 const int64_t* source, const int64_t* shared, at::Tensor& out, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(1);
  const int64_t group = heads / kv_heads;
  const Step<T> a{reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(keys.data_ptr()),
                  reinterpret_cast<const T*>(values.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), n,
                  q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                  heads, kv_heads, dim, static_cast<float>(scale), source, shared};
  int64_t count = 0;
  for (int64_t row = 0; row < rows; ++row) count += kv_heads * ((n[row] + kChunk - 1) / kChunk);
  std::vector<Item> items;
  std::vector<Merge> merges;
  items.reserve(count);
  int64_t slots = 0;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (n[row] <= kChunk) {
        items.push_back({row, h, 0, n[row], -1, -1});
        continue;
      }
      const int64_t first = slots, merge = static_cast<int64_t>(merges.size());
      for (int64_t begin = 0; begin < n[row]; begin += kChunk)
        items.push_back({row, h, begin, std::min(begin + kChunk, n[row]), slots++, merge});
      merges.push_back({row, h, first, slots - first});
    }
  }
  const int64_t size = group * (2 + dim);
  std::vector<float> partials(slots * size);
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[merges.size()]);
  for (size_t m = 0; m < merges.size(); ++m) left[m].store(merges[m].spans, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const Attend<T> attend = for_shape<T>(group, a.dim, std::make_integer_sequence<int, kMaxGroup>{});
  auto run = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const Item& it = items[i];
      attend(a, it.row, it.kv_head, it.begin, it.end, it.slot < 0 ? nullptr : partials.data() + it.slot * size);
      // (acq_rel: the last span's thread sees the other spans' partials)
      if (it.merge >= 0 && left[it.merge].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        const Merge& m = merges[it.merge];
        merge(a, m.row, m.kv_head, partials.data() + m.slot * size, m.spans);
      }
    }
  };
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), count));
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
    run();
  } else {
    run();
  }
}

// q [rows, heads, dim]; keys/values [rows.., kv_heads, capacity, dim] (a slab view: tokens dim
// apart), all bfloat16 or all float32; lengths [rows] int64: the keys each row reads; sharing:
// rows that read a shared prefix from another row's copy (decode_attend.h sharing_lists) ->
// [rows, heads, dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& lengths, double scale, const std::optional<at::Tensor>& sharing) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "q, keys and values must be bfloat16 or float32");
  for (const at::Tensor* x : {&q, &keys, &values}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == dtype, "q, keys and values: CPU tensors of one dtype");
    TORCH_CHECK(x->stride(-1) == 1, "the last dimension must be contiguous");
  }
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "q [rows, heads, dim], keys/values [rows, kv_heads, capacity, dim]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(3) == dim && keys.stride(2) == dim && values.stride(2) == dim, "tokens must be dim apart");
  TORCH_CHECK(dim % 16 == 0 && dim <= kMaxWidth, "head width must be a multiple of 16, at most 256");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "at most 8 query heads a key head");
  TORCH_CHECK(keys.size(0) >= rows, "a slab per row");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == rows, "lengths: int64 [rows]");
  const int64_t* n = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(n[r] > 0 && n[r] <= keys.size(2), "a row reads 1..capacity keys");
  const int64_t *source, *shared;
  TORCH_CHECK(sharing_lists(sharing, rows, n, source, shared),
              "sharing: int64 [2, rows], sources among the rows, at most the keys both rows read");
  auto out = at::empty({rows, heads, dim}, q.options());
  if (dtype == at::kFloat) {
    attend_rows<float>(q, keys, values, n, source, shared, out, scale);
  } else {
    attend_rows<bf16>(q, keys, values, n, source, shared, out, scale);
  }
  return out;
}

}  // namespace

namespace xllm_decode {

// One (row, key head) whole on the calling thread, for the one-team step (team_step.cpp shares a
// step's items between its own threads): its spans in order, then their merge, the operator's
// arithmetic, so a row's bits are the same either way. partials: the caller's scratch, reused.
template <typename T>
void attend_item(const Step<T>& a, int64_t row, int64_t kv_head, std::vector<float>& partials) {
  const int64_t group = a.heads / a.kv_heads, n = a.lengths[row];
  const Attend<T> attend = for_shape<T>(group, a.dim, std::make_integer_sequence<int, kMaxGroup>{});
  if (n <= kChunk) {
    attend(a, row, kv_head, 0, n, nullptr);
    return;
  }
  const int64_t spans = (n + kChunk - 1) / kChunk, size = group * (2 + a.dim);
  partials.resize(spans * size);
  for (int64_t c = 0; c < spans; ++c)
    attend(a, row, kv_head, c * kChunk, std::min((c + 1) * kChunk, n), partials.data() + c * size);
  merge(a, row, kv_head, partials.data(), spans);
}

template void attend_item<bf16>(const Step<bf16>&, int64_t, int64_t, std::vector<float>&);
template void attend_item<float>(const Step<float>&, int64_t, int64_t, std::vector<float>&);

}  // namespace xllm_decode

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths, float scale, Tensor? sharing=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("decode_attention", &decode_attention); }

#endif  // __AVX512BF16__
