// A bfloat16 linear layer on AMX for any number of rows, over oneDNN's brgemm micro-kernel
// (torch's at::native::cpublas::brgemm). model/layers.py uses it where this CPU has AMX.
//
// Why not oneDNN's linear primitive (torch.ops.mkldnn._linear_pointwise): it compiles a kernel
// for every number of rows it meets, ~0.6 MB each, and a server meets hundreds of row counts
// (packed prompts, decode steps, beam rounds) over hours: that was most of a 10,000-request soak's
// growth, and the first batch of each new size paid ~5 ms of compiling. Here the work is cut into
// blocks of at most 32 rows x 64 columns, so the micro-kernels are keyed only by the rows of the
// last block (1-32) and the input width: a few dozen small kernels per thread, met in the first
// minutes. A decode step's few rows also skip the primitive's ~15 us of set-up: 1.5-2.4x faster
// for 1-32 rows. From a few dozen rows on oneDNN's primitive wins (its kernel rounds to bfloat16
// inside the tile loop; ours takes a pass after each block: 1.3-1.5x slower at 5,120 rows), so
// layers.py gives ours a decode step's rows and the LM head (perf/RESULTS.md, thirteenth session).
//
// Weights are packed once (amx_pack) into column blocks of 64, each [K/2][64][2] bfloat16 (the
// pairs AMX multiplies), zero columns padding the last block. Products accumulate in float32;
// the bias is added in float32 and the sum rounded once to bfloat16, as oneDNN's linear does.

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512BF16__) && defined(__AMX_BF16__)
#include "avx512_bf16.h"

namespace {

constexpr int64_t kCols = 64;  // a column block: one packed weight block, one micro-kernel call
constexpr int64_t kRows = 32;  // rows a call (two AMX tiles of 16)
// Packed weights a thread keeps in its L2 while every row block passes them (bytes).
constexpr int64_t kWeightChunk = 1 << 20;

at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack: a 2-d bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "amx_pack: the input width must be even (bfloat16 pairs)");
  const int64_t blocks = (n + kCols - 1) / kCols;
  auto padded = at::zeros({blocks * kCols, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  auto packed = at::empty({blocks, k * kCols}, weight.options());
  for (int64_t b = 0; b < blocks; ++b) {
    auto block = padded.narrow(0, b * kCols, kCols).t().contiguous();  // [k, 64]: B of x @ B
    at::native::cpublas::pack(k, kCols, kCols, kCols, at::kBFloat16, at::kBFloat16, block.data_ptr(),
                              packed[b].data_ptr());
  }
  return packed;
}

// One thread's share: row blocks [row_first, row_last) x column blocks [col_first, col_last).
struct Share {
  int64_t row_first, row_last, col_first, col_last;
};

at::Tensor amx_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2, "amx_linear: 2-d bfloat16 rows");
  auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t col_blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k * kCols && col_blocks * kCols >= n, "amx_linear: weight packed for another shape");
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  at::Tensor bias_f;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  const auto* a = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  const auto* w = reinterpret_cast<const at::BFloat16*>(packed.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t chunk = std::max<int64_t>(1, kWeightChunk / (2 * k * kCols));  // column blocks kept in L2

  auto run = [&](const Share& s) {
    alignas(64) float acc[kRows * kCols];
    for (int64_t c0 = s.col_first; c0 < s.col_last; c0 += chunk) {
      const int64_t c1 = std::min(s.col_last, c0 + chunk);
      for (int64_t rb = s.row_first; rb < s.row_last; ++rb) {
        const int64_t r0 = rb * kRows, rows = std::min(kRows, m - r0);
        for (int64_t cb = c0; cb < c1; ++cb) {  // a row's columns of this chunk in one run
          const int64_t n0 = cb * kCols, cols = std::min(kCols, n - n0);
          at::native::cpublas::brgemm(rows, kCols, k, k, kCols, kCols, false, a + r0 * k, w + cb * k * kCols, acc,
                                      true);
          for (int64_t r = 0; r < rows; ++r) {
            uint16_t* dst = o + (r0 + r) * n + n0;
            const float* src = acc + r * kCols;
            for (int64_t j = 0; j < cols; j += 16) {
              const __mmask16 live = xllm_simd::lanes(cols - j);
              __m512 v = _mm512_maskz_loadu_ps(live, src + j);
              if (b != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, b + n0 + j));
              xllm_simd::store_bf16(dst + j, v, live);
            }
          }
        }
      }
    }
    // Other AMX code (oneDNN's primitives) loads its own tile layout without telling torch's
    // brgemm, which would then skip reloading ours: give the tiles back after every call.
    at::native::cpublas::brgemm_release(true);
  };

  // Threads split the rows (each reads all the weights and its own rows) where the rows outnumber
  // the columns, as in a long prefill through a narrow layer; otherwise the columns (each reads
  // all the rows and its share of the weights), as in a decode step: whichever reads less.
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = m > n && row_blocks >= threads;
  const int used = static_cast<int>(std::min<int64_t>(threads, by_rows ? row_blocks : col_blocks));
  auto share = [&](int t, int nt) {
    if (by_rows) return Share{row_blocks * t / nt, row_blocks * (t + 1) / nt, 0, col_blocks};
    return Share{0, row_blocks, col_blocks * t / nt, col_blocks * (t + 1) / nt};
  };
  if (used > 1) {
#pragma omp parallel num_threads(used)
    run(share(omp_get_thread_num(), omp_get_num_threads()));
  } else {
    run(share(0, 1));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}

#endif
