// Causal attention over packed prompts in bfloat16 on CPU, one call for a whole batch
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
// - on CPUs with AMX, tile products (block_amx);
// - on CPUs with AVX512-BF16 but no AMX (AMD EPYC Zen 4/5 here), dot products of bfloat16 pairs
//   on 16 lanes (block_dot), over the same packed keys and values: there torch's fused kernel has
//   no tiles either and was half of a bfloat16 prefill (16 x 320 tokens of the 4-layer model:
//   12.6 ms a layer, perf/RESULTS.md, fourteenth session).
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

struct Packed {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* out;
  int64_t q_stride, k_stride, v_stride;  // between tokens
  int64_t heads, kv_heads, dim;
  int64_t wide;  // dim rounded up to 32: the packed layouts' width, zeros past dim
  float scale;
};

// Scratch for one sequence and key head, reused by a thread across them.
struct Scratch {
  std::vector<bf16> keys, values, probs, queries;
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
struct Block {
  bf16* out[kBlockRows];
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

// Softmax of each row's scores over the keys it sees, times `scale` inside the exponential;
// probabilities rounded to bfloat16 (as torch's kernel does before multiplying the values), up
// to `width` (a multiple of 16) with zeros past what the row sees; inverse[r] = 1 / the row's
// float32 sum.
void softmax_rows(const Block& b, int count, const float* scores, bf16* probs, int64_t width, float scale,
                  float* inverse) {
  const float log2_scale = scale * 1.44269504088896341f;  // e^(x scale) = 2^(x scale log2(e))
  const __m512 vscale = _mm512_set1_ps(log2_scale);
  for (int r = 0; r < count; ++r) {
    const float* sr = scores + r * width;
    bf16* pr = probs + r * width;
    const int64_t seen = b.seen[r];
    const float peak = row_max(sr, seen) * log2_scale;  // in log2 units
    const __m512 shift = _mm512_set1_ps(peak);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += kKeys) {
      const int64_t left = seen - j;
      __m512 e = _mm512_setzero_ps();
      if (left > 0) {
        e = exp2_softmax(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), vscale, shift));
        if (left < kKeys) e = _mm512_maskz_mov_ps(xllm_simd::lanes(left), e);
        total = _mm512_add_ps(total, e);
      }
      xllm_simd::store_bf16(pr + j, e, 0xFFFF);
    }
    const float sum = _mm512_reduce_add_ps(total);
    inverse[r] = 1.f / sum;
    if (b.lse[r] != nullptr) *b.lse[r] = peak * 0.693147180559945309f + std::log(sum);  // ln of sum e^(x scale)
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
struct KeySpan {
  const bf16* k;
  const bf16* v;
  int64_t k_stride, v_stride;
};

void pack(const Packed& a, Scratch& s, const KeySpan& kv, int64_t length, int64_t padded) {
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
void block_amx(const Packed& a, Scratch& s, const Block& b) {
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

// One dot product of bfloat16 pairs adds, in each of 16 float32 lanes, a[2i] b[2i] + a[2i+1] b[2i+1]:
// with a row's pair (2 dims, or 2 keys' probabilities) in every lane, against 16 keys' (or 16
// dims') pairs packed side by side, it is one step of 16 scores (or outputs).
inline __m512bh pair_of(const bf16* p) {
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

inline __m512bh vector_at(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Scores of query rows [r0, r0 + R) against keys [k0, k0 + 16 N): R x N accumulators, so that
// each loaded vector of keys serves R rows and each broadcast row pair N vectors of keys.
template <int R, int N>
inline void scores_dot(const bf16* qs, const bf16* kp, int64_t wide, int64_t k0, float* scores, int64_t width) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  const bf16* keys = kp + k0 * wide;  // block k0 / 16 of [block][dim pair][key][2]
  for (int64_t p = 0; p < wide / 2; ++p) {
    __m512bh kv[N];
    for (int n = 0; n < N; ++n) kv[n] = vector_at(keys + n * kKeys * wide + p * 2 * kKeys);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = pair_of(qs + r * wide + 2 * p);
      for (int n = 0; n < N; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], qv, kv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(scores + r * width + k0 + n * kKeys, acc[r][n]);
}

// Outputs of rows [0, R) (probabilities `probs`, `width` apart) at dims [d0, d0 + 16 N) over
// `width` keys (key pairs of [key pair][dim][2] values), times each row's 1 / total, as bfloat16.
template <int R, int N>
inline void values_dot(const Block& b, int r0, const bf16* probs, const bf16* vp, int64_t wide, int64_t d0,
                       int64_t width, int64_t dim, const float* inverse) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 2) {
    const bf16* pairs = vp + (j / 2) * wide * 2 + d0 * 2;
    __m512bh vv[N];
    for (int n = 0; n < N; ++n) vv[n] = vector_at(pairs + n * 2 * kKeys);
    for (int r = 0; r < R; ++r) {
      const __m512bh pv = pair_of(probs + (r0 + r) * width + j);
      for (int n = 0; n < N; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], pv, vv[n]);
    }
  }
  for (int r = 0; r < R && r0 + r < b.rows; ++r) {
    const __m512 scale = _mm512_set1_ps(inverse[r0 + r]);
    for (int n = 0; n < N; ++n) {
      const int64_t d = d0 + n * kKeys;
      if (d < dim) xllm_simd::store_bf16(b.out[r0 + r] + d, _mm512_mul_ps(acc[r][n], scale), xllm_simd::lanes(dim - d));
    }
  }
}

// A block of up to 32 query rows on AVX512-BF16 dot products: scores 4 rows x 64 keys at a time
// (16 accumulators, 4 vectors of keys, a broadcast: 21 of the 32 registers), the softmax as on
// AMX, then outputs 4 rows x 64 dims (or 8 rows x 32 dims for narrow heads). Rows past b.rows
// repeat the last one (attend_rows), so whole groups of 4 or 8 rows are always real queries.
void block_dot(const Packed& a, Scratch& s, const Block& b) {
  const int64_t wide = a.wide;
  const int64_t width = (b.span + kKeys - 1) / kKeys * kKeys;  // whole vectors of scores
  const bf16* qs = s.queries.data();
  const bf16* kp = s.keys.data();
  const bf16* vp = s.values.data();
  float* scores = s.scores.data();
  bf16* probs = s.probs.data();
  const int rows4 = (b.rows + 3) / 4 * 4;
  for (int r0 = 0; r0 < rows4; r0 += 4) {
    const bf16* q4 = qs + r0 * wide;
    float* s4 = scores + r0 * width;
    int64_t k0 = 0;
    for (; k0 + 4 * kKeys <= width; k0 += 4 * kKeys) scores_dot<4, 4>(q4, kp, wide, k0, s4, width);
    for (; k0 < width; k0 += kKeys) scores_dot<4, 1>(q4, kp, wide, k0, s4, width);
  }
  float inverse[kBlockRows];
  softmax_rows(b, b.rows, scores, probs, width, a.scale, inverse);
  // Probability rows past b.rows are read by the last group of 4 (8): give them the last real
  // row's, so that no stale scratch (perhaps NaN) is multiplied.
  const int rows8 = (b.rows + 7) / 8 * 8;
  for (int r = b.rows; r < std::min(rows8, kBlockRows); ++r)
    std::memcpy(probs + r * width, probs + (b.rows - 1) * width, width * sizeof(bf16));
  int64_t d0 = 0;
  for (; d0 + 64 <= wide; d0 += 64)
    for (int r0 = 0; r0 < rows4; r0 += 4) values_dot<4, 4>(b, r0, probs, vp, wide, d0, width, a.dim, inverse);
  if (d0 < wide)  // the last 32 dims (wide is a multiple of 32)
    for (int r0 = 0; r0 < rows8; r0 += 8) values_dot<8, 2>(b, r0, probs, vp, wide, d0, width, a.dim, inverse);
}

#endif  // __AMX_BF16__

// Query rows [0, rows) of one key head against its `length` keys (packed into s already): a
// block of 32 at a time; row_at(r, b, i) fills slot i of block b with row r's query, output,
// log-sum-exp and the keys it sees.
template <typename RowAt>
void attend_rows(const Packed& a, Scratch& s, int64_t rows, const RowAt& row_at) {
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
    Block b;
    b.rows = static_cast<int>(std::min<int64_t>(kBlockRows, rows - r0));
    for (int i = 0; i < kBlockRows; ++i) row_at(std::min(r0 + i, rows - 1), b, i);  // (a short block repeats its last row)
    b.span = *std::max_element(b.seen, b.seen + kBlockRows);
#if defined(__AMX_BF16__)
    block_amx(a, s, b);
#else
    block_dot(a, s, b);
#endif
  }
}

// The block's query i, `wide` apart and zero past dim.
inline void copy_query(const Packed& a, Scratch& s, int i, const bf16* q) {
  bf16* qs = s.queries.data() + i * a.wide;
  std::memcpy(qs, q, a.dim * sizeof(bf16));
  if (a.wide > a.dim) std::memset(qs + a.dim, 0, (a.wide - a.dim) * sizeof(bf16));
}

// One sequence (tokens [start, start + length)) and one key head: its queries from position
// `first` on (length - 1: its last token only), written from out row `out_row` on. Rows are
// (position, head of the group), position-major.
void attend_one(const Packed& a, Scratch& s, int64_t start, int64_t length, int64_t kv_head, int64_t first,
                int64_t out_row) {
  const int64_t group = a.heads / a.kv_heads;
  const int64_t padded = (length + 31) / 32 * 32;
  s.fit(padded, a.wide);
  pack(a, s, {a.k + start * a.k_stride + kv_head * a.dim, a.v + start * a.v_stride + kv_head * a.dim, a.k_stride,
              a.v_stride}, length, padded);
  attend_rows(a, s, (length - first) * group, [&](int64_t row, Block& b, int i) {
    int64_t pos = first + row / group, head = kv_head * group + row % group;
    copy_query(a, s, i, a.q + (start + pos) * a.q_stride + head * a.dim);
    b.out[i] = a.out + ((out_row + pos - first) * a.heads + head) * a.dim;
    b.lse[i] = nullptr;
    b.seen[i] = pos + 1;
  });
}

void check_tokens(const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 3 && x.size(2) == dim && x.stride(2) == 1 && x.stride(1) == dim,
              name, " must be [tokens, heads, dim] with contiguous heads");
}

// q [tokens, heads, dim], k/v [tokens, kv_heads, dim] (any token stride), prompts of `lengths`
// packed end to end -> [tokens, heads, dim], or [prompts, heads, dim] for each one's last token.
at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef lengths,
                            double scale, bool last_only) {
  const int64_t dim = q.size(-1);
  check_tokens(q, "q", dim);
  check_tokens(k, "k", dim);
  check_tokens(v, "v", dim);
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && v.size(1) == kv_heads, "query heads must group over key heads");
  TORCH_CHECK(k.stride(0) % 2 == 0, "keys are gathered in pairs: their token stride must be even");
  std::vector<int64_t> starts;
  int64_t total = 0;
  for (int64_t n : lengths) {
    TORCH_CHECK(n > 0, "every prompt needs a token");
    starts.push_back(total);
    total += n;
  }
  TORCH_CHECK(total == tokens && k.size(0) >= tokens && v.size(0) >= tokens, "lengths must add up to the tokens");
  const int64_t seqs = static_cast<int64_t>(starts.size());
  auto out = at::empty({last_only ? seqs : tokens, heads, dim}, q.options());
  Packed a{reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(k.data_ptr()),
           reinterpret_cast<const bf16*>(v.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()),
           q.stride(0), k.stride(0), v.stride(0), heads, kv_heads, dim, (dim + 31) / 32 * 32,
           static_cast<float>(scale)};
  const int64_t items = seqs * kv_heads;
  TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    Scratch s;
    Tiles tiles;
    for (int64_t item = begin; item < end; item += step) {
      int64_t seq = item / kv_heads, head = item % kv_heads, n = lengths[seq];
      attend_one(a, s, starts[seq], n, head, last_only ? n - 1 : 0, last_only ? seq : starts[seq]);
    }
  };
  xllm_parallel::interleaved_items(items, run);
  return out;
}

// A beam round's prompt stage: every beam of a request (q [beams, heads, dim], any beam stride)
// against all of the request's prompt keys k/v [kv_heads, length, dim] (a cache slab: tokens
// contiguous, any head stride), no mask -> (out [beams, heads, dim], and each row's log-sum-exp
// [beams, heads] in float32, to merge with the beams' own tokens). All beams of a key head share
// one packing of its keys and values: 128 beams x 2 heads are 8 blocks of 32 rows against it.
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale) {
  const int64_t dim = q.size(-1);
  check_tokens(q, "q", dim);
  TORCH_CHECK(dim % 16 == 0 && dim <= 512, "head width must be a multiple of 16, at most 512");
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kBFloat16, "k and v must be bfloat16 CPU tensors");
    TORCH_CHECK(x->dim() == 3 && x->size(2) == dim && x->stride(2) == 1 && x->stride(1) == dim &&
                    x->sizes() == k.sizes(),
                "k and v must be [kv_heads, tokens, dim] alike with contiguous tokens");
  }
  const int64_t beams = q.size(0), heads = q.size(1), kv_heads = k.size(0), length = k.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must group over key heads");
  TORCH_CHECK(length > 0, "the prompt needs a token");
  auto out = at::empty({beams, heads, dim}, q.options());
  auto lse = at::empty({beams, heads}, q.options().dtype(at::kFloat));
  Packed a{reinterpret_cast<const bf16*>(q.data_ptr()), nullptr, nullptr, reinterpret_cast<bf16*>(out.data_ptr()),
           q.stride(0), 0, 0, heads, kv_heads, dim, (dim + 31) / 32 * 32, static_cast<float>(scale)};
  const bf16* keys = reinterpret_cast<const bf16*>(k.data_ptr());
  const bf16* values = reinterpret_cast<const bf16*>(v.data_ptr());
  float* lse_at = lse.data_ptr<float>();
  const int64_t group = heads / kv_heads, padded = (length + 31) / 32 * 32;
  TORCH_CHECK(amx_permitted(), "this process may not use AMX (arch_prctl refused)");
  auto run = [&](int64_t begin, int64_t end, int64_t step) {
    Scratch s;
    Tiles tiles;
    s.fit(padded, a.wide);
    for (int64_t kv_head = begin; kv_head < end; kv_head += step) {
      pack(a, s, {keys + kv_head * k.stride(0), values + kv_head * v.stride(0), dim, dim}, length, padded);
      attend_rows(a, s, beams * group, [&](int64_t row, Block& b, int i) {
        int64_t beam = row / group, head = kv_head * group + row % group;
        copy_query(a, s, i, a.q + beam * a.q_stride + head * dim);
        b.out[i] = a.out + (beam * heads + head) * dim;
        b.lse[i] = lse_at + beam * heads + head;
        b.seen[i] = length;
      });
    }
  };
  xllm_parallel::interleaved_items(kv_heads, run);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, int[] lengths, float scale, bool last_only) -> Tensor");
  m.def("prefix_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("varlen_attention", &varlen_attention);
  m.impl("prefix_attention", &prefix_attention);
}

#endif  // __AVX512BF16__
