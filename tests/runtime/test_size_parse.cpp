#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/size_parse.h"

using sluice::format_bytes;
using sluice::format_mib;
using sluice::parse_size;

namespace {

uint64_t parse(const std::string& s, std::optional<uint64_t> total = std::nullopt) {
  return parse_size(s, total, "--budget");
}

std::string error_of(const std::string& s, std::optional<uint64_t> total = std::nullopt) {
  try {
    parse(s, total);
  } catch (const sluice::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("size parse: parse_size: plain bytes and binary suffixes") {
  CHECK(parse("4096") == 4096);
  CHECK(parse("0") == 0);
  CHECK(parse("4096B") == 4096);
  CHECK(parse("6GiB") == 6ull << 30);
  CHECK(parse("512MiB") == 512ull << 20);
  CHECK(parse("3KiB") == 3072);
  CHECK(parse("2TiB") == 2ull << 40);
  CHECK(parse("8G") == 8ull << 30);
  CHECK(parse("8g") == 8ull << 30);
  CHECK(parse("1K") == 1024);
  CHECK(parse("256M") == 256ull << 20);
  CHECK(parse("0.5GiB") == 512ull << 20);
  CHECK(parse(" 12 MiB ") == 12ull << 20);
  CHECK(parse("+7") == 7);
}

TEST_CASE("size parse: parse_size: decimal suffixes") {
  CHECK(parse("1.5GB") == 1500000000ull);
  CHECK(parse("1KB") == 1000);
  CHECK(parse("2mb") == 2000000);
  CHECK(parse("1TB") == 1000000000000ull);
  CHECK(parse("0.001KB") == 1);
  CHECK(parse("1.0") == 1);
}

TEST_CASE("size parse: parse_size: percentages of a total") {
  CHECK(parse("50%", 1000) == 500);
  CHECK(parse("12.5%", 800) == 100);
  CHECK(parse("100%", 12345) == 12345);
  CHECK(parse("0%", 12345) == 0);
  CHECK(parse("33.3333%", 300) == 99);  // rounded down
  const uint64_t big = 141ull << 30;
  CHECK(parse("50%", big) == big / 2);
}

TEST_CASE("size parse: parse_size: rejects bad input naming the flag and value") {
  for (const char* bad : {"", "   ", "-1", "-1GiB", "abc", "1e9", "12XB", "GiB", ".", "1.5", "1..5G", "1 2G", "0x10",
                          "5%%", "%", "1.5.5", "NaN", "inf", "1GiBx"}) {
    INFO(bad);
    const std::string msg = error_of(bad, 1000);
    CHECK(msg.find("--budget") != std::string::npos);
  }
  CHECK(error_of("abc").find("'abc'") != std::string::npos);
  CHECK(error_of("-5G").find("negative") != std::string::npos);
  CHECK(error_of("101%", 1000).find("100%") != std::string::npos);
  CHECK_FALSE(error_of("100.0001%", 1000).empty());
  CHECK(error_of("50%").find("percentage") != std::string::npos);
}

TEST_CASE("size parse: parse_size: rejects overflow") {
  CHECK(parse("9223372036854775807") == 9223372036854775807ull);
  CHECK_FALSE(error_of("9223372036854775808").empty());
  CHECK_FALSE(error_of("99999999999999999999999999999").empty());
  CHECK(parse("8388607TiB") == 8388607ull << 40);
  CHECK_FALSE(error_of("8388608TiB").empty());
  CHECK_FALSE(error_of("18446744073709551616G").empty());
}

TEST_CASE("size parse: parse_size: non-printable input is shown safely") {
  const std::string msg = error_of(std::string("1\x01G\0x", 5));
  REQUIRE_FALSE(msg.empty());
  for (char c : msg) CHECK(c != '\x01');
  CHECK(msg.find('\0') == std::string::npos);
}

TEST_CASE("size parse: parse_size: random input either parses or throws InvalidArgument") {
  std::mt19937 rng(1234);
  const std::string alphabet = "0123456789.%+-eEKkMmGgTtIiBb x\t\x7f";
  std::uniform_int_distribution<size_t> len(0, 24), pick(0, alphabet.size() - 1);
  int parsed = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    const size_t n = len(rng);
    for (size_t k = 0; k < n; ++k) s.push_back(alphabet[pick(rng)]);
    try {
      const uint64_t v = parse_size(s, 1ull << 40, "--x");
      CHECK(v <= 9223372036854775807ull);
      ++parsed;
    } catch (const sluice::InvalidArgument&) {
    }
  }
  CHECK(parsed > 0);
}

TEST_CASE("size parse: format_mib and format_bytes") {
  CHECK(format_mib(1006ull << 20) == "1006.0MiB");
  CHECK(format_mib(0) == "0.0MiB");
  CHECK(format_mib((2012ull << 20) + (1ull << 19)) == "2012.5MiB");
  CHECK(format_bytes(512) == "512B");
  CHECK(format_bytes(1536) == "1.5KiB");
  CHECK(format_bytes(6ull << 30) == "6.0GiB");
  CHECK(format_bytes(1023ull << 20) == "1023.0MiB");
}

TEST_CASE("size parse: format_mib and format_bytes round up to what parse_size reads back as enough") {
  // anima-small's minimum budget: 2.43 MiB is printed 2.5MiB, not 2.4MiB (which is less).
  CHECK(format_mib(2543274) == "2.5MiB");
  CHECK(format_mib(1) == "0.1MiB");
  CHECK(format_mib((1ull << 20) + 1) == "1.1MiB");
  CHECK(format_bytes(1025) == "1.1KiB");
  // 10 GiB minus 5% of 16 GiB is 0.2 bytes above 9.2 GiB: 9.2GiB reads back as it.
  CHECK(format_bytes((10ull << 30) - (16ull << 30) / 20) == "9.2GiB");
  // Just under a unit: the next unit, not "1024.0".
  CHECK(format_bytes((1ull << 30) - 1) == "1.0GiB");
  CHECK(format_bytes((1ull << 20) - 1) == "1.0MiB");
  CHECK(format_bytes(1ull << 50) == "1.0PiB");
  CHECK(format_bytes(3ull << 60) == "3.0EiB");
  CHECK(parse("1.0PiB") == 1ull << 50);
  CHECK(parse("2EiB") == 2ull << 60);
  CHECK(parse("1PB") == 1000000000000000ull);
  // A fraction of a byte counts as a byte.
  CHECK(parse("0.1MiB") == 104858);
  CHECK(parse("0.1KiB") == 103);
}

TEST_CASE("size parse: parse_size of format_mib and format_bytes is at least the bytes and within a printed tenth") {
  std::mt19937_64 rng(29);
  std::vector<uint64_t> xs;
  for (uint64_t x = 0; x < 5000; ++x) xs.push_back(x);
  for (int shift = 10; shift < 62; ++shift)
    for (int64_t d = -3; d <= 3; ++d) xs.push_back(static_cast<uint64_t>((int64_t{1} << shift) + d));
  for (int i = 0; i < 20000; ++i) xs.push_back(rng() >> (2 + rng() % 61));  // every magnitude below 2^62
  for (const uint64_t x : xs) {
    for (const bool mib : {true, false}) {
      const std::string shown = mib ? format_mib(x) : format_bytes(x);
      INFO(x << " bytes printed " << shown);
      CHECK(shown.find("MB") == std::string::npos);
      const uint64_t back = parse(shown);
      CHECK(back >= x);
      // Not more than a tenth of the printed unit above (the unit is what follows the digits).
      const std::string unit = shown.substr(shown.find_first_not_of("0123456789."));
      const uint64_t tenth = unit == "B" ? 0 : parse("1" + unit) / 10 + 1;
      CHECK(back - x <= tenth);
      // Printing what was read back prints the same.
      CHECK((mib ? format_mib(back) : format_bytes(back)) == shown);
    }
  }
}
