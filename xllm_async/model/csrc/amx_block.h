// One block product on AMX's bfloat16 tiles, through torch's brgemm micro-kernel (oneDNN's), for
// blocked_linear.h's loop: rows of activations times a block of 64 packed columns ([K/2][64][2]
// bfloat16, the pairs a tile multiplies), + bias, rounded to bfloat16. linear.cpp runs its packed
// weights through it; quant_widened.cpp runs blocks it has just widened from GGUF's quantized ones.
// Include only under #if defined(__AMX_BF16__).

#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <cstdint>

#include "avx512_bf16.h"
#include "blocked_linear.h"

namespace xllm_amx {

using xllm_blocked::kCols;
using xllm_blocked::kRows;

// Rows [0, rows) of a (k wide) times one packed block, + bias, rounded into out (n wide) from
// column n0: cols of the block's 64 are real.
struct BlockProduct {
  int64_t k, n;
  const float* bias;

  void operator()(const at::BFloat16* a, int64_t rows, const at::BFloat16* w, uint16_t* out, int64_t n0,
                  int64_t cols) const {
    alignas(64) float acc[kRows * kCols];
    at::native::cpublas::brgemm(rows, kCols, k, k, kCols, kCols, false, a, w, acc, true);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* dst = out + r * n + n0;
      const float* src = acc + r * kCols;
      for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 live = xllm_simd::lanes(cols - j);
        __m512 v = _mm512_maskz_loadu_ps(live, src + j);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + n0 + j));
        xllm_simd::store_bf16(dst + j, v, live);
      }
    }
  }

  // Other AMX code (oneDNN's primitives) loads its own tile layout without telling torch's
  // brgemm, which would then skip reloading ours: give the tiles back after every call.
  static void finish() { at::native::cpublas::brgemm_release(true); }
};

}  // namespace xllm_amx
