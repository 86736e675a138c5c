// Rows times one packed column block of our linear, on AVX512-BF16 (bfloat16 pairs by vdpbf16ps) or
// AVX512 FMAs (float32): linear.cpp's block products on CPUs without AMX, and the one-team step's
// (team_step.cpp), which splits a step's linears between its threads by 16-column vectors rather
// than by whole 64-column blocks. Each column's sum runs over k in the same order whichever vectors
// of its block are computed with it, so both give the same bits. The vectors a call computes are a
// template parameter: with a count known only at run time the sums left the registers. Include only under
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

// The float32 sums of R rows (1-6) of a [R, k] times V (1-4) vectors of one block, in registers (the
// linear rounds and stores them, head_pick.cpp keeps their best); w: the block from its first
// vector wanted. bfloat16 (a block [K/2][64][2]): each k pair loads the vectors once and multiplies
// each row's pair (broadcast) into them, so a group of rows shares each load. (Keeping two or four
// sums per column apart for one row, so that more products are in flight, measured no faster: a
// row's weights come from L3 or DRAM slower than that.)
template <int R, int V>
inline void sums(const uint16_t* a, int64_t k, const uint16_t* w, __m512 (&acc)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (p * kCols + v * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const auto pair = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * k + 2 * p));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, wv[v]);
    }
  }
}

// float32 (a block [K][64]): each column's products summed in k order into one float32 sum, as a
// dot product would; no pair to multiply, so a row broadcasts one input value a k step.
template <int R, int V>
inline void sums(const float* a, int64_t k, const float* w, __m512 (&acc)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m512 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(w + i * kCols + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * k + i]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(x, wv[v], acc[r][v]);
    }
  }
}

inline void store_row(uint16_t* out, __m512 x, __mmask16 live) { xllm_simd::store_bf16(out, x, live); }
inline void store_row(float* out, __m512 x, __mmask16 live) { _mm512_mask_storeu_ps(out, live, x); }

// R rows of a times V vectors of one block (w from the first of them) into out from column n0 (rows
// n apart; `cols` of them real): the sums, the bias (float32, or null) added, each rounded once to T.
template <int R, int V, typename T>
void row_group(const T* a, int64_t k, const T* w, T* out, int64_t n, int64_t n0, int64_t cols, const float* bias) {
  __m512 acc[R][V];
  sums<R, V>(a, k, w, acc);
  for (int v = 0; v < V && v * 16 < cols; ++v) {
    const __mmask16 live = xllm_simd::lanes(cols - v * 16);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + n0 + v * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store_row(out + r * n + n0 + v * 16, _mm512_add_ps(acc[r][v], b), live);
  }
}

// All `rows` of a (k wide) times V vectors of one block, in row groups.
template <int V, typename T>
void vector_rows(const T* a, int64_t rows, int64_t k, const T* w, T* out, int64_t n, int64_t n0, int64_t cols,
                 const float* bias) {
  constexpr int group = sizeof(T) == 2 ? kRowGroup : kRowGroupF32;
  int64_t r = 0;
  for (; r + group <= rows; r += group) row_group<group, V>(a + r * k, k, w, out + r * n, n, n0, cols, bias);
  switch (rows - r) {
    case 5: row_group<5, V>(a + r * k, k, w, out + r * n, n, n0, cols, bias); break;
    case 4: row_group<4, V>(a + r * k, k, w, out + r * n, n, n0, cols, bias); break;
    case 3: row_group<3, V>(a + r * k, k, w, out + r * n, n, n0, cols, bias); break;
    case 2: row_group<2, V>(a + r * k, k, w, out + r * n, n, n0, cols, bias); break;
    case 1: row_group<1, V>(a + r * k, k, w, out + r * n, n, n0, cols, bias); break;
    default: break;
  }
}

// All `rows` of a times the vectors [v0, v1) of one block (its first `cols` columns real, from n0):
// a whole block in one pass, a part of one vector by vector. Defined once, out of line
// (linear_rows.cpp): linear.cpp's products and the team step's run the same machine code (built
// with -ffast-math, copies inlined into each caller need not add in one order).
template <typename T>
void block_rows(const T* a, int64_t rows, int64_t k, const T* w, T* out, int64_t n, int64_t n0, int64_t cols,
                const float* bias, int v0 = 0, int v1 = kVectors);

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
