// A linear layer over GGUF's quantized blocks (Q8_0, Q4_0, Q4_1: model/quantized.py), on
// AVX512-VNNI integer dot products, as llama.cpp computes them; on a CPU with AMX, a prompt's
// bfloat16 rows on bfloat16 tiles over the blocks widened a chunk at a time (widened_product, below).
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
// The weight is packed once (quantized.py, QuantWeight.packed) into tiles of 16 output columns,
// one int32 lane each, in groups of four tiles (64 columns; zero columns pad the last group). A
// group's block is the 64 columns' float16 d (then their m, for Q4_1), then each tile's quants,
// four inputs a lane: Q8_0 as 8 vectors of [16 columns][4 inputs] (inputs 4g..4g+3 in vector g);
// Q4 as 4 vectors of bytes as GGUF has them (low nibble input i, high input i + 16), vector v
// holding inputs 4v..4v+3 low and 16+4v.. high. The same bytes as the file's blocks, every vector
// on a cache line of its own, and a group's blocks one stream through memory.

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

#if defined(__AMX_BF16__)
#include <vector>

#include "amx_block.h"
#include "blocked_linear.h"
#endif

namespace {

constexpr int64_t kTile = 16;   // output columns a tile interleaves
constexpr int64_t kGroup = 4;   // tiles a group interleaves
constexpr int64_t kBlock = 32;  // inputs a block quantizes together
constexpr int64_t kRowChunk = 256;  // rows whose int8 activations stay in L2 while the weights pass
// How far ahead of its reads a decode step fetches a group's blocks: the hardware's prefetcher
// alone keeps too few lines in flight for one stream to reach the memory's bandwidth.
constexpr int64_t kAhead = 4096;
constexpr int64_t kParallelRows = 16;  // rows from which threads share the activations' rounding

enum Kind { kQ8_0, kQ4_0, kQ4_1 };

Kind kind_of(const std::string& name) {
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

#if defined(__AMX_BF16__)

// A prompt's bfloat16 rows on a CPU with AMX: the weights widened to bfloat16, a chunk of groups at
// a time (1 MiB widened) into a thread's scratch (the layout our bfloat16 linear packs: [K/2][64][2]), then every
// row block through AMX's bfloat16 tiles, as our bfloat16 linear runs (amx_block.h). Widening is
// one pass over the chunk's weights, which every row block then shares: at 320 rows 1.07-1.22x
// our bfloat16 linear's speed (it reads fewer bytes), where the VNNI loop above was 0.36-0.46x
// (perf/experiments/quant_linear.py, Xeon). AMX's int8 products were tried first and lose: their
// sums come out per 32-input block (a tile store, 16 conversions and scalings each, and a store
// after a product waits ~50 cycles for it), 1.2x the VNNI loop at 320 rows, not 2.6x.
// The activations stay bfloat16 here (not rounded to int8 blocks): a prompt's rows get exactly
// what our bfloat16 linear gives on the weights de-quantized to bfloat16 (tested bit for bit),
// a little nearer the reference than a decode step's rows, which the VNNI loop serves.
constexpr int64_t kWidenFrom = 24;  // rows from which bfloat16 rows take this path (fewer: the VNNI loop is as fast)

// Two vectors of 16 columns' values (inputs 2p and 2p + 1) as pair p of the packed layout.
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// A group's blocks (w: its first) widened into out [K/2][64][2]: w = d q, d (q - 8) or d q + m.
template <Kind K>
void widen_group(const uint8_t* w, int64_t blocks, uint16_t* out) {
  constexpr int64_t rec = record_bytes(K), stride = quant_bytes(K);
  const __m512i nibble = _mm512_set1_epi32(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* scales = w + b * rec;
    for (int64_t t = 0; t < kGroup; ++t) {
      const uint8_t* src = scales + scale_bytes(K) + t * stride;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + t * kTile * 2)));
      auto store = [&](int64_t pair, __m512 even, __m512 odd) {  // (pair: the block's, 0-15)
        _mm512_storeu_si512(out + ((b * kBlock / 2 + pair) * kGroup * kTile + t * kTile) * 2, bf16_pairs(even, odd));
      };
      if constexpr (K == kQ8_0) {  // vector g: inputs 4g..4g+3, one byte each (q + 128)
        for (int g = 0; g < 8; ++g) {
          const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(src + g * 64), sign);
          auto value = [&](int byte) {  // (the byte, sign-extended)
            const __m512i top = byte == 3 ? q : _mm512_slli_epi32(q, 24 - 8 * byte);
            return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(top, 24)), d);
          };
          store(2 * g, value(0), value(1));
          store(2 * g + 1, value(2), value(3));
        }
      } else {  // vector v: inputs 4v..4v+3 in its low nibbles, 16 + 4v.. in its high ones
        __m512 m;  // (Q4_0: -8 d, exact, so that d q + m rounds once, as d (q - 8) does)
        if constexpr (K == kQ4_1) {
          m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (kGroup + t) * kTile * 2)));
        } else {
          m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
        }
        for (int v = 0; v < 4; ++v) {
          const __m512i raw = _mm512_loadu_si512(src + v * 64);
          auto value = [&](int shift) {
            const __m512i q = _mm512_and_si512(_mm512_srli_epi32(raw, shift), nibble);
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
          };
          store(2 * v, value(0), value(8));
          store(2 * v + 1, value(16), value(24));
          store(8 + 2 * v, value(4), value(12));
          store(8 + 2 * v + 1, value(20), value(28));
        }
      }
    }
  }
}

// x [m, k] bfloat16 times the groups, widened a chunk at a time (blocked_linear.h's chunks: its
// column blocks are our groups), + bias, into out [m, n].
template <Kind K>
void widened_product(const at::BFloat16* x, int64_t m, int64_t k, const uint8_t* w, int64_t groups, const float* bias,
                     uint16_t* out, int64_t n) {
  static_assert(kGroup * kTile == xllm_blocked::kCols);
  const int64_t blocks = k / kBlock, group_bytes = blocks * record_bytes(K), widened_group = k * xllm_blocked::kCols;
  auto widen = [&](int64_t c0, int64_t c1) {  // (on each thread, into its own scratch)
    // (on a cache line: a tile row of 64 bytes across two lines took twice as long to load)
    thread_local std::vector<uint16_t> scratch;
    scratch.resize((c1 - c0) * widened_group + 32);
    auto* widened = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    for (int64_t g = c0; g < c1; ++g) widen_group<K>(w + g * group_bytes, blocks, widened + (g - c0) * widened_group);
    return reinterpret_cast<const at::BFloat16*>(widened);
  };
  xllm_blocked::blocked_linear(x, out, m, k, n, groups, xllm_amx::BlockProduct{k, n, bias}, widen);
}

bool widens(int64_t m, bool f32) { return !f32 && m >= kWidenFrom; }

void widened(Kind kind, const at::BFloat16* x, int64_t m, int64_t k, const uint8_t* w, int64_t groups,
             const float* bias, uint16_t* out, int64_t n) {
  switch (kind) {
    case kQ8_0: widened_product<kQ8_0>(x, m, k, w, groups, bias, out, n); break;
    case kQ4_0: widened_product<kQ4_0>(x, m, k, w, groups, bias, out, n); break;
    case kQ4_1: widened_product<kQ4_1>(x, m, k, w, groups, bias, out, n); break;
  }
}

#else

bool widens(int64_t, bool) { return false; }

#endif  // __AMX_BF16__

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
  // Whether quant_linear takes `rows` bfloat16 rows through AMX's bfloat16 tiles here (widened_product).
  m.def("quant_linear_widens(int rows) -> bool", [](int64_t rows) { return widens(rows, false); });
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("quant_linear", &quant_linear); }

#endif
