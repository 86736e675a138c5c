// One (row, key head) of a decode step's attention, as decode_attention.cpp computes it, for the
// one-team step (team_step.cpp), which shares a step's items between its own threads.

#pragma once

#include <cstdint>
#include <vector>

namespace xllm_decode {

// The step's tensors as pointers and element strides: q [rows, heads, dim]; keys and values
// [rows.., kv_heads, capacity, dim] (tokens dim apart); lengths: the keys each row reads; out
// [rows, heads, dim].
struct Slabs {
  const void* q;
  const void* keys;
  const void* values;
  void* out;
  const int64_t* lengths;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  int64_t heads, kv_heads, dim;
  float scale;
};

// T: uint16_t (bfloat16 bits) or float; scratch: the caller's (a long row's spans' partials), reused.
template <typename T>
void attend_item(const Slabs& a, int64_t row, int64_t kv_head, std::vector<float>& scores);

}  // namespace xllm_decode
