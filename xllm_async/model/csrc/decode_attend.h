// One (row, key head) of a decode step's attention, as decode_attention.cpp computes it, for the
// one-team step (team_step.cpp), which shares a step's items between its own threads; and the
// rows' sharing of a prompt's prefix, which both take.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace xllm_decode {

template <typename T>
struct Step;  // the step's tensors as pointers and strides (decode_keys.h)

// T: uint16_t (bfloat16 bits) or float; scratch: the caller's (a long row's spans' partials), reused.
template <typename T>
void attend_item(const Step<T>& a, int64_t row, int64_t kv_head, std::vector<float>& partials);

// sharing (SlabCache.sharing): int64 [2, rows], each row's source row, then the keys [0, shared)
// it reads from that row's copy (Step::source, Step::shared); none: every row reads its own. Its
// two lists, or nullptrs where there is none; false where it is malformed for these rows and key
// counts (reads [rows]): a source outside the rows, or more keys than either row holds.
inline bool sharing_lists(const std::optional<at::Tensor>& sharing, int64_t rows, const int64_t* reads,
                          const int64_t*& source, const int64_t*& shared) {
  source = shared = nullptr;
  if (!sharing.has_value() || !sharing->defined()) return true;
  const at::Tensor& s = *sharing;
  if (s.scalar_type() != at::kLong || !s.is_contiguous() || s.dim() != 2 || s.size(0) != 2 || s.size(1) != rows)
    return false;
  const int64_t* from = s.data_ptr<int64_t>();
  const int64_t* keys = from + rows;
  for (int64_t r = 0; r < rows; ++r)
    if (from[r] < 0 || from[r] >= rows || keys[r] < 0 || keys[r] > reads[r] || keys[r] > reads[from[r]]) return false;
  source = from;
  shared = keys;
  return true;
}

}  // namespace xllm_decode
