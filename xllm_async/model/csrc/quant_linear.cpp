// A linear layer over GGUF's quantized blocks (Q8_0, Q4_0, Q4_1: model/quantized.py), on
// AVX512-VNNI integer dot products, as llama.cpp computes them; on a CPU with AMX, a prompt's
// bfloat16 rows on bfloat16 tiles over the blocks widened a chunk at a time (quant_widened.cpp).
// QuantWeight.linear calls it where it built and matched the reference arithmetic (quantized.py
// checks once a process).
//
// A decode step reads every weight once, so it costs what the weights' bytes cost: kept in their
// blocks (~4.5 to 8.5 bits a weight), they are read as the file has them, never widened in memory.
//
// The activations: each row's 32-wide blocks rounded to int8 with one float scale a block (dx, the
// block's largest magnitude / 127) and the block's sum of int8s (sx). A weight block's int8 or
// 4-bit quants are held unsigned (Q8_0's stored + 128, Q4's nibbles as they are), so one vpdpbusd
// (unsigned x signed bytes, four products summed into each int32 lane) serves every format:
//   Q8_0: w = d (u - 128)  ->  d dx (u.x - 128 sx)
//   Q4_0: w = d (u - 8)    ->  d dx (u.x - 8 sx)
//   Q4_1: w = d u + m      ->  d dx (u.x) + m dx sx
// The integer part is exact; the per-block scaling is float32 fused multiply-adds.
//
// How the weight is packed, and the activations' int8 blocks: quant_blocks.h.

#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "avx512_bf16.h"
#include "parallel.h"
#include "quant_blocks.h"

namespace {

using namespace xllm_quant;

constexpr int64_t kRowChunk = 256;  // rows whose int8 activations stay in L2 while the weights pass
// How far ahead of its reads a decode step fetches a group's blocks: the hardware's prefetcher
// alone keeps too few lines in flight for one stream to reach the memory's bandwidth.
constexpr int64_t kAhead = 4096;
constexpr int64_t kParallelRows = 16;  // rows from which threads share the activations' rounding

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [0, R) of the activations from row r0 times tiles [t0, t0 + T) of a group (w: its first
// block), + bias, into out (n wide) from column n0 (the first tile's).
template <Kind K, int R, int T, typename O>
void tile_product(const Activations& a, int64_t r0, const uint8_t* w, int64_t t0, const float* bias, O* out,
                  int64_t n, int64_t n0) {
  constexpr int64_t rec = record_bytes(K), stride = quant_bytes(K);
  const int64_t quants = scale_bytes(K) + t0 * stride;
  constexpr int32_t offset = K == kQ8_0 ? 128 : (K == kQ4_0 ? 8 : 0);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int8_t* x[R];
    __m512i dot[R][T];
    for (int r = 0; r < R; ++r) {
      x[r] = a.q + ((r0 + r) * a.blocks + b) * kBlock;
      const __m512i start = _mm512_set1_epi32(-offset * a.s[(r0 + r) * a.blocks + b]);
      for (int t = 0; t < T; ++t) dot[r][t] = start;
    }
    if constexpr (T == kGroup) {  // (a whole group, a decode step: one stream, fetched ahead)
      const uint8_t* ahead = w + b * rec + kAhead;
      for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T1);
    }
    const uint8_t* block = w + b * rec + quants;
    if constexpr (K == kQ8_0) {
      for (int g = 0; g < 8; ++g) {
        __m512i wv[T];
        for (int t = 0; t < T; ++t) wv[t] = _mm512_loadu_si512(block + t * stride + g * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = broadcast4(x[r] + 4 * g);
          for (int t = 0; t < T; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], wv[t], xv);
        }
      }
    } else {
      for (int v = 0; v < 4; ++v) {
        __m512i low[T], high[T];
        for (int t = 0; t < T; ++t) {
          const __m512i raw = _mm512_loadu_si512(block + t * stride + v * 64);
          low[t] = _mm512_and_si512(raw, nibble);
          high[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xl = broadcast4(x[r] + 4 * v), xh = broadcast4(x[r] + 16 + 4 * v);
          for (int t = 0; t < T; ++t) {
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], low[t], xl);
            dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], high[t], xh);
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* scales = w + b * rec + (t0 + t) * kTile * 2;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
      for (int r = 0; r < R; ++r) {
        const float dx = a.d[(r0 + r) * a.blocks + b];
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r][t]);
      }
      if constexpr (K == kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + kGroup * kTile * 2)));
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * a.blocks + b;
          acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.d[i] * static_cast<float>(a.s[i])), acc[r][t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col = n0 + t * kTile;
    if (col >= n) break;  // (the padding tiles)
    const __mmask16 live = xllm_simd::lanes(n - col);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_add_ps(acc[r][t], b);
      if constexpr (std::is_same_v<O, float>) {
        _mm512_mask_storeu_ps(out + (r0 + r) * n + col, live, y);
      } else {
        xllm_simd::store_bf16(reinterpret_cast<uint16_t*>(out) + (r0 + r) * n + col, y, live);
      }
    }
  }
}

// Every row of the activations times each thread's run of tiles, a chunk of rows at a time. A run
// is contiguous, so that a decode step's fetching ahead runs on into the thread's next group.
template <Kind K, int R, int T, typename O>
void product(const Activations& a, int64_t m, const uint8_t* w, int64_t tiles, const float* bias, O* out, int64_t n) {
  const int64_t group = a.blocks * record_bytes(K);  // a group's blocks
  const int64_t steps = tiles / T, runs = std::min<int64_t>(omp_get_max_threads(), steps);
  xllm_parallel::interleaved_items(runs, [&](int64_t first, int64_t count, int64_t stride) {
    if (a.shared) {
      a.round_rows(first, m, stride);
      if (stride > 1) {  // (one thread: no team of ours to wait for)
#pragma omp barrier
      }
    }
    for (int64_t run = first; run < count; run += stride) {
      const int64_t s0 = steps * run / runs, s1 = steps * (run + 1) / runs;
      if constexpr (T == kGroup) {  // (the start of the run, which no earlier block fetched)
        const auto* start = reinterpret_cast<const char*>(w + s0 * group);
        for (int64_t line = 0; line < std::min(kAhead, (s1 - s0) * group); line += 64)
          _mm_prefetch(start + line, _MM_HINT_T1);
      }
      for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
        const int64_t c1 = std::min(m, c0 + kRowChunk);
        for (int64_t i = s0; i < s1; ++i) {
          const uint8_t* tiles_at = w + (i * T / kGroup) * group;
          const int64_t t0 = i * T % kGroup, n0 = i * T * kTile;
          int64_t r = c0;
          for (; r + R <= c1; r += R) tile_product<K, R, T>(a, r, tiles_at, t0, bias, out, n, n0);
          switch (c1 - r) {
            case 3: tile_product<K, 3, T>(a, r, tiles_at, t0, bias, out, n, n0); break;
            case 2: tile_product<K, 2, T>(a, r, tiles_at, t0, bias, out, n, n0); break;
            case 1: tile_product<K, 1, T>(a, r, tiles_at, t0, bias, out, n, n0); break;
            default: break;
          }
        }
      }
    }
  });
}

template <Kind K, typename O>
void dispatch_tiles(const Activations& a, int64_t m, const uint8_t* w, int64_t tiles, const float* bias, O* out,
                    int64_t n) {
  // A decode step's few rows: a whole group at a time (one stream, fetched ahead), up to three
  // rows on each unpacked weight vector, then two; a prompt's rows: four rows on each vector of
  // two tiles (registers: R x T int32 and float sums).
  if (m < 4) {
    product<K, 4, 4>(a, m, w, tiles, bias, out, n);
  } else if (m < 32) {
    product<K, 2, 4>(a, m, w, tiles, bias, out, n);
  } else {
    product<K, 4, 2>(a, m, w, tiles, bias, out, n);
  }
}

template <typename O>
void dispatch(Kind kind, const Activations& a, int64_t m, const uint8_t* w, int64_t tiles, const float* bias, O* out,
              int64_t n) {
  switch (kind) {
    case kQ8_0: dispatch_tiles<kQ8_0>(a, m, w, tiles, bias, out, n); break;
    case kQ4_0: dispatch_tiles<kQ4_0>(a, m, w, tiles, bias, out, n); break;
    case kQ4_1: dispatch_tiles<kQ4_1>(a, m, w, tiles, bias, out, n); break;
  }
}

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& packed, const std::string& format,
                        const std::optional<at::Tensor>& bias, int64_t n) {
  const Kind kind = kind_of(format);
  const bool f32 = input.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || input.scalar_type() == at::kBFloat16) && input.dim() == 2,
              "quant_linear: 2-d bfloat16 or float32 rows");
  auto x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "quant_linear: the input width must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) * kGroup * kTile >= n && packed.size(1) == blocks &&
                  packed.size(2) == record_bytes(kind),
              "quant_linear: weight packed for another shape or format");
  at::Tensor bias_f;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "quant_linear: the bias must be 1-d with n = ", n,
                " values, not of shape ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  auto out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
#if defined(__AMX_BF16__)
  if (widens(m, f32)) {
    widened(kind, reinterpret_cast<const at::BFloat16*>(x.data_ptr()), m, k, packed.data_ptr<uint8_t>(), packed.size(0),
            b, reinterpret_cast<uint16_t*>(out.data_ptr()), n);
    return out;
  }
#endif
  // int8 quants, then the scales and sums (4-byte aligned: k is a multiple of 32)
  auto scratch = at::empty({m * k + m * blocks * 8}, x.options().dtype(at::kByte));
  auto* q = reinterpret_cast<int8_t*>(scratch.data_ptr());
  auto* d = reinterpret_cast<float*>(q + m * k);
  auto* s = reinterpret_cast<int32_t*>(d + m * blocks);
  // (a decode step's few rows take less than sharing out)
  const Activations a{q, d, s, blocks, x.data_ptr(), f32, m >= kParallelRows};
  if (!a.shared) a.round_rows(0, m, 1);
  const auto* w = packed.data_ptr<uint8_t>();
  if (f32) {
    dispatch(kind, a, m, w, packed.size(0) * kGroup, b, out.data_ptr<float>(), n);
  } else {
    dispatch(kind, a, m, w, packed.size(0) * kGroup, b, reinterpret_cast<at::BFloat16*>(out.data_ptr()), n);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("quant_linear(Tensor x, Tensor packed, str format, Tensor? bias, int n) -> Tensor");
  // Whether quant_linear takes `rows` bfloat16 rows through AMX's bfloat16 tiles here (quant_widened.cpp).
  m.def("quant_linear_widens(int rows) -> bool", [](int64_t rows) { return widens(rows, false); });
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("quant_linear", &quant_linear); }

#endif
