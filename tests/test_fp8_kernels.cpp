// The vectorized loops of the fused read (runtime/fp8_kernels.h) against c10's scalar
// conversion and plain counting loops.
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "runtime/fp8_kernels.h"

namespace k = sluice::fp8_kernels;

namespace {

float bf16_value(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

// What ATen's saturating cast gives: clamp to +-448, then c10's conversion.
uint8_t reference_e4m3fn(uint16_t bits) { return c10::Float8_e4m3fn(std::clamp(bf16_value(bits), -448.0f, 448.0f)).x; }

const uint16_t kMax448 = c10::BFloat16(448.0f).x;

}  // namespace

TEST_CASE("cast_bf16_e4m3fn gives c10's byte for every finite bf16 pattern") {
  std::vector<uint16_t> in;
  for (uint32_t p = 0; p < 65536; ++p) {
    if (std::isfinite(bf16_value(static_cast<uint16_t>(p)))) in.push_back(static_cast<uint16_t>(p));
  }
  REQUIRE(in.size() == 65536 - 256);  // exponent all ones: 127 NaN and 1 inf pattern per sign
  std::vector<uint8_t> out(in.size());
  const k::Cast16Stats s = k::cast_bf16_e4m3fn(in.data(), out.data(), static_cast<int64_t>(in.size()), kMax448);
  int64_t mismatches = 0, over = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (out[i] != reference_e4m3fn(in[i])) {
      if (++mismatches <= 5) UNSCOPED_INFO("bf16 0x" << std::hex << in[i] << ": got 0x" << int(out[i]) << ", c10 0x"
                                                     << int(reference_e4m3fn(in[i])));
    }
    over += (in[i] & 0x7FFF) > kMax448;
  }
  CHECK(mismatches == 0);
  CHECK(s.over == over);
  CHECK(s.worst == 0x7F7F);  // the largest finite bf16 magnitude
  // The denormal edges: 2^-10 ties to 0 (even), just above it rounds to 2^-9; 2^-6 is the
  // smallest normal; -0 keeps its sign.
  CHECK(reference_e4m3fn(c10::BFloat16(std::ldexp(1.0f, -10)).x) == 0x00);
  CHECK(reference_e4m3fn(c10::BFloat16(-0.0f).x) == 0x80);
}

TEST_CASE("cast_bf16_e4m3fn handles any length, offset and block boundary") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 200.0f);  // a good share beyond +-448
  std::vector<uint16_t> in(3 * 4096 + 77);
  for (auto& v : in) v = c10::BFloat16(normal(rng)).x;
  for (const int64_t offset : {0, 1, 3}) {
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{4096}, int64_t{4097},
                            static_cast<int64_t>(in.size()) - offset}) {
      std::vector<uint8_t> out(static_cast<size_t>(n) + 1, 0xAB);
      const k::Cast16Stats s = k::cast_bf16_e4m3fn(in.data() + offset, out.data(), n, kMax448);
      int64_t over = 0;
      uint16_t worst = 0;
      bool same = true;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t p = in[static_cast<size_t>(offset + i)];
        same = same && out[static_cast<size_t>(i)] == reference_e4m3fn(p);
        over += (p & 0x7FFF) > kMax448;
        worst = std::max<uint16_t>(worst, p & 0x7FFF);
      }
      INFO("offset " << offset << ", n " << n);
      CHECK(same);
      CHECK(out[static_cast<size_t>(n)] == 0xAB);  // nothing written past the end
      CHECK(s.over == over);
      CHECK(s.worst == worst);
      const k::Cast16Stats t = k::stats_16(in.data() + offset, n, kMax448);
      CHECK(t.over == over);
      CHECK(t.worst == worst);
    }
  }
}

TEST_CASE("count_masked counts what a plain loop counts") {
  std::mt19937 rng(3);
  std::vector<uint8_t> b(2 * 4096 + 999);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  struct Mask {
    uint8_t mask, value;
  };
  for (const Mask m : {Mask{0x7F, 0x7F}, Mask{0x7C, 0x7C}, Mask{0xFF, 0x80}}) {
    for (const int64_t n : {int64_t{0}, int64_t{5}, int64_t{4096}, static_cast<int64_t>(b.size())}) {
      int64_t expected = 0;
      for (int64_t i = 0; i < n; ++i) expected += (b[static_cast<size_t>(i)] & m.mask) == m.value;
      INFO("mask " << int(m.mask) << ", n " << n);
      CHECK(k::count_masked(b.data(), n, m.mask, m.value) == expected);
    }
  }
  std::vector<uint8_t> all(10000, 0xFF);
  CHECK(k::count_masked(all.data(), 10000, 0x7F, 0x7F) == 10000);
}
