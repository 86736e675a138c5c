// exponential_at(generator, n, columns): what torch.empty(n).exponential_(generator=generator) would
// draw at these columns (float32), and the columns where it would draw 0, leaving the generator
// exactly as that call leaves it; without computing the other n - len(columns) draws' logarithms.
// The sampler draws a whole vocabulary's exponentials per sampled row (execution/sampling.py's race);
// a row sampled from its top k (top_sampling.py) needs a few of them, and its generator must go on
// as the whole draw leaves it, so that a seeded request's later tokens are the same.
//
// torch's CPU kernel (ATen/native/cpu/DistributionTemplates.h, exponential_kernel): serially, per
// element, exponential_distribution<double>: u = (random64() & (2^53 - 1)) * 2^-53 and
// -1.0 / lambda * log1p(-u), cast to float; random64() is two outputs of the generator's mt19937,
// the first the high word. Here the same mt19937 (the generator's engine's state, its outputs made a
// state at a time, set back after), every output drawn, the logarithm taken only at the wanted
// columns (the same one for a column asked twice), through a pointer so that the
// compiler (-ffast-math) neither vectorizes nor replaces glibc's scalar log1p, torch's. That
// torch computes this way is an assumption about its internals: execution/top_sampling.py checks it
// against torch's own draw at first use and draws the whole row where it fails.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

double (*volatile log1p_of)(double) = static_cast<double (*)(double)>(std::log1p);

constexpr int kN = 624;  // at::mt19937's state (MT19937RNGEngine.h: MERSENNE_STATE_N, _M)
constexpr int kM = 397;

// at::mt19937's outputs in bulk: fill(dst, count) writes what `count` calls of its operator() return,
// leaving the state as they leave it (left_: one more than the outputs ready before the next twist).
// The twist and tempering are the engine's own (MT19937RNGEngine.h), done a state at a time so that
// the tempering vectorizes, instead of a call, a branch and a dependent load per output.
struct Outputs {
  at::mt19937_data_pod d;

  static uint32_t twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
  }

  void next_state() {
    uint32_t* p = d.state_.data();
    for (int j = 0; j < kN - kM; ++j) p[j] = p[j + kM] ^ twist(p[j], p[j + 1]);
    for (int j = kN - kM; j < kN - 1; ++j) p[j] = p[j + kM - kN] ^ twist(p[j], p[j + 1]);
    p[kN - 1] = p[kM - 1] ^ twist(p[kN - 1], p[0]);
  }

  static void temper(const uint32_t* from, int64_t count, uint32_t* to) {
    for (int64_t i = 0; i < count; ++i) {
      uint32_t y = from[i];
      y ^= (y >> 11);
      y ^= (y << 7) & 0x9d2c5680u;
      y ^= (y << 15) & 0xefc60000u;
      y ^= (y >> 18);
      to[i] = y;
    }
  }

  void fill(uint32_t* dst, int64_t count) {
    while (count > 0) {
      if (d.left_ == 1) {  // the next output twists first (its call's --left_ reaches 0)
        next_state();
        const int64_t c = std::min<int64_t>(count, kN);
        temper(d.state_.data(), c, dst);
        d.next_ = uint32_t(c);
        d.left_ = int(kN - c + 1);
        dst += c, count -= c;
        continue;
      }
      const int64_t c = std::min<int64_t>(count, d.left_ - 1);
      temper(d.state_.data() + d.next_, c, dst);
      d.next_ += uint32_t(c);
      d.left_ -= int(c);
      dst += c, count -= c;
    }
  }
};

std::tuple<at::Tensor, at::Tensor> exponential_at(const std::optional<at::Generator>& generator, int64_t n,
                                                  const at::Tensor& columns) {
  TORCH_CHECK(n >= 0 && columns.dim() == 1, "exponential_at: n >= 0 and 1-d columns");
  auto cols = columns.to(at::kLong).contiguous();
  const int64_t* c = cols.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> wanted;  // (column, slot), by column
  wanted.reserve(size_t(cols.numel()));
  for (int64_t i = 0; i < cols.numel(); ++i) {
    TORCH_CHECK(c[i] >= 0 && c[i] < n, "exponential_at: a column outside [0, n)");
    wanted.emplace_back(c[i], i);
  }
  std::sort(wanted.begin(), wanted.end());
  auto out = at::empty({cols.numel()}, at::kFloat);
  float* o = out.data_ptr<float>();
  std::vector<int64_t> zeros;
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(generator, at::detail::getDefaultCPUGenerator());
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    TORCH_CHECK(gen->engine().is_valid(), "exponential_at: the generator's engine is not in a valid state");
    Outputs outputs{gen->engine().data()};
    constexpr int64_t kChunk = 2048;  // draws a pass: their outputs (16 KB) stay in L1
    constexpr uint64_t kMask = (uint64_t(1) << 53) - 1;
    uint32_t raw[2 * kChunk];
    size_t w = 0;
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const int64_t draws = std::min(kChunk, n - i0);
      outputs.fill(raw, 2 * draws);
      for (int64_t i = 0; i < draws; ++i) {  // random64(): the first output the high word
        if ((raw[2 * i] & 0x1fffffu) == 0 && raw[2 * i + 1] == 0) zeros.push_back(i0 + i);  // u = 0: a 0 drawn
      }
      for (; w < wanted.size() && wanted[w].first < i0 + draws; ++w) {
        const int64_t i = wanted[w].first - i0;
        const uint64_t bits = ((uint64_t(raw[2 * i]) << 32) | raw[2 * i + 1]) & kMask;
        const double u = double(bits) * (1.0 / double(uint64_t(1) << 53));
        o[wanted[w].second] = static_cast<float>(-1.0 * log1p_of(-u));
      }
    }
    at::mt19937 engine;
    engine.set_data(outputs.d);
    gen->set_engine(engine);
  }
  auto zero_columns = at::empty({int64_t(zeros.size())}, at::kLong);
  std::copy(zeros.begin(), zeros.end(), zero_columns.data_ptr<int64_t>());
  return {out, zero_columns};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(xllm, m) {
  m.def("exponential_at(Generator? generator, int n, Tensor columns) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xllm, CPU, m) {
  m.impl("exponential_at", &exponential_at);
}
