// Rows times one packed column block of our linear, on AVX512-BF16 (bfloat16 pairs by vdpbf16ps) or
// AVX512 FMAs (float32): linear.cpp's block products on CPUs without AMX, and the one-team step's
// (team_step.cpp), which splits a step's linears between its threads by 16-column vectors rather
// than by whole 64-column blocks. Each column's sum runs over k in the same order whichever vectors
// of its block are computed with it, so both give the same bits. Include only under
// #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx512_bf16.h"

namespace xllm_linear_rows {

constexpr int64_t kCols = 64;        // a packed block's columns
constexpr int kVectors = kCols / 16;  // four vectors of 16 float32 sums
constexpr int kRowGroup = 4;          // bfloat16: rows sharing each weight vector load (16 accumulators)
constexpr int kRowGroupF32 = 6;       // float32: 24 accumulators, the loaded vectors, one broadcast

// R rows (1-4) of a [R, k] bfloat16 times the vectors [v0, v1) of one block ([K/2][64][2]), their
// sums in registers: each k pair loads those vectors once and multiplies each row's pair
// (broadcast) into them, so a group of rows shares each load. (Keeping two or four sums per column
// apart for one row, so that more products are in flight, measured no faster: a row's weights
// come from L3 or DRAM slower than that.) Out: columns n0 + 16 v .. of rows n apart, the block's
// first `cols` real; bias (float32, or null) added before the one rounding to bfloat16.
template <int R>
void row_group(const uint16_t* a, int64_t k, const uint16_t* w, uint16_t* out, int64_t n, int64_t n0, int64_t cols,
               const float* bias, int v0 = 0, int v1 = kVectors) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = v0; v < v1; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[kVectors];
    for (int v = v0; v < v1; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (p * kCols + v * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const auto pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * k + 2 * p));
      for (int v = v0; v < v1; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, wv[v]);
    }
  }
  for (int v = v0; v < v1 && v * 16 < cols; ++v) {
    const __mmask16 live = xllm_simd::lanes(cols - v * 16);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + n0 + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) xllm_simd::store_bf16(out + r * n + n0 + v * 16, _mm512_add_ps(acc[r][v], b), live);
  }
}

// float32, on AVX512 FMAs: blocks laid out [K][64] (a k step of a block is four vectors), each
// column's products summed in k order into one float32 sum, as a dot product would. Unlike
// bfloat16 there is no pair to multiply, so a row broadcasts one input value a k step.
template <int R>
void row_group(const float* a, int64_t k, const float* w, float* out, int64_t n, int64_t n0, int64_t cols,
               const float* bias, int v0 = 0, int v1 = kVectors) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = v0; v < v1; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m512 wv[kVectors];
    for (int v = v0; v < v1; ++v) wv[v] = _mm512_loadu_ps(w + i * kCols + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * k + i]);
      for (int v = v0; v < v1; ++v) acc[r][v] = _mm512_fmadd_ps(x, wv[v], acc[r][v]);
    }
  }
  for (int v = v0; v < v1 && v * 16 < cols; ++v) {
    const __mmask16 live = xllm_simd::lanes(cols - v * 16);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + n0 + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * n + n0 + v * 16, live, _mm512_add_ps(acc[r][v], b));
  }
}

// All `rows` of a (k wide) times the vectors [v0, v1) of one block, in row groups.
template <typename T>
void block_rows(const T* a, int64_t rows, int64_t k, const T* w, T* out, int64_t n, int64_t n0, int64_t cols,
                const float* bias, int v0 = 0, int v1 = kVectors) {
  constexpr int group = sizeof(T) == 2 ? kRowGroup : kRowGroupF32;
  int64_t r = 0;
  for (; r + group <= rows; r += group) row_group<group>(a + r * k, k, w, out + r * n, n, n0, cols, bias, v0, v1);
  switch (rows - r) {
    case 5: row_group<5>(a + r * k, k, w, out + r * n, n, n0, cols, bias, v0, v1); break;
    case 4: row_group<4>(a + r * k, k, w, out + r * n, n, n0, cols, bias, v0, v1); break;
    case 3: row_group<3>(a + r * k, k, w, out + r * n, n, n0, cols, bias, v0, v1); break;
    case 2: row_group<2>(a + r * k, k, w, out + r * n, n, n0, cols, bias, v0, v1); break;
    case 1: row_group<1>(a + r * k, k, w, out + r * n, n, n0, cols, bias, v0, v1); break;
    default: break;
  }
}

// One thread's share of a linear, a [rows, k] times a packed weight of n columns into out [rows, n]:
// the 16-column vectors [V t / T, V (t + 1) / T) of the V = ceil(n / 16) real ones, block by block.
// (A one-row step's o and down projections are 9 blocks: split by blocks, one thread read 5 of
// them while the other read 4.)
template <typename T>
void share_of_linear(const T* a, int64_t rows, int64_t k, const T* packed, T* out, int64_t n, const float* bias,
                     int thread, int threads) {
  const int64_t vectors = (n + 15) / 16;
  const int64_t first = vectors * thread / threads, last = vectors * (thread + 1) / threads;
  for (int64_t b = first / kVectors; b * kVectors < last; ++b) {
    const int v0 = static_cast<int>(std::max<int64_t>(first - b * kVectors, 0));
    const int v1 = static_cast<int>(std::min<int64_t>(last - b * kVectors, kVectors));
    block_rows(a, rows, k, packed + b * k * kCols, out, n, b * kCols, std::min(kCols, n - b * kCols), bias, v0, v1);
  }
}

}  // namespace xllm_linear_rows
