// What the quantized linear's two paths read (quant_linear.cpp's AVX512-VNNI loop, and
// quant_widened.cpp's widening onto AMX tiles): GGUF's blocks as the weight is packed for them,
// and the activations rounded to int8 blocks for the VNNI loop.
//
// The weight is packed once (quantized.py, QuantWeight.packed) into tiles of 16 output columns,
// one int32 lane each, in groups of four tiles (64 columns; zero columns pad the last group). A
// group's block is the 64 columns' float16 d (then their m, for Q4_1), then each tile's quants,
// four inputs a lane: Q8_0 as 8 vectors of [16 columns][4 inputs] (inputs 4g..4g+3 in vector g);
// Q4 as 4 vectors of bytes as GGUF has them (low nibble input i, high input i + 16), vector v
// holding inputs 4v..4v+3 low and 16+4v.. high. The same bytes as the file's blocks, every vector
// on a cache line of its own, and a group's blocks one stream through memory.
//
// Include only under #if defined(__AVX512BF16__) && defined(__AVX512VNNI__).

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <string>

#include "avx512_bf16.h"

namespace xllm_quant {

constexpr int64_t kTile = 16;   // output columns a tile interleaves
constexpr int64_t kGroup = 4;   // tiles a group interleaves
constexpr int64_t kBlock = 32;  // inputs a block quantizes together

enum Kind { kQ8_0, kQ4_0, kQ4_1 };

inline Kind kind_of(const std::string& name) {
  if (name == "q8_0") return kQ8_0;
  if (name == "q4_0") return kQ4_0;
  TORCH_CHECK(name == "q4_1", "quant_linear: unknown format ", name);
  return kQ4_1;
}

// Bytes of a group's block: the scales (and mins), then each tile's quants.
constexpr int64_t scale_bytes(Kind k) { return (k == kQ4_1 ? 2 : 1) * kGroup * kTile * 2; }
constexpr int64_t quant_bytes(Kind k) { return kTile * (k == kQ8_0 ? kBlock : kBlock / 2); }
constexpr int64_t record_bytes(Kind k) { return scale_bytes(k) + kGroup * quant_bytes(k); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return xllm_simd::load_bf16(reinterpret_cast<const uint16_t*>(p), static_cast<__mmask16>(0xFFFF));
}

template <typename T>
void quantize_row(const T* x, int64_t blocks, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = load16(x + b * kBlock), hi = load16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // to nearest, ties to even
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    d[b] = amax / 127.f;
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

// The activations rounded to int8 blocks: q [m][k], and per block its scale and its sum; rounded
// by the thread that calls, or, for many rows (shared), by every thread of the product's parallel
// region before it starts: one region a call, where two made each call wait twice for the threads.
struct Activations {
  int8_t* q;
  float* d;
  int32_t* s;
  int64_t blocks;  // per row
  const void* x;   // the rows: float32, or bfloat16 where !f32
  bool f32;
  bool shared;

  void round_rows(int64_t first, int64_t rows, int64_t step) const {
    const int64_t k = blocks * kBlock;
    for (int64_t r = first; r < rows; r += step) {
      if (f32) {
        quantize_row(static_cast<const float*>(x) + r * k, blocks, q + r * k, d + r * blocks, s + r * blocks);
      } else {
        quantize_row(static_cast<const at::BFloat16*>(x) + r * k, blocks, q + r * k, d + r * blocks,
                     s + r * blocks);
      }
    }
  }
};

// The path for a prompt's bfloat16 rows on AMX (quant_widened.cpp): whether `m` rows take it,
// and x [m, k] times the packed groups, + bias, into out [m, n] there.
bool widens(int64_t m, bool f32);
void widened(Kind kind, const at::BFloat16* x, int64_t m, int64_t k, const uint8_t* w, int64_t groups,
             const float* bias, uint16_t* out, int64_t n);

}  // namespace xllm_quant
