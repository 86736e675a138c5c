// The float32 sums of a group of rows times one packed 64-column block, in registers: the inner
// loops of our linear's AVX512 paths (linear.cpp), shared with the LM head's fused pick
// (head_pick.cpp), which must see exactly the sums the linear rounds and stores. Include only
// under #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace xllm_linear {

constexpr int kBlockVectors = 4;  // a block's 64 columns: four vectors of 16 float32 sums
constexpr int kBlockCols = 64;

// bfloat16 (a block [K/2][64][2]): R rows (1-4) of a, each k pair loading the block's four vectors
// once and multiplying each row's pair (broadcast) into them, so a group of rows shares each load.
// (Keeping two or four sums per column apart for one row, so that more products are in flight,
// measured no faster: a row's weights come from L3 or DRAM slower than that.)
template <int R>
inline void sums_bf16(const uint16_t* a, int64_t k, const uint16_t* w, __m512 (&acc)[R][kBlockVectors]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kBlockVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[kBlockVectors];
    for (int v = 0; v < kBlockVectors; ++v)
      wv[v] = (__m512bh)_mm512_loadu_si512(w + (p * kBlockCols + v * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const auto pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * k + 2 * p));
      for (int v = 0; v < kBlockVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, wv[v]);
    }
  }
}

// float32 (a block [K][64]): each column's products summed in k order into one float32 sum, as a
// dot product would; a row broadcasts one input value a k step, a group of rows sharing each load.
template <int R>
inline void sums_f32(const float* a, int64_t k, const float* w, __m512 (&acc)[R][kBlockVectors]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kBlockVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m512 wv[kBlockVectors];
    for (int v = 0; v < kBlockVectors; ++v) wv[v] = _mm512_loadu_ps(w + i * kBlockCols + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * k + i]);
      for (int v = 0; v < kBlockVectors; ++v) acc[r][v] = _mm512_fmadd_ps(x, wv[v], acc[r][v]);
    }
  }
}

}  // namespace xllm_linear
