// linear_rows.h's block product, compiled once for every caller (linear.cpp's operator, the team
// step): the same machine code, so the same bits.

#if defined(__AVX512BF16__)

#include "linear_rows.h"

namespace xllm_linear_rows {

template <typename T>
void block_rows(const T* a, int64_t rows, int64_t k, const T* w, T* out, int64_t n, int64_t n0, int64_t cols,
                const float* bias, int v0, int v1) {
  if (v0 == 0 && v1 == kVectors) return vector_rows<kVectors>(a, rows, k, w, out, n, n0, cols, bias);
  constexpr int64_t step = 16 * (sizeof(T) == 2 ? 2 : 1);  // a vector's elements along a k step (bf16: pairs)
  for (int v = v0; v < v1 && v * 16 < cols; ++v)
    vector_rows<1>(a, rows, k, w + v * step, out, n, n0 + v * 16, cols - v * 16, bias);
}

template void block_rows<uint16_t>(const uint16_t*, int64_t, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t,
                                   int64_t, const float*, int, int);
template void block_rows<float>(const float*, int64_t, int64_t, const float*, float*, int64_t, int64_t, int64_t,
                                const float*, int, int);

}  // namespace xllm_linear_rows

#endif
