// Bernoulli dropout masks in one pass: the numbers of rnndrop/noise.py's 16-bit draw, bit for bit.
//
//   m_i = scale  if b_i >= threshold,  else 0,
//
// where b_0, b_1, ... are the int16 values of the 64-bit words the generator gives, in memory
// order: what torch.empty(ceil(n / 4), int64).random_(-2**63, None).view(int16) holds (ATen
// draws that tensor with one CPUGeneratorImpl::random64() an element, in order, under the
// generator's lock). The Python draw writes the words, compares them, converts and scales in
// four passes over memory; this draws a block of words into the cache and writes its mask.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>

namespace rnndrop {

namespace {

constexpr int64_t kBlockWords = 128;

template <typename scalar_t>
void draw(scalar_t* mask, int64_t n, int16_t threshold, scalar_t kept, at::mt19937& engine) {
  using Bits = std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>;
  Bits kept_bits;
  std::memcpy(&kept_bits, &kept, sizeof(kept));
  uint64_t words[kBlockWords];
  int16_t pieces[4 * kBlockWords];
  for (int64_t i = 0; i < n; i += 4 * kBlockWords) {
    const int64_t count = std::min<int64_t>(4 * kBlockWords, n - i), n_words = (count + 3) / 4;
    for (int64_t k = 0; k < n_words; ++k) {
      const uint32_t high = engine(), low = engine();  // CPUGeneratorImpl::random64()
      words[k] = (static_cast<uint64_t>(high) << 32) | low;
    }
    std::memcpy(pieces, words, n_words * sizeof(uint64_t));
    // Bits, not a select: the compiler turns `b >= t ? kept : 0` into a branch, which random
    // bits mispredict half the time at p = 0.5.
    for (int64_t j = 0; j < count; ++j) {
      const Bits value = kept_bits & (Bits(0) - Bits(pieces[j] >= threshold));
      std::memcpy(mask + i + j, &value, sizeof(value));
    }
  }
}

}  // namespace

at::Tensor bernoulli_mask(const std::vector<int64_t>& shape, int64_t threshold, double scale,
                          c10::optional<at::Generator> generator, at::ScalarType dtype) {
  TORCH_CHECK(threshold >= INT16_MIN && threshold <= INT16_MAX, "bernoulli_mask: threshold ", threshold,
              " is not an int16");
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(generator, at::detail::getDefaultCPUGenerator());
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES(dtype, "bernoulli_mask", [&] {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    at::mt19937 engine = gen->engine();  // a copy, whose draws inline here; put back below
    draw<scalar_t>(mask.data_ptr<scalar_t>(), mask.numel(), static_cast<int16_t>(threshold),
                   static_cast<scalar_t>(scale), engine);
    gen->set_engine(engine);
  });
  return mask;
}

}  // namespace rnndrop
