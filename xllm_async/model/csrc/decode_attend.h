// One (row, key head) of a decode step's attention, as decode_attention.cpp computes it, for the
// one-team step (team_step.cpp), which shares a step's items between its own threads.

#pragma once

#include <cstdint>
#include <vector>

namespace xllm_decode {

template <typename T>
struct Step;  // the step's tensors as pointers and strides (decode_keys.h)

// T: uint16_t (bfloat16 bits) or float; scratch: the caller's (a long row's spans' partials), reused.
template <typename T>
void attend_item(const Step<T>& a, int64_t row, int64_t kv_head, std::vector<float>& partials);

}  // namespace xllm_decode
