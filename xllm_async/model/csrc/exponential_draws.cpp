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
// the first the high word. Here the same mt19937 (a copy of the generator's engine, set back after),
// every output drawn, the logarithm taken only at the wanted columns, through a pointer so that the
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
    at::mt19937 engine = gen->engine();
    constexpr uint64_t kMask = (uint64_t(1) << 53) - 1;
    size_t w = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t hi = engine();
      const uint32_t lo = engine();
      const uint64_t bits = ((uint64_t(hi) << 32) | lo) & kMask;
      if (bits == 0) zeros.push_back(i);  // (u = 0: the draw is 0)
      if (w < wanted.size() && wanted[w].first == i) {
        const double u = double(bits) * (1.0 / double(uint64_t(1) << 53));
        const float draw = static_cast<float>(-1.0 * log1p_of(-u));
        for (; w < wanted.size() && wanted[w].first == i; ++w) o[wanted[w].second] = draw;
      }
    }
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
