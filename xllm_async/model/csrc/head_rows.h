// The LM head's row groups for the fused picks (head_pick.cpp's argmax, head_topk.cpp's top-k):
// a group's sums are the linear's own (linear_rows.h), bfloat16 ones rounded as the linear rounds
// its outputs (its bias is zero here: + 0 changes no value), and handed to the including file's
// keep<R>(sums, n0, cols, sink), found by argument lookup on the sink's type; sink.rows_from(r) is
// the sink from row r on.
#pragma once

#include <cstdint>

#include "avx512_bf16.h"
#include "linear_rows.h"

namespace xllm_head_rows {

using xllm_linear_rows::kVectors;

#if !defined(__AMX_BF16__)
template <int R, typename Sink>
void group_bf16(const uint16_t* a, int64_t k, const uint16_t* w, int64_t n0, int64_t cols, const Sink& sink) {
  __m512 sums[R][kVectors];
  xllm_linear_rows::sums<R, kVectors>(a, k, w, sums);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) sums[r][v] = xllm_simd::round_bf16(sums[r][v]);
  keep<R>(sums, n0, cols, sink);
}

template <typename Sink>
struct Bf16 {  // row groups of 4, as the linear's bfloat16 loop
  int64_t k;
  void operator()(const void* a_, int64_t rows, const void* w_, const Sink& sink, int64_t n0, int64_t cols) const {
    const auto* a = static_cast<const uint16_t*>(a_);
    const auto* w = static_cast<const uint16_t*>(w_);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) group_bf16<4>(a + r * k, k, w, n0, cols, sink.rows_from(r));
    switch (rows - r) {
      case 3: group_bf16<3>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      case 2: group_bf16<2>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      case 1: group_bf16<1>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      default: break;
    }
  }
};
#endif

template <int R, typename Sink>
void group_f32(const float* a, int64_t k, const float* w, int64_t n0, int64_t cols, const Sink& sink) {
  __m512 sums[R][kVectors];
  xllm_linear_rows::sums<R, kVectors>(a, k, w, sums);
  keep<R>(sums, n0, cols, sink);
}

template <typename Sink>
struct F32 {  // row groups of 6, as linear.cpp's float32 loop
  int64_t k;
  void operator()(const void* a_, int64_t rows, const void* w_, const Sink& sink, int64_t n0, int64_t cols) const {
    const auto* a = static_cast<const float*>(a_);
    const auto* w = static_cast<const float*>(w_);
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) group_f32<6>(a + r * k, k, w, n0, cols, sink.rows_from(r));
    switch (rows - r) {
      case 5: group_f32<5>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      case 4: group_f32<4>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      case 3: group_f32<3>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      case 2: group_f32<2>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      case 1: group_f32<1>(a + r * k, k, w, n0, cols, sink.rows_from(r)); break;
      default: break;
    }
  }
};

}  // namespace xllm_head_rows
