// A grammar's token mask applied to its rows' logits in place (structured outputs,
// execution/grammar.py): bit i of a row's int32 words kept set keeps token i, a clear bit makes its
// logit -inf. xgrammar ships the same operation; its CPU loop tests every bit of every row (~0.2 ms
// a row over 49,152 tokens here, ~4% of a constrained decode step at 4 rows). Here a word at a
// time: a word all set (free text) is skipped, a word all clear (a structural state) is one run of
// stores, and only mixed words are read bit by bit. The answers are the same bits.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

// On the values' bits (uint32 for float32, uint16 for bfloat16 and float16, whose -inf is one
// pattern): integer selects the compiler vectorises, where a c10::BFloat16 store is a call.
template <typename Bits>
void mask_rows(at::Tensor& logits, const at::Tensor& bitmask, c10::IntArrayRef rows, Bits forbidden) {
  const int64_t vocab = logits.size(1), words = (vocab + 31) / 32;
  for (int64_t row : rows) {
    Bits* out = reinterpret_cast<Bits*>(logits.data_ptr()) + row * logits.stride(0);
    const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + row * bitmask.stride(0);
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = bits[w];
      if (word == 0xFFFFFFFFu) continue;
      Bits* o = out + w * 32;
      const int64_t n = std::min<int64_t>(32, vocab - w * 32);
      if (n == 32) {
        for (int i = 0; i < 32; ++i) o[i] = ((word >> i) & 1u) ? o[i] : forbidden;
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = ((word >> i) & 1u) ? o[i] : forbidden;
      }
    }
  }
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, c10::IntArrayRef rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab] with unit column stride");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.stride(1) == 1,
              "bitmask must be int32 [rows, words] with unit column stride");
  TORCH_CHECK(bitmask.size(1) * 32 >= logits.size(1), "bitmask has fewer bits than logits has columns");
  for (int64_t row : rows) {
    TORCH_CHECK(row >= 0 && row < logits.size(0) && row < bitmask.size(0), "row ", row, " out of range");
  }
  switch (logits.scalar_type()) {
    case at::kFloat: mask_rows<uint32_t>(logits, bitmask, rows, 0xFF800000u); break;
    case at::kBFloat16: mask_rows<uint16_t>(logits, bitmask, rows, 0xFF80u); break;
    case at::kHalf: mask_rows<uint16_t>(logits, bitmask, rows, 0xFC00u); break;
    default: TORCH_CHECK(false, "logits must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, int[] rows) -> ()");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
