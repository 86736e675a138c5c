// A decode step's attention on CPU, in bfloat16 or float32: one new query per row against its own
// slab of the cache, every row in one call (model/attention.py Decode; built with cpu_kernels.cpp
// into one library).
//
// Rows of a continuous batch have different lengths, and torch's fused kernel took a call per run
// of equal lengths, ~28 us each (one row, 3 key heads of 64, 256 keys): with 8 clients, 8 calls a
// layer, 240 a SmolLM2 step. Here each (row, key head) reads its keys once for all the query
// heads that share it: dot products on AVX512-BF16 (two bfloat16 products into each float32
// lane; in float32 one product a lane, by FMAs), softmax in float32, then the values weighted in
// float32. The few rows of a decode step
// leave nothing worth tiling, so no packing: the keys are read where they lie.
//
// Each row is computed apart, so its result never depends on the rows beside it.
//
// Built only where the compiler targets AVX512-BF16; elsewhere the operator is absent and
// attention.py keeps torch's kernel.

#if defined(__AVX512BF16__)

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include "avx512_bf16.h"
#include "decode_attend.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using bf16 = uint16_t;

constexpr int kMaxGroup = 8;    // query heads a key head may serve here
constexpr int kMaxWidth = 256;  // head width

inline __m512bh load_pairs(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// What a dot-product step is in each element type (T: bf16 or float): a vector of 32 bfloat16
// values (16 pairs) or of 16 floats, and the products it adds into 16 float32 lanes.
template <typename T>
struct Dot;

template <>
struct Dot<bf16> {
  using Vector = __m512bh;
  static constexpr int64_t kStep = 32;
  static Vector load(const bf16* p) { return load_pairs(p); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_dpbf16_ps(acc, a, b); }
  static __m512 widen(const bf16* p) { return xllm_simd::load_bf16(p, 0xFFFF); }
  static void store(bf16* p, __m512 x) { xllm_simd::store_bf16(p, x, 0xFFFF); }
};

template <>
struct Dot<float> {
  using Vector = __m512;
  static constexpr int64_t kStep = 16;
  static Vector load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_fmadd_ps(a, b, acc); }
  static __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
};

using xllm_decode::Slabs;  // the step's tensors as pointers and strides (decode_attend.h)

// v[i]'s 16 lanes summed, for each i: lane i of the result. Pairs of vectors, then pairs of those,
// fold their lanes together (unpack, then 128-bit lane shuffles): 15 additions for 16 sums.
inline __m512 sum16(const __m512 v[16]) {
  __m512 s[8], t[4], w[2];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: its four floats' sum for v[4i] .. v[4i+3]
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // [t0's lanes 0+1, t0's 2+3, t1's 0+1, t1's 2+3] (and t2, t3)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// One row and one key head: its `group` query heads against the row's first n keys.
template <typename T>
void attend_row(const Slabs& a, int64_t row, int64_t kv_head, std::vector<float>& scores) {
  using D = Dot<T>;
  const int64_t group = a.heads / a.kv_heads, dim = a.dim, n = a.lengths[row];
  const int64_t chunks = dim / D::kStep;
  scores.resize(group * n);
  const T* keys = static_cast<const T*>(a.keys) + row * a.k_row + kv_head * a.k_head;
  const T* values = static_cast<const T*>(a.values) + row * a.v_row + kv_head * a.v_head;
  typename D::Vector q[kMaxGroup][kMaxWidth / D::kStep];
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = static_cast<const T*>(a.q) + row * a.q_row + (kv_head * group + g) * a.q_head;
    for (int64_t c = 0; c < chunks; ++c) q[g][c] = D::load(qg + c * D::kStep);
  }
  // Scores 16 keys at a time: each key's dot product with a query head is a vector of partial
  // sums, and 16 of them reduce together into one vector of 16 scores (sum16), where reducing each
  // on its own cost most of the step (a horizontal sum per key and query head). A query head's 16
  // keys are read from L1 once per head of the group.
  __m512 peaks[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) peaks[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __mmask16 live = xllm_simd::lanes(n - j0);
    const T* kj[16];
    for (int64_t j = 0; j < 16; ++j) kj[j] = keys + std::min(j0 + j, n - 1) * dim;  // (past n: the last, masked)
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[16];
      for (int64_t j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) acc[j] = D::add(acc[j], D::load(kj[j] + c * D::kStep), q[g][c]);
      }
      const __m512 s = _mm512_mul_ps(sum16(acc), scale);
      _mm512_mask_storeu_ps(scores.data() + g * n + j0, live, s);
      peaks[g] = _mm512_mask_max_ps(peaks[g], live, peaks[g], s);
    }
  }
  float peak[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) peak[g] = _mm512_reduce_max_ps(peaks[g]);
  float total[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    __m512 sum = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(peak[g]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = xllm_simd::lanes(n - j);
      __m512 e = _mm512_maskz_mov_ps(live, xllm_simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + j), shift)));
      _mm512_mask_storeu_ps(sg + j, live, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  const int64_t vectors = dim / 16;
  __m512 out[kMaxGroup][kMaxWidth / 16];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < vectors; ++d) out[g][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = values + j * dim;
    for (int64_t d = 0; d < vectors; ++d) {
      __m512 v = D::widen(vj + d * 16);
      for (int64_t g = 0; g < group; ++g) out[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + j]), v, out[g][d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    T* o = static_cast<T*>(a.out) + (row * a.heads + kv_head * group + g) * dim;
    const __m512 inverse = _mm512_set1_ps(1.f / total[g]);
    for (int64_t d = 0; d < vectors; ++d) D::store(o + d * 16, _mm512_mul_ps(out[g][d], inverse));
  }
}

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* n,
                 at::Tensor& out, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(1);
  const Slabs a{q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), n, q.stride(0), q.stride(1),
                keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), heads, kv_heads, dim,
                static_cast<float>(scale)};
  const int64_t items = rows * kv_heads;
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; item += step) attend_row<T>(a, item / kv_heads, item % kv_heads, scores);
  };
  xllm_parallel::interleaved_items(items, run);
}

// q [rows, heads, dim]; keys/values [rows.., kv_heads, capacity, dim] (a slab view: tokens dim
// apart), all bfloat16 or all float32; lengths [rows] int64: the keys each row reads ->
// [rows, heads, dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& lengths, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "q, keys and values must be bfloat16 or float32");
  for (const at::Tensor* x : {&q, &keys, &values}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == dtype, "q, keys and values: CPU tensors of one dtype");
    TORCH_CHECK(x->stride(-1) == 1, "the last dimension must be contiguous");
  }
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "q [rows, heads, dim], keys/values [rows, kv_heads, capacity, dim]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(3) == dim && keys.stride(2) == dim && values.stride(2) == dim, "tokens must be dim apart");
  TORCH_CHECK(dim % 32 == 0 && dim <= kMaxWidth, "head width must be a multiple of 32, at most 256");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "at most 8 query heads a key head");
  TORCH_CHECK(keys.size(0) >= rows, "a slab per row");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == rows, "lengths: int64 [rows]");
  const int64_t* n = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(n[r] > 0 && n[r] <= keys.size(2), "a row reads 1..capacity keys");
  auto out = at::empty({rows, heads, dim}, q.options());
  if (dtype == at::kFloat) {
    attend_rows<float>(q, keys, values, n, out, scale);
  } else {
    attend_rows<bf16>(q, keys, values, n, out, scale);
  }
  return out;
}

}  // namespace

namespace xllm_decode {

template <typename T>
void attend_item(const Slabs& a, int64_t row, int64_t kv_head, std::vector<float>& scores) {
  attend_row<T>(a, row, kv_head, scores);
}

template void attend_item<bf16>(const Slabs&, int64_t, int64_t, std::vector<float>&);
template void attend_item<float>(const Slabs&, int64_t, int64_t, std::vector<float>&);

}  // namespace xllm_decode

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("decode_attention", &decode_attention); }

#endif  // __AVX512BF16__
