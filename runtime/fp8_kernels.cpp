#include "runtime/fp8_kernels.h"

#include <cstring>

// Clones for AVX-512 and AVX2 beside the baseline, picked at load time (GCC's ifunc
// resolver); elsewhere one plain function, which the vectorizer still widens to the
// baseline ISA.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define SLUICE_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SLUICE_VECTOR_CLONES
#endif

namespace sluice::fp8_kernels {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Counts are summed in 32-bit lanes over blocks of this many elements, then into 64 bits:
// a 64-bit sum per element made the vectorizer widen every byte eightfold (11 GB/s against
// 25 GB/s for count_masked).
constexpr int64_t kBlock = 4096;

// The magnitude statistics of 16-bit floats, with `each(i, p, m)` called for element i (bits
// p, magnitude bits m) in the same loop, so that a cast and its range check are one pass.
template <typename Each>
__attribute__((always_inline)) inline Cast16Stats scan_16(const uint16_t* __restrict in, int64_t n,
                                                          uint16_t max_bits, Each&& each) {
  int64_t over = 0;
  uint16_t worst = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = n - start < kBlock ? n : start + kBlock;
    uint32_t block_over = 0;
    for (int64_t i = start; i < end; ++i) {
      const uint16_t p = in[i];
      const uint16_t m = p & 0x7FFF;
      block_over += m > max_bits;
      worst = worst > m ? worst : m;
      each(i, p, m);
    }
    over += block_over;
  }
  return {over, worst};
}

}  // namespace

SLUICE_VECTOR_CLONES
Cast16Stats cast_bf16_e4m3fn(const uint16_t* __restrict in, uint8_t* __restrict out, int64_t n, uint16_t max_bits) {
  constexpr uint32_t kRebias = static_cast<uint32_t>(7 - 127) << 23;  // exponent bias 127 -> 7
  constexpr uint32_t kMinNormal = 121u << 23;                          // 2^-6, e4m3fn's smallest normal
  constexpr uint32_t kDenormAdd = 141u << 23;                          // 2^14: its fp32 ulp is 2^-9
  return scan_16(in, n, max_bits, [&](int64_t i, uint16_t p, uint16_t m) {
    const uint32_t a = static_cast<uint32_t>(m) << 16;  // |v| as fp32 bits
    const uint32_t normal = (a + kRebias + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    const uint32_t denormal = bits_of(float_of(a) + float_of(kDenormAdd)) - kDenormAdd;
    uint32_t r = a < kMinNormal ? denormal : normal;
    r = m > max_bits ? 0x7Eu : r;  // saturate: 0x7E is 448
    out[i] = static_cast<uint8_t>(r | ((p >> 8) & 0x80u));
  });
}

SLUICE_VECTOR_CLONES
Cast16Stats stats_16(const uint16_t* __restrict in, int64_t n, uint16_t max_bits) {
  return scan_16(in, n, max_bits, [](int64_t, uint16_t, uint16_t) {});
}

SLUICE_VECTOR_CLONES
int64_t count_masked(const uint8_t* __restrict b, int64_t n, uint8_t mask, uint8_t value) {
  int64_t count = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = n - start < kBlock ? n : start + kBlock;
    uint32_t block_count = 0;
    for (int64_t i = start; i < end; ++i) block_count += (b[i] & mask) == value;
    count += block_count;
  }
  return count;
}

}  // namespace sluice::fp8_kernels
