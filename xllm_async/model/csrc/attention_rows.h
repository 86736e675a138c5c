// What the packed attention operators share (varlen_attention.cpp, cached_attention.cpp,
// prefix_attention.cpp): a key head's query rows a block of 32 at a time, on AMX's tiles
// (attention_amx.h) or on lanes (attention_lanes.h); one prompt and key head from its packing to
// its outputs; the checks of their tensors; and a thread's scratch for a call.
// Include only under #if defined(__AVX512BF16__).

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_lanes.h"
#include "attention_packing.h"

namespace xllm_attention {

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
// cache, or all of them), queries [first, end) of them (a QueryPiece's), written from out row
// `out_row` on. Rows are (position, head of the group), position-major; a query sees the keys up
// to its own, so its sums are those of the same token computed with the whole prompt, whichever
// piece it is in (a key it does not see adds exact zeros: its probability is 0).
template <typename T>
void attend_one(const Packed<T>& a, Scratch<T>& s, const KeySpan<T>& kv, int64_t keys, int64_t q_start, int64_t q_len,
                int64_t kv_head, int64_t first, int64_t end, int64_t out_row) {
  const int64_t group = a.heads / a.kv_heads;
  const int64_t before = keys - q_len;  // keys ahead of the first query (the cached prefix)
  const int64_t seen = before + end;    // the keys this piece's last query sees
  const int64_t padded = (seen + 31) / 32 * 32;
  s.fit(padded, a.wide);
  pack(a, s, kv, seen, padded);
  attend_rows(a, s, (end - first) * group, [&](int64_t row, Block<T>& b, int i) {
    int64_t pos = first + row / group, head = kv_head * group + row % group;
    copy_query(a, s, i, a.q + (q_start + pos) * a.q_stride + head * a.dim);
    b.out[i] = a.out + ((out_row + pos - first) * a.heads + head) * a.dim;
    b.lse[i] = nullptr;
    b.seen[i] = before + pos + 1;
  });
}

// A prefill operator's work item: queries [first, end) of sequence `seq`'s key head `head`.
struct QueryPiece {
  int64_t seq, head, first, end;
  double work;  // the scores it computes, about (its queries x the keys each sees)
};

// The work items of a call over sequences of q_lengths queries after kv_lengths[i] - q_lengths[i]
// cached keys (varlen: none), split so that `threads` threads finish together: a sequence's key
// head is one item where the batch has many, and pieces of its queries where it has few (one long
// prompt over 3 key heads on 2 threads left one thread a third of the time idle). A piece spans
// whole blocks of rows (a multiple of kBlockRows / gcd(kBlockRows, group) queries) but its
// sequence's last; heaviest first, for claimed_items. last_only: each sequence's last query only.
inline std::vector<QueryPiece> query_pieces(at::IntArrayRef q_lengths, at::IntArrayRef kv_lengths, int64_t kv_heads,
                                            int64_t group, bool last_only, int threads) {
  auto work_of = [](int64_t before, int64_t a, int64_t b) {  // sum over queries [a, b) of the keys each sees
    return static_cast<double>(b - a) * static_cast<double>(before) + 0.5 * static_cast<double>(a + 1 + b) * (b - a);
  };
  double total = 0;
  const int64_t sequences = static_cast<int64_t>(q_lengths.size());
  for (int64_t i = 0; i < sequences; ++i) {
    const int64_t n = q_lengths[i], before = kv_lengths[i] - n;
    total += kv_heads * (last_only ? static_cast<double>(before + n) : work_of(before, 0, n));
  }
  // Four pieces a thread: each piece packs the keys it sees again, and at eight a long prompt's
  // repacking ate the gain (one 1,088-token prompt, 2 threads: 1.22x the attention at four, 1.03x
  // at eight, EPYC Zen 4).
  const double target = threads > 1 ? total / (4.0 * threads) : total + 1;
  const int64_t quantum = kBlockRows / std::gcd<int64_t>(kBlockRows, group);  // queries a piece's whole blocks
  std::vector<QueryPiece> pieces, cuts;  // cuts: one sequence's pieces, the same for each of its key heads
  for (int64_t seq = 0; seq < sequences; ++seq) {
    const int64_t n = q_lengths[seq], before = kv_lengths[seq] - n;
    cuts.clear();
    if (last_only) cuts.push_back({seq, 0, n - 1, n, static_cast<double>(before + n)});
    for (int64_t start = 0, end; !last_only && start < n; start = end) {
      end = start + quantum;
      while (end < n && work_of(before, start, end) < target) end += quantum;
      end = std::min(end, n);
      cuts.push_back({seq, 0, start, end, work_of(before, start, end)});
    }
    for (int64_t head = 0; head < kv_heads; ++head)
      for (QueryPiece piece : cuts) {
        piece.head = head;
        pieces.push_back(piece);
      }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const QueryPiece& x, const QueryPiece& y) { return x.work > y.work; });
  return pieces;
}

// Queries' dtype: bfloat16 or float32, and every other tensor in it.
inline void check_dtype(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q must be bfloat16 or float32");
}

inline void check_tokens(const at::Tensor& x, const char* name, int64_t dim, const at::Tensor& q) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == q.scalar_type(), name, " must be a CPU tensor of q's dtype");
  TORCH_CHECK(x.dim() == 3 && x.size(2) == dim && x.stride(2) == 1 && x.stride(1) == dim,
              name, " must be [tokens, heads, dim] with contiguous heads");
}

// The packed layouts' width for a head of `dim` (Packed::wide).
template <typename T>
inline int64_t wide_for(int64_t dim) {
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

}  // namespace xllm_attention
