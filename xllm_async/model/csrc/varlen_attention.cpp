// Causal attention over packed prompts in bfloat16 or float32 on CPU, one call for a whole batch
// (model/attention.py PackedPrefill; built with cpu_kernels.cpp into one library).
//
// torch's fused CPU attention took a third of a bfloat16 prefill here (16 x 320 tokens, head
// width 32: 7.6 ms a layer, Intel Xeon with AMX). Three costs made it:
// - it computes its blocks of scores whole, so a causal prompt shorter than its key block (512)
//   pays for all its L^2 scores where L^2/2 are used;
// - prompts of different lengths are a call per length, each padded to a multiple of 16 tokens
//   (attention.py, ATTENTION_MULTIPLE) with a copy of its queries, keys and values;
// - the softmax between its two products is a few passes over the block of scores.
// Here, for each prompt and key head, keys and values are packed once into the layout AMX's
// tile product takes, then blocks of 16 query rows (all the query heads that share the key head)
// go over exactly the keys they may see, in whole tiles: scores (one tile product), softmax in
// float32 on 16 lanes, probabilities rounded to bfloat16 as torch rounds them, then their sum of
// values (a second tile product). Each prompt's rows are computed apart from the others', so a
// prompt's result never depends on the batch around it. 16 x 320 tokens: 4.2 ms a layer.
//
// Two ways to compute a block's products, picked when the library is compiled (-march=native):
// - bfloat16 on CPUs with AMX: tile products (block_amx);
// - bfloat16 on CPUs with AVX512-BF16 but no AMX (AMD EPYC Zen 4/5 here), and float32 on every
//   CPU the library is built for: products on 16 float32 lanes (block_lanes), dot products of
//   bfloat16 pairs over the same packed keys and values, FMAs over float32 ones.
// Elsewhere the operators are absent and attention.py keeps torch's kernel (an AVX512-BF16
// version measured slower than torch's kernel with AMX on the Intel Xeon, so CPUs with AMX keep
// the tiles).

#if defined(__AVX512BF16__)

#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include "avx512_bf16.h"
#include "parallel.h"

#if defined(__AMX_BF16__)
#include <sys/syscall.h>  // (asking Linux for AMX state)
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using bf16 = uint16_t;

constexpr int kTileRows = 16;   // a tile's rows
constexpr int kBlockRows = 32;  // query rows a block: two tiles of them
constexpr int kKeys = 16;  // keys a score vector holds (16 float32 lanes)

// The largest of n > 0 scores, 16 lanes at a time (a scalar max is a 4-cycle chain per value,
// and the compiler keeps it scalar: it may not reorder max where NaNs are honoured).
inline float row_max(const float* x, int64_t n) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) peak = _mm512_max_ps(peak, _mm512_loadu_ps(x + j));
  if (j < n) {
    __mmask16 tail = xllm_simd::lanes(n - j);
    peak = _mm512_mask_max_ps(peak, tail, peak, _mm512_maskz_loadu_ps(tail, x + j));
  }
  return _mm512_reduce_max_ps(peak);
}

// T: bf16 or float, the element type of queries, keys, values and outputs.
template <typename T>
struct Packed {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t q_stride, k_stride, v_stride;  // between tokens
  int64_t heads, kv_heads, dim;
  int64_t wide;  // bfloat16: dim rounded up to 32, the packed layouts' width, zeros past dim; float32: dim
  float scale;
};

// Scratch for one sequence and key head, reused by a thread across them.
template <typename T>
struct Scratch {
  std::vector<T> keys, values, probs, queries;
  std::vector<float> scores;

  void fit(int64_t padded, int64_t wide) {
    keys.resize(padded * wide);
    values.resize(padded * wide);
    probs.resize(kBlockRows * padded);
    scores.resize(kBlockRows * padded);
    queries.resize(kBlockRows * wide);
  }
};

// Where the rows of a block come from and go to: row i of a sequence's (position, head of the
// group) rows, position-major, from query position `first` on.
template <typename T>
struct Block {
  T* out[kBlockRows];
  float* lse[kBlockRows];    // where a row's log-sum-exp goes (the prompt stage of a beam round), or null
  int64_t seen[kBlockRows];  // keys the row may see (causal: its position + 1; a prompt stage: all)
  int rows;                 // real rows; the rest repeat the last one and are not written
  int64_t span;             // keys the block's last row sees
};

// 2^t for t <= 0: 2^(t - n) by a degree-4 polynomial on [-1/2, 1/2] (within 4e-6, far inside the
// bfloat16 the probabilities are rounded to), times 2^n by scalef (0 for very negative t). Half
// the instructions of the full-precision exp, and the softmax is most of this kernel's work.
inline __m512 exp2_softmax(__m512 t) {
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.009676046747f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05592211929f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402210717f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931210235f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.000000076f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of each row's scores over the keys it sees, times `scale` inside the exponential, up
// to `width` (a multiple of 16) with zeros past what the row sees; inverse[r] = 1 / the row's
// float32 sum. Probabilities in T: in bfloat16 rounded as torch's kernel rounds them before
// multiplying the values, their exponential the short exp2_softmax (far inside that rounding);
// in float32 kept as they are, their exponential the full-precision one (the tests compare
// float32 with transformers token for token).
template <typename T>
void softmax_rows(const Block<T>& b, int count, const float* scores, T* probs, int64_t width, float scale,
                  float* inverse) {
  constexpr bool kHalf = std::is_same_v<T, bf16>;
  const float unit = kHalf ? scale * 1.44269504088896341f : scale;  // e^(x scale) = 2^(x scale log2(e))
  const __m512 vscale = _mm512_set1_ps(unit);
  for (int r = 0; r < count; ++r) {
    const float* sr = scores + r * width;
    T* pr = probs + r * width;
    const int64_t seen = b.seen[r];
    const float peak = row_max(sr, seen) * unit;  // in the exponential's units
    const __m512 shift = _mm512_set1_ps(peak);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += kKeys) {
      const int64_t left = seen - j;
      __m512 e = _mm512_setzero_ps();
      if (left > 0) {
        const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vscale, shift);
        if constexpr (kHalf) {
          e = exp2_softmax(t);
        } else {
          e = xllm_simd::exp(t);
        }
        if (left < kKeys) e = _mm512_maskz_mov_ps(xllm_simd::lanes(left), e);
        total = _mm512_add_ps(total, e);
      }
      if constexpr (kHalf) {
        xllm_simd::store_bf16(pr + j, e, 0xFFFF);
      } else {
        _mm512_storeu_ps(pr + j, e);
      }
    }
    const float sum = _mm512_reduce_add_ps(total);
    inverse[r] = 1.f / sum;
    if (b.lse[r] != nullptr) {  // ln of sum e^(x scale)
      *b.lse[r] = (kHalf ? peak * 0.693147180559945309f : peak) + std::log(sum);
    }
  }
}

// Up to 32 outputs of a row (n): float32 sums times 1 / the row's total, as bfloat16.
inline void write_row(bf16* o, const float* values, float inverse, int64_t n) {
  const __m512 scale = _mm512_set1_ps(inverse);
  for (int64_t i = 0; i < n; i += 16) {
    xllm_simd::store_bf16(o + i, _mm512_mul_ps(_mm512_loadu_ps(values + i), scale), xllm_simd::lanes(n - i));
  }
}

// Keys as [block of 16][dim pair][key][2] (a dim pair of 16 keys is one vector, or one row of
// an AMX tile), values as [key pair][dim][2] (16 dims of two keys), both `wide` dims wide and
// zero past `length` up to `padded` (a multiple of 32).
// One key head's keys and values: token j's at k + j * k_stride and v + j * v_stride.
template <typename T>
struct KeySpan {
  const T* k;
  const T* v;
  int64_t k_stride, v_stride;
};

void pack(const Packed<bf16>& a, Scratch<bf16>& s, const KeySpan<bf16>& kv, int64_t length, int64_t padded) {
  const int64_t dim = a.dim, wide = a.wide;
  // Keys: a dim pair of 16 keys is one gather (16 scalar copies a pair took a sixth of the time).
  bf16* kp = s.keys.data();
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(kv.k_stride / 2)));
  for (int64_t j = 0; j < padded; j += kKeys) {
    bf16* dst = kp + (j / kKeys) * wide * kKeys;
    const int64_t left = length - j;
    if (left <= 0) {
      std::memset(dst, 0, wide * kKeys * sizeof(bf16));
      continue;
    }
    const __mmask16 live = xllm_simd::lanes(left);
    const int32_t* src = reinterpret_cast<const int32_t*>(kv.k + j * kv.k_stride);
    for (int64_t p = 0; p < wide / 2; ++p) {
      __m512i pair = p < dim / 2 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, src + p, 4)
                                 : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * 2 * kKeys, pair);
    }
  }
  // Values: two keys' 32 dims interleaved by two permutes a step.
  bf16* vp = s.values.data();
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < padded; j += 2) {
    bf16* dst = vp + (j / 2) * wide * 2;
    for (int64_t d = 0; d < wide; d += 32) {
      const __mmask32 live = dim - d >= 32 ? ~0u : (1u << (dim - d)) - 1;
      __m512i first = j < length ? _mm512_maskz_loadu_epi16(live, kv.v + j * kv.v_stride + d) : _mm512_setzero_si512();
      __m512i second =
          j + 1 < length ? _mm512_maskz_loadu_epi16(live, kv.v + (j + 1) * kv.v_stride + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(first, low, second));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(first, high, second));
    }
  }
}

#if defined(__AMX_BF16__)

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

bool amx_permitted() {
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
void block_amx(const Packed<bf16>& a, Scratch<bf16>& s, const Block<bf16>& b) {
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
bool amx_permitted() { return true; }
struct Tiles {};

#endif  // __AMX_BF16__

// Float32 (AVX512-BF16 implies AVX512F): torch's fused kernel in float32 was a third of a prefill
// here (16 x 320 tokens of the 4-layer model: 0.91 ms a prompt-layer, perf/RESULTS.md,
// seventeenth session). Keys as [block of 16 keys][dim][key] (a dim of 16 keys is one vector),
// values as [key][dim], zero past `length` up to `padded`.
void pack(const Packed<float>& a, Scratch<float>& s, const KeySpan<float>& kv, int64_t length, int64_t padded) {
  const int64_t dim = a.dim;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(kv.k_stride)));
  for (int64_t j = 0; j < padded; j += kKeys) {
    float* dst = s.keys.data() + j * dim;
    const int64_t left = length - j;
    if (left <= 0) {
      std::memset(dst, 0, kKeys * dim * sizeof(float));
      continue;
    }
    const __mmask16 live = xllm_simd::lanes(left);
    const float* src = kv.k + j * kv.k_stride;
    for (int64_t d = 0; d < dim; ++d)
      _mm512_storeu_ps(dst + d * kKeys, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows, src + d, 4));
  }
  float* vp = s.values.data();
  for (int64_t j = 0; j < length; ++j) std::memcpy(vp + j * dim, kv.v + j * kv.v_stride, dim * sizeof(float));
  std::memset(vp + length * dim, 0, (padded - length) * dim * sizeof(float));
}

// A block's products on 16 float32 lanes, for what AMX does not take: bfloat16 on CPUs with
// AVX512-BF16 but no AMX (AMD EPYC Zen 4/5 here; there torch's fused kernel has no tiles either
// and was half of a bfloat16 prefill: 16 x 320 tokens of the 4-layer model, 12.6 ms a layer,
// perf/RESULTS.md, fourteenth session), and float32 everywhere.
// A step adds, in each lane, a row's value times the lane's: bfloat16 pairs by one dot product
// (two products a lane: 2 dims, or 2 keys' probabilities, against 16 keys' or 16 dims' pairs
// packed side by side), float32 by an FMA. kPair: the products a step adds to a lane.
template <typename T>
struct Lanes;

template <>
struct Lanes<bf16> {
  static constexpr int kPair = 2;
  using Vector = __m512bh;
  static Vector load(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vector broadcast(const bf16* p) { return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void store(bf16* p, __m512 x, __mmask16 live) { xllm_simd::store_bf16(p, x, live); }
};

template <>
struct Lanes<float> {
  static constexpr int kPair = 1;
  using Vector = __m512;
  static Vector load(const float* p) { return _mm512_loadu_ps(p); }
  static Vector broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static __m512 add(__m512 acc, Vector a, Vector b) { return _mm512_fmadd_ps(a, b, acc); }
  static void store(float* p, __m512 x, __mmask16 live) { _mm512_mask_storeu_ps(p, live, x); }
};

// Scores of query rows [0, R) against keys [k0, k0 + 16 N): R x N accumulators, so that each
// loaded vector of keys serves R rows and each broadcast query step N vectors of keys.
template <typename T, int R, int N>
inline void scores_lanes(const T* qs, const T* kp, int64_t wide, int64_t k0, float* scores, int64_t width) {
  using L = Lanes<T>;
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  const T* keys = kp + k0 * wide;  // block k0 / 16 of the packed keys
  for (int64_t p = 0; p < wide / L::kPair; ++p) {
    typename L::Vector kv[N];
    for (int n = 0; n < N; ++n) kv[n] = L::load(keys + n * kKeys * wide + p * L::kPair * kKeys);
    for (int r = 0; r < R; ++r) {
      const typename L::Vector qv = L::broadcast(qs + r * wide + L::kPair * p);
      for (int n = 0; n < N; ++n) acc[r][n] = L::add(acc[r][n], qv, kv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(scores + r * width + k0 + n * kKeys, acc[r][n]);
}

// Outputs of rows [r0, r0 + R) at dims [d0, d0 + 16 N) over their first `keys` keys (a multiple
// of kPair), times each row's 1 / total.
template <typename T, int R, int N>
inline void values_lanes(const Block<T>& b, int r0, const T* probs, const T* vp, int64_t wide, int64_t d0,
                         int64_t width, int64_t keys, int64_t dim, const float* inverse) {
  using L = Lanes<T>;
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; j += L::kPair) {
    const T* at = vp + j * wide + d0 * L::kPair;  // key step j / kPair of the packed values
    typename L::Vector vv[N];
    for (int n = 0; n < N; ++n) vv[n] = L::load(at + n * L::kPair * kKeys);
    for (int r = 0; r < R; ++r) {
      const typename L::Vector pv = L::broadcast(probs + (r0 + r) * width + j);
      for (int n = 0; n < N; ++n) acc[r][n] = L::add(acc[r][n], pv, vv[n]);
    }
  }
  for (int r = 0; r < R && r0 + r < b.rows; ++r) {
    const __m512 scale = _mm512_set1_ps(inverse[r0 + r]);
    for (int n = 0; n < N; ++n) {
      const int64_t d = d0 + n * kKeys;
      if (d < dim) L::store(b.out[r0 + r] + d, _mm512_mul_ps(acc[r][n], scale), xllm_simd::lanes(dim - d));
    }
  }
}

// The keys rows [r0, r0 + count) see, the most of them (a causal block's first rows see fewer
// than its last: each group of rows stops at its own).
template <typename T>
inline int64_t reach(const Block<T>& b, int r0, int count) {
  return *std::max_element(b.seen + r0, b.seen + r0 + count);
}

// A block of up to 32 query rows on lanes, 8 rows at a time: scores against 32 keys a step, the
// softmax, then outputs 32 dims a step (16 for the last of a float32 head whose width is an odd
// multiple of 16). Groups of 8 rows: each vector of keys (or values) loaded serves 8 rows. In
// float32, groups of 4 against 64 keys took a 16 x 320-token prefill with heads of 128 47-55 ms
// here, groups of 8 39-41 (2 threads); bfloat16 got the same sums, 1.02-1.17x sooner.
// Rows past b.rows repeat the last one (attend_rows), so whole groups are always real queries.
template <typename T>
void block_lanes(const Packed<T>& a, Scratch<T>& s, const Block<T>& b) {
  constexpr int kRows = 8, kPair = Lanes<T>::kPair;
  const int64_t wide = a.wide;
  const int64_t width = (b.span + kKeys - 1) / kKeys * kKeys;  // whole vectors of scores
  const T* qs = s.queries.data();
  const T* kp = s.keys.data();
  const T* vp = s.values.data();
  float* scores = s.scores.data();
  T* probs = s.probs.data();
  const int rows = (b.rows + kRows - 1) / kRows * kRows;
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t span = (reach(b, r0, kRows) + kKeys - 1) / kKeys * kKeys;
    int64_t k0 = 0;
    for (; k0 + 2 * kKeys <= span; k0 += 2 * kKeys)
      scores_lanes<T, kRows, 2>(qs + r0 * wide, kp, wide, k0, scores + r0 * width, width);
    if (k0 < span) scores_lanes<T, kRows, 1>(qs + r0 * wide, kp, wide, k0, scores + r0 * width, width);
  }
  float inverse[kBlockRows];
  softmax_rows(b, b.rows, scores, probs, width, a.scale, inverse);
  // Probability rows past b.rows are read by the last group: give them the last real row's, so
  // that no stale scratch (perhaps NaN) is multiplied.
  for (int r = b.rows; r < rows; ++r) std::memcpy(probs + r * width, probs + (b.rows - 1) * width, width * sizeof(T));
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t keys = (reach(b, r0, kRows) + kPair - 1) / kPair * kPair;  // (zeros past what a row sees)
    int64_t d0 = 0;
    for (; d0 + 2 * kKeys <= wide; d0 += 2 * kKeys)
      values_lanes<T, kRows, 2>(b, r0, probs, vp, wide, d0, width, keys, a.dim, inverse);
    if (d0 < wide) values_lanes<T, kRows, 1>(b, r0, probs, vp, wide, d0, width, keys, a.dim, inverse);
  }
}

// Query rows [0, rows) of one key head against its `length` keys (packed into s already): a
// block of 32 at a time; row_at(r, b, i) fills slot i of block b with row r's query, output,
// log-sum-exp and the keys it sees.
template <typename T, typename RowAt>
void attend_rows(const Packed<T>& a, Scratch<T>& s, int64_t rows, const RowAt& row_at) {
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
    Block<T> b;
    b.rows = static_cast<int>(std::min<int64_t>(kBlockRows, rows - r0));
    for (int i = 0; i < kBlockRows; ++i) row_at(std::min(r0 + i, rows - 1), b, i);  // (a short block repeats its last row)
    b.span = *std::max_element(b.seen, b.seen + kBlockRows);
#if defined(__AMX_BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      block_amx(a, s, b);
      continue;
    }
#endif
    block_lanes(a, s, b);
  }
}

// The block's query i, `wide` apart and zero past dim.
template <typename T>
inline void copy_query(const Packed<T>& a, Scratch<T>& s, int i, const T* q) {
  T* qs = s.queries.data() + i * a.wide;
  std::memcpy(qs, q, a.dim * sizeof(T));
  if (a.wide > a.dim) std::memset(qs + a.dim, 0, (a.wide - a.dim) * sizeof(T));
}

// One sequence and one key head: its `keys` keys and values (kv), its queries the last q_len of
// them (q's tokens [q_start, q_start + q_len): a prompt whose first keys came from the prefix
// cache, or all of them), from query `first` on (q_len - 1: the last only), written from out row
// `out_row` on. Rows are (position, head of the group), position-major; a query sees the keys up
// to its own, so its sums are those of the same token computed with the whole prompt.
template <typename T>
void attend_one(const Packed<T>& a, Scratch<T>& s, const KeySpan<T>& kv, int64_t keys, int64_t q_start, int64_t q_len,
                int64_t kv_head, int64_t first, int64_t out_row) {
  const int64_t group = a.heads / a.kv_heads;
  const int64_t padded = (keys + 31) / 32 * 32;
  const int64_t before = keys - q_len;  // keys ahead of the first query (the cached prefix)
  s.fit(padded, a.wide);
  pack(a, s, kv, keys, padded);
  attend_rows(a, s, (q_len - first) * group, [&](int64_t row, Block<T>& b, int i) {
    int64_t pos = first + row / group, head = kv_head * group + row % group;
    copy_query(a, s, i, a.q + (q_start + pos) * a.q_stride + head * a.dim);
    b.out[i] = a.out + ((out_row + pos - first) * a.heads + head) * a.dim;
    b.lse[i] = nullptr;
    b.seen[i] = before + pos + 1;
  });
}

// Queries' dtype: bfloat16 or float32, and every other tensor in it.
void check_dtype(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q must be bfloat16 or float32");
}

void check_tokens(const at::Tensor& x, const char* name, int64_t dim, const at::Tensor& q) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == q.scalar_type(), name, " must be a CPU tensor of q's dtype");
  TORCH_CHECK(x.dim() == 3 && x.size(2) == dim && x.stride(2) == 1 && x.stride(1) == dim,
              name, " must be [tokens, heads, dim] with contiguous heads");
}

// The packed layouts' width for a head of `dim` (Packed::wide).
template <typename T>
int64_t wide_for(int64_t dim) {
  return std::is_same_v<T, bf16> ? (dim + 31) / 32 * 32 : dim;
}

template <typename T>
inline const T* elements(const at::Tensor& x) {
  return reinterpret_cast<const T*>(x.data_ptr());
}

// A thread's scratch and, in bfloat16 on AMX, its tile layout for the length of a call.
template <typename T>
struct Worker {
  Scratch<T> s;
  std::optional<Tiles> tiles;
  Worker() {
    if constexpr (std::is_same_v<T, bf16>) tiles.emplace();
  }
};

template <typename T>
void varlen_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                 const std::vector<int64_t>& starts, float scale, bool last_only, at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  Packed<T> a{elements<T>(q), elements<T>(k), elements<T>(v), reinterpret_cast<T*>(out.data_ptr()),
              q.stride(0), k.stride(0), v.stride(0), heads, kv_heads, dim, wide_for<T>(dim), scale};
  const int64_t items = static_cast<int64_t>(starts.size()) * kv_heads;
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    Worker<T> w;
    for (int64_t item = begin; item < end; item += step) {
      int64_t seq = item / kv_heads, head = item % kv_heads, n = lengths[seq], start = starts[seq];
      const KeySpan<T> kv{a.k + start * a.k_stride + head * dim, a.v + start * a.v_stride + head * dim, a.k_stride,
                          a.v_stride};
      attend_one(a, w.s, kv, n, start, n, head, last_only ? n - 1 : 0, last_only ? seq : start);
    }
  };
  xllm_parallel::interleaved_items(items, run);
}

// q [tokens, heads, dim], k/v [tokens, kv_heads, dim] (any token stride), prompts of `lengths`
// packed end to end -> [tokens, heads, dim], or [prompts, heads, dim] for each one's last token;
// all bfloat16 or all float32.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                            double scale, bool last_only) {
  const int64_t dim = q.size(-1);
  check_dtype(q);
  check_tokens(q, "q", dim, q);
  check_tokens(k, "k", dim, q);
  check_tokens(v, "v", dim, q);
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  const bool half = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && v.size(1) == kv_heads, "query heads must group over key heads");
  TORCH_CHECK(!half || k.stride(0) % 2 == 0, "bfloat16 keys are gathered in pairs: their token stride must be even");
  std::vector<int64_t> starts;
  int64_t total = 0;
  for (int64_t n : lengths) {
    TORCH_CHECK(n > 0, "every prompt needs a token");
    starts.push_back(total);
    total += n;
  }
  TORCH_CHECK(total == tokens && k.size(0) >= tokens && v.size(0) >= tokens, "lengths must add up to the tokens");
  auto out = at::empty({last_only ? static_cast<int64_t>(starts.size()) : tokens, heads, dim}, q.options());
  if (half) {
    TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
    varlen_into<bf16>(q, k, v, lengths, starts, static_cast<float>(scale), last_only, out);
  } else {
    varlen_into<float>(q, k, v, lengths, starts, static_cast<float>(scale), last_only, out);
  }
  return out;
}

template <typename T>
void cached_into(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, at::IntArrayRef q_lengths,
                 at::IntArrayRef kv_lengths, const std::vector<int64_t>& starts, float scale, bool last_only,
                 at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = keys.size(1), dim = q.size(2);
  Packed<T> a{elements<T>(q), nullptr, nullptr, reinterpret_cast<T*>(out.data_ptr()), q.stride(0), 0, 0, heads,
              kv_heads, dim, wide_for<T>(dim), scale};
  const int64_t items = static_cast<int64_t>(starts.size()) * kv_heads;
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    Worker<T> w;
    for (int64_t item = begin; item < end; item += step) {
      int64_t seq = item / kv_heads, head = item % kv_heads, n = q_lengths[seq], start = starts[seq];
      const KeySpan<T> kv{elements<T>(keys) + seq * keys.stride(0) + head * keys.stride(1),
                          elements<T>(values) + seq * values.stride(0) + head * values.stride(1), dim, dim};
      attend_one(a, w.s, kv, kv_lengths[seq], start, n, head, last_only ? n - 1 : 0, last_only ? seq : start);
    }
  };
  xllm_parallel::interleaved_items(items, run);
}

// Prompts whose first keys came from the prefix cache: q [tokens, heads, dim] holds only each
// prompt's last q_lengths[i] tokens, packed end to end; keys/values [prompts, kv_heads, capacity,
// dim] are their cache rows (tokens contiguous, any row and head stride), kv_lengths[i] keys each,
// the new ones already written -> [tokens, heads, dim], or [prompts, heads, dim] for each one's
// last token. Each query's sums are those varlen_attention gives the same token of the whole prompt.
at::Tensor varlen_attention_cached(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                   at::IntArrayRef q_lengths, at::IntArrayRef kv_lengths, double scale,
                                   bool last_only) {
  const int64_t dim = q.size(-1);
  check_dtype(q);
  check_tokens(q, "q", dim, q);
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  const int64_t prompts = static_cast<int64_t>(q_lengths.size());
  for (const at::Tensor* x : {&keys, &values}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type(),
                "keys and values must be CPU tensors of q's dtype");
    TORCH_CHECK(x->dim() == 4 && x->size(3) == dim && x->stride(3) == 1 && x->stride(2) == dim &&
                    x->sizes() == keys.sizes() && x->size(0) >= prompts,
                "keys and values must be [prompts, kv_heads, capacity, dim] alike with contiguous tokens");
  }
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = keys.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must group over key heads");
  TORCH_CHECK(static_cast<int64_t>(kv_lengths.size()) == prompts, "a key length for every prompt");
  std::vector<int64_t> starts;
  int64_t total = 0;
  for (int64_t i = 0; i < prompts; ++i) {
    TORCH_CHECK(q_lengths[i] > 0, "every prompt needs a token");
    TORCH_CHECK(kv_lengths[i] >= q_lengths[i] && kv_lengths[i] <= keys.size(2),
                "a prompt's keys are its queries and what precedes them, within the cache's capacity");
    starts.push_back(total);
    total += q_lengths[i];
  }
  TORCH_CHECK(total == tokens, "query lengths must add up to the tokens");
  auto out = at::empty({last_only ? prompts : tokens, heads, dim}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
    cached_into<bf16>(q, keys, values, q_lengths, kv_lengths, starts, static_cast<float>(scale), last_only, out);
  } else {
    cached_into<float>(q, keys, values, q_lengths, kv_lengths, starts, static_cast<float>(scale), last_only, out);
  }
  return out;
}

template <typename T>
void prefix_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, at::Tensor& out,
                 at::Tensor& lse) {
  const int64_t beams = q.size(0), heads = q.size(1), kv_heads = k.size(0), length = k.size(1), dim = q.size(2);
  Packed<T> a{elements<T>(q), nullptr, nullptr, reinterpret_cast<T*>(out.data_ptr()), q.stride(0), 0, 0, heads,
              kv_heads, dim, wide_for<T>(dim), scale};
  float* lse_at = lse.data_ptr<float>();
  const int64_t group = heads / kv_heads, padded = (length + 31) / 32 * 32;
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    Worker<T> w;
    w.s.fit(padded, a.wide);
    for (int64_t kv_head = begin; kv_head < end; kv_head += step) {
      pack(a, w.s, {elements<T>(k) + kv_head * k.stride(0), elements<T>(v) + kv_head * v.stride(0), dim, dim}, length,
           padded);
      attend_rows(a, w.s, beams * group, [&](int64_t row, Block<T>& b, int i) {
        int64_t beam = row / group, head = kv_head * group + row % group;
        copy_query(a, w.s, i, a.q + beam * a.q_stride + head * dim);
        b.out[i] = a.out + (beam * heads + head) * dim;
        b.lse[i] = lse_at + beam * heads + head;
        b.seen[i] = length;
      });
    }
  };
  xllm_parallel::interleaved_items(kv_heads, run);
}

// A beam round's prompt stage: every beam of a request (q [beams, heads, dim], any beam stride)
// against all of the request's prompt keys k/v [kv_heads, length, dim] (a cache slab: tokens
// contiguous, any head stride), no mask -> (out [beams, heads, dim], and each row's log-sum-exp
// [beams, heads] in float32, to merge with the beams' own tokens). All beams of a key head share
// one packing of its keys and values: 128 beams x 2 heads are 8 blocks of 32 rows against it.
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale) {
  const int64_t dim = q.size(-1);
  check_dtype(q);
  check_tokens(q, "q", dim, q);
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == q.scalar_type(),
                "k and v must be CPU tensors of q's dtype");
    TORCH_CHECK(x->dim() == 3 && x->size(2) == dim && x->stride(2) == 1 && x->stride(1) == dim &&
                    x->sizes() == k.sizes(),
                "k and v must be [kv_heads, tokens, dim] alike with contiguous tokens");
  }
  const int64_t beams = q.size(0), heads = q.size(1), kv_heads = k.size(0), length = k.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must group over key heads");
  TORCH_CHECK(length > 0, "the prompt needs a token");
  auto out = at::empty({beams, heads, dim}, q.options());
  auto lse = at::empty({beams, heads}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
    prefix_into<bf16>(q, k, v, static_cast<float>(scale), out, lse);
  } else {
    prefix_into<float>(q, k, v, static_cast<float>(scale), out, lse);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, int[] lengths, float scale, bool last_only) -> Tensor");
  m.def("prefix_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.def("varlen_attention_cached(Tensor q, Tensor keys, Tensor values, int[] q_lengths, int[] kv_lengths, "
        "float scale, bool last_only) -> Tensor");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("varlen_attention", &varlen_attention);
  m.impl("prefix_attention", &prefix_attention);
  m.impl("varlen_attention_cached", &varlen_attention_cached);
}

#endif  // __AVX512BF16__
