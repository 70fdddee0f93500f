// The vectorized loops of the fused read (runtime/fp8_kernels.h) against c10's scalar
// conversion and plain counting loops: every variant this CPU runs (generic, sse2, avx2,
// avx512), whatever SLUICE_FP8_ISA picked for the process.
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <catch2/catch.hpp>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "runtime/fp8_kernels.h"

namespace k = sluice::fp8_kernels;

namespace {

float bf16_value(uint16_t bits) { return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits())); }

// What ATen's saturating cast gives: clamp to +-448, then c10's conversion.
uint8_t reference_e4m3fn(uint16_t bits) { return c10::Float8_e4m3fn(std::clamp(bf16_value(bits), -448.0f, 448.0f)).x; }

const uint16_t kMax448 = c10::BFloat16(448.0f).x;

// Every finite bf16 pattern, in order.
std::vector<uint16_t> finite_patterns() {
  std::vector<uint16_t> in;
  for (uint32_t p = 0; p < 65536; ++p) {
    if (std::isfinite(bf16_value(static_cast<uint16_t>(p)))) in.push_back(static_cast<uint16_t>(p));
  }
  return in;
}

// The lengths a variant's main loop and tail meet: around its vector widths (8 to 64
// elements) and the 4096-element blocks of the portable loop.
const std::vector<int64_t> kLengths = {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 127, 4095, 4096, 4097};

}  // namespace

TEST_CASE("fp8 kernels: list the variants this CPU runs") {
  const std::vector<k::Isa> isas = k::available_isas();
  REQUIRE(!isas.empty());
  CHECK(isas.front() == k::Isa::generic);
  CHECK(std::find(isas.begin(), isas.end(), k::active_isa()) != isas.end());
  std::string names;
  for (const k::Isa isa : isas) {
    names += std::string(" ") + k::isa_name(isa);
    CHECK(k::kernels(isa).isa == isa);
  }
  const char* env = std::getenv("SLUICE_FP8_ISA");
  INFO("available:" << names << "; active " << k::isa_name(k::active_isa()) << "; SLUICE_FP8_ISA "
                    << (env ? env : "unset"));
  if (env == nullptr) CHECK(k::active_isa() == isas.back());
#if defined(__x86_64__)
  CHECK(std::find(isas.begin(), isas.end(), k::Isa::sse2) != isas.end());
#endif
  for (const k::Isa isa : {k::Isa::generic, k::Isa::sse2, k::Isa::avx2, k::Isa::avx512}) {
    if (std::find(isas.begin(), isas.end(), isa) == isas.end()) CHECK_THROWS(k::kernels(isa));
  }
}

// Run by the case below in a child process with SLUICE_FP8_ISA set: the variant it picks
// must be SLUICE_TEST_EXPECT_ISA.
TEST_CASE("fp8 kernel probe of SLUICE_FP8_ISA", "[.fp8-isa-probe]") {
  const char* expect = std::getenv("SLUICE_TEST_EXPECT_ISA");
  REQUIRE(expect != nullptr);
  CHECK(std::string(k::isa_name(k::active_isa())) == expect);
}

TEST_CASE("fp8 kernels: SLUICE_FP8_ISA picks the fp8 kernel variant") {
  const std::vector<k::Isa> isas = k::available_isas();
  const std::string best = k::isa_name(isas.back());
  std::vector<std::pair<std::string, std::string>> cases;  // SLUICE_FP8_ISA, expected variant
  for (const k::Isa isa : isas) cases.emplace_back(k::isa_name(isa), k::isa_name(isa));
#if defined(__x86_64__)
  cases.emplace_back("baseline", "sse2");
#else
  cases.emplace_back("baseline", "generic");
#endif
  cases.emplace_back("auto", best);
  cases.emplace_back("no-such-isa", best);  // warned about, then the best
  if (std::find(isas.begin(), isas.end(), k::Isa::avx512) == isas.end()) cases.emplace_back("avx512", best);
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(len > 0);
  const std::string exe(self, static_cast<size_t>(len));
  for (const auto& [env, expect] : cases) {
    const std::string cmd = "SLUICE_LOG_LEVEL=error SLUICE_FP8_ISA=" + env + " SLUICE_TEST_EXPECT_ISA=" + expect +
                            " '" + exe + "' '[.fp8-isa-probe]' > /dev/null 2>&1";
    INFO("SLUICE_FP8_ISA=" << env << " should pick " << expect);
    CHECK(std::system(cmd.c_str()) == 0);
  }
}

TEST_CASE("fp8 kernels: cast_bf16_e4m3fn gives c10's byte for every finite bf16 pattern in every variant") {
  const std::vector<uint16_t> in = finite_patterns();
  REQUIRE(in.size() == 65536 - 256);  // exponent all ones: 127 NaN and 1 inf pattern per sign
  std::vector<uint8_t> ref(in.size());
  int64_t over = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    ref[i] = reference_e4m3fn(in[i]);
    over += (in[i] & 0x7FFF) > kMax448;
  }
  for (const k::Isa isa : k::available_isas()) {
    INFO("variant " << k::isa_name(isa));
    std::vector<uint8_t> out(in.size());
    const k::Cast16Stats s =
        k::kernels(isa).cast_bf16_e4m3fn(in.data(), out.data(), static_cast<int64_t>(in.size()), kMax448);
    int64_t mismatches = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      if (out[i] != ref[i] && ++mismatches <= 5) {
        UNSCOPED_INFO(k::isa_name(isa) << ": bf16 0x" << std::hex << in[i] << ": got 0x" << int(out[i]) << ", c10 0x"
                                       << int(ref[i]));
      }
    }
    CHECK(mismatches == 0);
    CHECK(s.over == over);
    CHECK(s.worst == 0x7F7F);  // the largest finite bf16 magnitude
    const k::Cast16Stats t = k::kernels(isa).stats_16(in.data(), static_cast<int64_t>(in.size()), kMax448);
    CHECK(t.over == over);
    CHECK(t.worst == 0x7F7F);
  }
  // The denormal edges: 2^-10 ties to 0 (even), just above it rounds to 2^-9; 2^-6 is the
  // smallest normal; -0 keeps its sign.
  CHECK(reference_e4m3fn(c10::BFloat16(std::ldexp(1.0f, -10)).x) == 0x00);
  CHECK(reference_e4m3fn(c10::BFloat16(-0.0f).x) == 0x80);
}

TEST_CASE("fp8 kernels: cast_bf16_e4m3fn and stats_16 handle any length and misaligned pointers in every variant") {
  // Every finite pattern shuffled (each vector mixes normals, denormals, saturated values
  // and both signs), plus randn * 0.02 as DiT weights are, half of them below 2^-6.
  std::vector<uint16_t> shuffled = finite_patterns();
  std::mt19937 rng(7);
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  std::vector<uint16_t> weights(3 * 4096 + 77);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : weights) v = c10::BFloat16(normal(rng)).x;
  for (const auto* data : {&shuffled, &weights}) {
    const std::vector<uint16_t>& in = *data;
    for (const k::Isa isa : k::available_isas()) {
      const k::Kernels& kern = k::kernels(isa);
      // Input offsets by 2-byte elements, output offsets by bytes: neither is aligned to a
      // vector (the vectors start at element 0 or 1 of an aligned buffer).
      for (const int64_t in_offset : {0, 1, 3, 13}) {
        for (const int64_t out_offset : {0, 1, 7}) {
          std::vector<int64_t> ns = kLengths;
          ns.push_back(static_cast<int64_t>(in.size()) - in_offset);
          for (const int64_t n : ns) {
            std::vector<uint8_t> out(static_cast<size_t>(out_offset + n) + 1, 0xAB);
            const k::Cast16Stats s = kern.cast_bf16_e4m3fn(in.data() + in_offset, out.data() + out_offset, n, kMax448);
            int64_t over = 0;
            uint16_t worst = 0;
            int64_t wrong = 0;
            for (int64_t i = 0; i < n; ++i) {
              const uint16_t p = in[static_cast<size_t>(in_offset + i)];
              wrong += out[static_cast<size_t>(out_offset + i)] != reference_e4m3fn(p);
              over += (p & 0x7FFF) > kMax448;
              worst = std::max<uint16_t>(worst, p & 0x7FFF);
            }
            bool untouched = out.back() == 0xAB;  // nothing written past the end
            for (int64_t i = 0; i < out_offset; ++i) untouched = untouched && out[static_cast<size_t>(i)] == 0xAB;
            const k::Cast16Stats t = kern.stats_16(in.data() + in_offset, n, kMax448);
            if (wrong != 0 || !untouched || s.over != over || s.worst != worst || t.over != over || t.worst != worst) {
              INFO("variant " << k::isa_name(isa) << ", input "
                              << (data == &shuffled ? "shuffled patterns" : "randn*0.02") << ", in offset " << in_offset << ", out offset " << out_offset << ", n " << n);
              CHECK(wrong == 0);
              CHECK(untouched);
              CHECK(s.over == over);
              CHECK(s.worst == worst);
              CHECK(t.over == over);
              CHECK(t.worst == worst);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("fp8 kernels: cast_bf16_e4m3fn counts saturation past the counters' flush in every variant") {
  // 2^20 elements all beyond 448: each 16-bit lane counter of the vector variants is
  // flushed several times on the way.
  const int64_t n = int64_t{1} << 20;
  std::vector<uint16_t> in(static_cast<size_t>(n), c10::BFloat16(-1000.0f).x);
  in[12345] = c10::BFloat16(1.0f).x;
  std::vector<uint8_t> out(static_cast<size_t>(n));
  for (const k::Isa isa : k::available_isas()) {
    INFO("variant " << k::isa_name(isa));
    const k::Cast16Stats s = k::kernels(isa).cast_bf16_e4m3fn(in.data(), out.data(), n, kMax448);
    CHECK(s.over == n - 1);
    CHECK(s.worst == c10::BFloat16(1000.0f).x);
    CHECK(std::count(out.begin(), out.end(), uint8_t{0xFE}) == n - 1);  // -448
    CHECK(out[12345] == reference_e4m3fn(in[12345]));
    CHECK(k::kernels(isa).stats_16(in.data(), n, kMax448).over == n - 1);
  }
}

TEST_CASE("fp8 kernels: count_masked counts what a plain loop counts in every variant") {
  std::mt19937 rng(3);
  std::vector<uint8_t> b(2 * 4096 + 999);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  struct Mask {
    uint8_t mask, value;
  };
  for (const k::Isa isa : k::available_isas()) {
    const k::Kernels& kern = k::kernels(isa);
    for (const Mask m : {Mask{0x7F, 0x7F}, Mask{0x7C, 0x7C}, Mask{0xFF, 0x80}}) {
      for (const int64_t offset : {0, 1, 5}) {
        std::vector<int64_t> ns = kLengths;
        ns.push_back(255 * 32 + 40);  // past the byte counters' flush of the avx2 variant
        ns.push_back(static_cast<int64_t>(b.size()) - offset);
        for (const int64_t n : ns) {
          int64_t expected = 0;
          for (int64_t i = 0; i < n; ++i) expected += (b[static_cast<size_t>(offset + i)] & m.mask) == m.value;
          const int64_t got = kern.count_masked(b.data() + offset, n, m.mask, m.value);
          if (got != expected) {
            INFO("variant " << k::isa_name(isa) << ", mask " << int(m.mask) << ", offset " << offset << ", n " << n);
            CHECK(got == expected);
          }
        }
      }
    }
    INFO("variant " << k::isa_name(isa));
    std::vector<uint8_t> all(100000, 0xFF);  // every byte counts: the byte counters' flush
    CHECK(kern.count_masked(all.data(), 100000, 0x7F, 0x7F) == 100000);
    CHECK(kern.count_masked(all.data() + 3, 99997, 0xFF, 0x80) == 0);
  }
}
