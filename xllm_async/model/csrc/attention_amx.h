// A block of 32 query rows on AMX's bfloat16 tiles (the packed attention kernels' bfloat16 path on
// CPUs with AMX): scores by tile products, the softmax (attention_softmax.h), then the sums of
// values by tile products; and the tile layout a call sets up around them. Without AMX,
// amx_permitted() and Tiles are there still, asking for nothing and setting up nothing, so that
// the operators call them alike on every CPU.
// Include only under #if defined(__AVX512BF16__).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "attention_packing.h"
#include "attention_softmax.h"
#include "avx512_bf16.h"

#if defined(__AMX_BF16__)
#include <sys/syscall.h>  // (asking Linux for AMX state)
#include <unistd.h>
#endif

namespace xllm_attention {

#if defined(__AMX_BF16__)

// Up to 32 outputs of a row (n): float32 sums times 1 / the row's total, as bfloat16.
inline void write_row(bf16* o, const float* values, float inverse, int64_t n) {
  const __m512 scale = _mm512_set1_ps(inverse);
  for (int64_t i = 0; i < n; i += 16) {
    xllm_simd::store_bf16(o + i, _mm512_mul_ps(_mm512_loadu_ps(values + i), scale), xllm_simd::lanes(n - i));
  }
}

// AMX: a tile is 16 rows of 64 bytes; one tile product adds a [16 x 32] bfloat16 block times a
// [32 x 16] one (stored as 16 rows of pairs) into [16 x 16] float32, 16 times the work of an
// AVX512 dot product a step. Tiles 0-3 accumulate, 4-5 hold two tiles of query rows (or of their
// probabilities), 6-7 two of keys (or values).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_permitted() {
  // Linux hands out AMX state only to processes that ask (oneDNN asks too; asking twice is fine).
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// A block of 32 query rows: two tiles of rows against two tiles of keys (or values) at a time,
// into four accumulators, so that every tile loaded serves two products: with one tile of rows,
// loading keys and values from L2 kept the tile unit waiting (16 x 320 tokens, 16 heads of 128: 27.6 -> 19.8 ms).
inline void block_amx(const Packed<bf16>& a, Scratch<bf16>& s, const Block<bf16>& b) {
  const int64_t wide = a.wide;
  const int64_t width = (b.span + 31) / 32 * 32;  // whole tiles of probabilities (32 keys)
  const bf16* qs = s.queries.data();
  const bf16* kp = s.keys.data();
  const bf16* vp = s.values.data();
  float* scores = s.scores.data();
  bf16* probs = s.probs.data();
  const int64_t q_bytes = wide * sizeof(bf16), s_bytes = width * sizeof(float);
  const int64_t lower = kTileRows * width;  // the second tile of rows, in scores and probabilities
  for (int64_t k0 = 0; k0 < width; k0 += 2 * kKeys) {  // scores: 32 keys a step
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < wide; c += 32) {  // 32 dims (16 pairs) a product
      _tile_loadd(4, qs + c, q_bytes);
      _tile_loadd(5, qs + kTileRows * wide + c, q_bytes);
      _tile_loadd(6, kp + k0 * wide + c * kKeys, 2 * kKeys * sizeof(bf16));
      _tile_loadd(7, kp + (k0 + kKeys) * wide + c * kKeys, 2 * kKeys * sizeof(bf16));
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, scores + k0, s_bytes);
    _tile_stored(1, scores + k0 + kKeys, s_bytes);
    _tile_stored(2, scores + lower + k0, s_bytes);
    _tile_stored(3, scores + lower + k0 + kKeys, s_bytes);
  }
  float inverse[kBlockRows];
  softmax_rows(b, b.rows, scores, probs, width, a.scale, inverse);  // (rows past b.rows: stale, never written)
  alignas(64) float out[kBlockRows * 32];
  const int64_t p_bytes = width * sizeof(bf16), v_bytes = wide * 2 * sizeof(bf16);
  for (int64_t d0 = 0; d0 < a.dim; d0 += 32) {  // outputs: 32 dims a step
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < width; j += 32) {  // 32 keys: 16 key pairs x 16 dims, twice
      const bf16* vj = vp + (j / 2) * wide * 2 + d0 * 2;
      _tile_loadd(4, probs + j, p_bytes);
      _tile_loadd(5, probs + kTileRows * width + j, p_bytes);
      _tile_loadd(6, vj, v_bytes);
      _tile_loadd(7, vj + 32, v_bytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 32 * sizeof(float));
    _tile_stored(1, out + 16, 32 * sizeof(float));
    _tile_stored(2, out + kTileRows * 32, 32 * sizeof(float));
    _tile_stored(3, out + kTileRows * 32 + 16, 32 * sizeof(float));
    for (int r = 0; r < b.rows; ++r) write_row(b.out[r] + d0, out + r * 32, inverse[r], std::min<int64_t>(32, a.dim - d0));
  }
}

// Our tile layout for the length of one call, then whatever the thread had (oneDNN keeps its own
// configuration loaded between its kernels).
class Tiles {
 public:
  Tiles() {
    _tile_storeconfig(&saved_);
    TileConfig mine;
    for (int t = 0; t < 8; ++t) {
      mine.rows[t] = kTileRows;
      mine.colsb[t] = 64;
    }
    _tile_loadconfig(&mine);
  }
  ~Tiles() {
    if (saved_.palette != 0) {
      _tile_loadconfig(&saved_);
    } else {
      _tile_release();
    }
  }

 private:
  TileConfig saved_;
};

#else  // AVX512-BF16 without AMX

// No tile state to ask Linux for, and none to set up around a call.
inline bool amx_permitted() { return true; }
struct Tiles {};

#endif  // __AMX_BF16__

}  // namespace xllm_attention
