// Our bfloat16 linear layer for any number of rows, on AMX (over oneDNN's brgemm micro-kernel,
// torch's at::native::cpublas::brgemm) or, on CPUs with AVX512-BF16 but no AMX, on our own
// vdpbf16ps loop. model/layers.py uses it where this CPU has either.
//
// Why not oneDNN's linear primitive (torch.ops.mkldnn._linear_pointwise): it compiles a kernel
// for every number of rows it meets, ~0.6 MB each, and a server meets hundreds of row counts
// (packed prompts, decode steps, beam rounds) over hours: that was most of a 10,000-request soak's
// growth, and the first batch of each new size paid ~5 ms of compiling. Here nothing is compiled
// per row count: on AMX the work is cut into blocks of at most 32 rows x 64 columns, so the
// micro-kernels are keyed only by the rows of the last block (1-32) and the input width (a few
// dozen small kernels per thread, met in the first minutes); on AVX512-BF16 the loop is ours.
// A decode step's few rows also skip the primitive's ~15 us of set-up. oneDNN's primitive wins
// from a few dozen rows on AMX (it rounds to bfloat16 inside its tile loop; ours takes a pass
// after each block), so on AMX layers.py gives ours a decode step's rows and the LM head. On
// AVX512-BF16 both run near the cores' peak from a few hundred rows (Zen 5: oneDNN 2-8% ahead with
// a larger register block; Zen 4: level), but oneDNN's rows come padded to a few sizes (up to a
// quarter more), so there ours takes every row count (cpu_linear.py's OUR_MAX_ROWS, with figures).
//
// Weights are packed once (pack_linear) into column blocks of 64, each [K/2][64][2] bfloat16
// (the pairs both AMX and vdpbf16ps multiply: a k pair of 16 columns is one 64-byte vector),
// zero columns padding the last block; a range of whole blocks is a packed weight of its own
// (layers.PackedWeight.columns). Products accumulate in float32; the bias is added in float32
// and the sum rounded once to bfloat16 (to nearest even), as oneDNN's linear does.

#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#if defined(__AVX512BF16__)
#include "avx512_bf16.h"
#include "blocked_linear.h"
#include "linear_rows.h"

#if defined(__AMX_BF16__)
#include "amx_block.h"
#endif

namespace {

using xllm_blocked::kCols;
using xllm_blocked::kRows;

#if defined(__AMX_BF16__)

// torch's packer for its brgemm (it exists only where AMX does).
void pack_block(const at::Tensor& rows, at::BFloat16* out) {  // rows: [64, k] of the weight
  auto block = rows.t().contiguous();                          // [k, 64]: B of x @ B
  at::native::cpublas::pack(block.size(0), kCols, kCols, kCols, at::kBFloat16, at::kBFloat16, block.data_ptr(), out);
}

using BlockProduct = xllm_amx::BlockProduct;

#else  // AVX512-BF16 without AMX

// The [K/2][64][2] layout by hand: a column's k pair is one 32-bit word, so a block is a
// transpose of 32-bit words ([64][K/2] -> [K/2][64]). Runs once per weight, at load.
void pack_block(const at::Tensor& rows, at::BFloat16* out) {  // rows: [64, k], contiguous
  const int64_t pairs = rows.size(1) / 2;
  const auto* src = reinterpret_cast<const uint32_t*>(rows.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t c = 0; c < kCols; ++c)
    for (int64_t p = 0; p < pairs; ++p) dst[p * kCols + c] = src[c * pairs + p];
}

struct BlockProduct {
  int64_t k, n;
  const float* bias;

  void operator()(const at::BFloat16* a, int64_t rows, const at::BFloat16* w, uint16_t* out, int64_t n0,
                  int64_t cols) const {
    xllm_linear_rows::block_rows(reinterpret_cast<const uint16_t*>(a), rows, k, reinterpret_cast<const uint16_t*>(w),
                                 out, n, n0, cols, bias);
  }

  static void finish() {}
};

#endif

// float32 on AVX512 FMAs, every CPU this library is built for (linear_rows.h).
struct Float32Product {
  int64_t k, n;
  const float* bias;

  void operator()(const float* a, int64_t rows, const float* w, float* out, int64_t n0, int64_t cols) const {
    xllm_linear_rows::block_rows(a, rows, k, w, out, n, n0, cols, bias);
  }

  static void finish() {}
};

at::Tensor pack_linear(const at::Tensor& weight) {
  const bool f32 = weight.scalar_type() == at::kFloat;
  TORCH_CHECK(weight.dim() == 2 && (f32 || weight.scalar_type() == at::kBFloat16),
              "pack_linear: a 2-d bfloat16 or float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(f32 || k % 2 == 0, "pack_linear: the input width must be even (bfloat16 pairs)");
  const int64_t blocks = (n + kCols - 1) / kCols;
  auto padded = at::zeros({blocks * kCols, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  auto packed = at::empty({blocks, k * kCols}, weight.options());
  for (int64_t b = 0; b < blocks; ++b) {
    auto rows = padded.narrow(0, b * kCols, kCols);
    if (f32) {
      packed[b].view({k, kCols}).copy_(rows.t());  // [64][K] -> [K][64]
    } else {
      pack_block(rows, reinterpret_cast<at::BFloat16*>(packed[b].data_ptr()));
    }
  }
  return packed;
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  const bool f32 = input.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || input.scalar_type() == at::kBFloat16) && input.dim() == 2,
              "linear: 2-d bfloat16 or float32 rows");
  TORCH_CHECK(packed.scalar_type() == input.scalar_type(), "linear: the weight was packed for another dtype");
  auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t col_blocks = packed.size(0);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == k * kCols && col_blocks * kCols >= n,
              "linear: weight packed for another shape");
  at::Tensor bias_f;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    // The loops read n floats from it: a shorter one would be read past its end.
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear: the bias must be 1-d with n = ", n,
                " values, not of shape ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  if (f32) {
    const float* w = packed.data_ptr<float>();
    xllm_blocked::blocked_linear(x.data_ptr<float>(), out.data_ptr<float>(), m, k, n, col_blocks,
                                 Float32Product{k, n, b}, [&](int64_t c0, int64_t) { return w + c0 * k * kCols; });
  } else {
    const auto* w = reinterpret_cast<const at::BFloat16*>(packed.data_ptr());
    xllm_blocked::blocked_linear(reinterpret_cast<const at::BFloat16*>(x.data_ptr()),
                                 reinterpret_cast<uint16_t*>(out.data_ptr()), m, k, n, col_blocks,
                                 BlockProduct{k, n, b}, [&](int64_t c0, int64_t) { return w + c0 * k * kCols; });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  // Which instruction set linear runs on here: "amx" or "avx512_bf16".
  m.def("linear_isa() -> str", []() -> std::string {
#if defined(__AMX_BF16__)
    return "amx";
#else
    return "avx512_bf16";
#endif
  });
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}

#endif
