// The packed attention kernels' layouts (varlen_attention.cpp, cached_attention.cpp,
// prefix_attention.cpp): a call's tensors, a thread's scratch, a block of query rows, and one key
// head's keys and values packed once into the layout the block products take (AMX tiles or
// AVX512 lanes, attention_amx.h and attention_lanes.h).
// Include only under #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_bf16.h"

namespace xllm_attention {

using bf16 = uint16_t;

constexpr int kTileRows = 16;   // a tile's rows
constexpr int kBlockRows = 32;  // query rows a block: two tiles of them
constexpr int kKeys = 16;  // keys a score vector holds (16 float32 lanes)

// T: bf16 or float, the element type of queries, keys, values and outputs.
template <typename T>
struct Packed {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t q_stride, k_stride, v_stride;  // between tokens
  int64_t heads, kv_heads, dim;
  int64_t wide;  // bfloat16: dim rounded up to 32, the packed layouts' width, zeros past dim; float32: dim
  float scale;
};

// Scratch for one sequence and key head, reused by a thread across them.
template <typename T>
struct Scratch {
  std::vector<T> keys, values, probs, queries;
  std::vector<float> scores;

  void fit(int64_t padded, int64_t wide) {
    keys.resize(padded * wide);
    values.resize(padded * wide);
    probs.resize(kBlockRows * padded);
    scores.resize(kBlockRows * padded);
    queries.resize(kBlockRows * wide);
  }
};

// Where the rows of a block come from and go to: row i of a sequence's (position, head of the
// group) rows, position-major, from query position `first` on.
template <typename T>
struct Block {
  T* out[kBlockRows];
  float* lse[kBlockRows];    // where a row's log-sum-exp goes (the prompt stage of a beam round), or null
  int64_t seen[kBlockRows];  // keys the row may see (causal: its position + 1; a prompt stage: all)
  int rows;                 // real rows; the rest repeat the last one and are not written
  int64_t span;             // keys the block's last row sees
};

// One key head's keys and values: token j's at k + j * k_stride and v + j * v_stride.
template <typename T>
struct KeySpan {
  const T* k;
  const T* v;
  int64_t k_stride, v_stride;
};

// Bfloat16: keys as [block of 16][dim pair][key][2] (a dim pair of 16 keys is one vector, or one
// row of an AMX tile), values as [key pair][dim][2] (16 dims of two keys), both `wide` dims wide
// and zero past `length` up to `padded` (a multiple of 32).
inline void pack(const Packed<bf16>& a, Scratch<bf16>& s, const KeySpan<bf16>& kv, int64_t length, int64_t padded) {
  const int64_t dim = a.dim, wide = a.wide;
  // Keys: a dim pair of 16 keys is one gather (16 scalar copies a pair took a sixth of the time).
  bf16* kp = s.keys.data();
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(kv.k_stride / 2)));
  for (int64_t j = 0; j < padded; j += kKeys) {
    bf16* dst = kp + (j / kKeys) * wide * kKeys;
    const int64_t left = length - j;
    if (left <= 0) {
      std::memset(dst, 0, wide * kKeys * sizeof(bf16));
      continue;
    }
    const __mmask16 live = xllm_simd::lanes(left);
    const int32_t* src = reinterpret_cast<const int32_t*>(kv.k + j * kv.k_stride);
    for (int64_t p = 0; p < wide / 2; ++p) {
      __m512i pair = p < dim / 2 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, src + p, 4)
                                 : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * 2 * kKeys, pair);
    }
  }
  // Values: two keys' 32 dims interleaved by two permutes a step.
  bf16* vp = s.values.data();
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < padded; j += 2) {
    bf16* dst = vp + (j / 2) * wide * 2;
    for (int64_t d = 0; d < wide; d += 32) {
      const __mmask32 live = dim - d >= 32 ? ~0u : (1u << (dim - d)) - 1;
      __m512i first = j < length ? _mm512_maskz_loadu_epi16(live, kv.v + j * kv.v_stride + d) : _mm512_setzero_si512();
      __m512i second =
          j + 1 < length ? _mm512_maskz_loadu_epi16(live, kv.v + (j + 1) * kv.v_stride + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(first, low, second));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(first, high, second));
    }
  }
}

// Float32 (AVX512-BF16 implies AVX512F): torch's fused kernel in float32 was a third of a prefill
// here (16 x 320 tokens of the 4-layer model: 0.91 ms a prompt-layer, perf/RESULTS.md,
// seventeenth session). Keys as [block of 16 keys][dim][key] (a dim of 16 keys is one vector),
// values as [key][dim], zero past `length` up to `padded`.
inline void pack(const Packed<float>& a, Scratch<float>& s, const KeySpan<float>& kv, int64_t length, int64_t padded) {
  const int64_t dim = a.dim;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(kv.k_stride)));
  for (int64_t j = 0; j < padded; j += kKeys) {
    float* dst = s.keys.data() + j * dim;
    const int64_t left = length - j;
    if (left <= 0) {
      std::memset(dst, 0, kKeys * dim * sizeof(float));
      continue;
    }
    const __mmask16 live = xllm_simd::lanes(left);
    const float* src = kv.k + j * kv.k_stride;
    for (int64_t d = 0; d < dim; ++d)
      _mm512_storeu_ps(dst + d * kKeys, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows, src + d, 4));
  }
  float* vp = s.values.data();
  for (int64_t j = 0; j < length; ++j) std::memcpy(vp + j * dim, kv.v + j * kv.v_stride, dim * sizeof(float));
  std::memset(vp + length * dim, 0, (padded - length) * dim * sizeof(float));
}

}  // namespace xllm_attention
