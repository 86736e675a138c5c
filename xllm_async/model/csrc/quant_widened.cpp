// A prompt's bfloat16 rows on a CPU with AMX: the weights widened to bfloat16, a chunk of groups at
// a time (1 MiB widened) into a thread's scratch (the layout our bfloat16 linear packs: [K/2][64][2]), then every
// row block through AMX's bfloat16 tiles, as our bfloat16 linear runs (amx_block.h). Widening is
// one pass over the chunk's weights, which every row block then shares: at 320 rows 1.07-1.22x
// our bfloat16 linear's speed (it reads fewer bytes), where the VNNI loop (quant_linear.cpp) was
// 0.36-0.46x (perf/experiments/quant_linear.py, Xeon). AMX's int8 products were tried first and lose: their
// sums come out per 32-input block (a tile store, 16 conversions and scalings each, and a store
// after a product waits ~50 cycles for it), 1.2x the VNNI loop at 320 rows, not 2.6x.
// The activations stay bfloat16 here (not rounded to int8 blocks): a prompt's rows get exactly
// what our bfloat16 linear gives on the weights de-quantized to bfloat16 (tested bit for bit),
// a little nearer the reference than a decode step's rows, which the VNNI loop serves.
//
// quant_linear.cpp picks this path from kWidenFrom rows on; without AMX, no rows take it.

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

#include "quant_blocks.h"

#if defined(__AMX_BF16__)
#include <vector>

#include "amx_block.h"
#include "blocked_linear.h"
#endif

namespace xllm_quant {

#if defined(__AMX_BF16__)

namespace {

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

}  // namespace

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

}  // namespace xllm_quant

#endif
