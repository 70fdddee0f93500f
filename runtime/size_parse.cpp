#include "runtime/size_parse.h"

#include <cctype>
#include <cstdio>
#include <limits>

#include "runtime/error.h"

namespace sluice {

namespace {

using u128 = unsigned __int128;

constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
constexpr int kMaxFractionDigits = 12;  // more digits are checked but ignored

[[noreturn]] void fail(const std::string& flag, std::string_view text, const char* why) {
  std::string shown(text.substr(0, 64));
  for (char& c : shown) {
    if (!std::isprint(static_cast<unsigned char>(c))) c = '?';
  }
  if (text.size() > 64) shown += "...";
  throw InvalidArgument(flag + ": invalid size '" + shown + "': " + why);
}

bool ieq(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  }
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Multiplier for a suffix, 0 when unknown. See Note [size suffixes].
uint64_t suffix_multiplier(std::string_view s) {
  struct Entry {
    const char* name;
    uint64_t mult;
  };
  static const Entry kTable[] = {
      {"", 1},          {"b", 1},
      {"k", 1ull << 10}, {"m", 1ull << 20}, {"g", 1ull << 30}, {"t", 1ull << 40},
      {"kib", 1ull << 10}, {"mib", 1ull << 20}, {"gib", 1ull << 30}, {"tib", 1ull << 40},
      {"pib", 1ull << 50}, {"eib", 1ull << 60},
      {"kb", 1000ull}, {"mb", 1000000ull}, {"gb", 1000000000ull}, {"tb", 1000000000000ull},
      {"pb", 1000000000000000ull}, {"eb", 1000000000000000000ull},
  };
  for (const auto& e : kTable) {
    if (ieq(s, e.name)) return e.mult;
  }
  return 0;
}

}  // namespace

uint64_t parse_size(std::string_view text, std::optional<uint64_t> total_for_percent, const std::string& flag_name) {
  std::string_view s = trim(text);
  if (s.empty()) fail(flag_name, text, "empty");
  if (s.front() == '-') fail(flag_name, text, "negative");
  if (s.front() == '+') s.remove_prefix(1);

  // Number: digits [. digits]. Kept exact as integer part + decimal fraction.
  u128 int_part = 0;
  uint64_t frac = 0;    // fraction digits as an integer
  uint64_t frac_scale = 1;  // 10^(kept fraction digits)
  size_t i = 0, int_digits = 0, frac_digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    int_part = int_part * 10 + static_cast<unsigned>(s[i] - '0');
    if (int_part > kMax) fail(flag_name, text, "too large");
    ++i;
    ++int_digits;
  }
  bool has_point = false;
  if (i < s.size() && s[i] == '.') {
    has_point = true;
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      if (frac_digits < kMaxFractionDigits) {
        frac = frac * 10 + static_cast<unsigned>(s[i] - '0');
        frac_scale *= 10;
      }
      ++i;
      ++frac_digits;
    }
  }
  if (int_digits == 0 && frac_digits == 0) fail(flag_name, text, "expected a number");
  const std::string_view suffix = trim(s.substr(i));

  if (suffix == "%") {
    if (!total_for_percent) fail(flag_name, text, "a percentage needs a known total, give bytes instead");
    // percent = int_part + frac / frac_scale, must be <= 100.
    const u128 scaled = int_part * frac_scale + frac;  // percent * frac_scale, int_part <= kMax
    if (int_part > 100 || scaled > static_cast<u128>(100) * frac_scale) fail(flag_name, text, "more than 100%");
    const u128 bytes = static_cast<u128>(*total_for_percent) * scaled / (static_cast<u128>(100) * frac_scale);
    if (bytes > kMax) fail(flag_name, text, "too large");
    return static_cast<uint64_t>(bytes);
  }

  const uint64_t mult = suffix_multiplier(suffix);
  if (mult == 0) fail(flag_name, text, "unknown unit (use B, KiB, MiB, GiB, TiB, PiB, EiB, K, M, G, T, KB, MB, GB, TB, PB, EB or %)");
  if (mult == 1 && has_point && frac != 0) fail(flag_name, text, "a byte count must be whole");
  const u128 whole = int_part * mult;  // int_part <= 2^63, mult <= 2^60: fits in 128 bits
  // A fraction of a byte counts as a whole one (Note [size suffixes]: printed sizes read back).
  const u128 part = (static_cast<u128>(frac) * mult + frac_scale - 1) / frac_scale;
  const u128 bytes = whole + part;
  if (bytes > kMax) fail(flag_name, text, "too large");
  return static_cast<uint64_t>(bytes);
}

namespace {

// "K.Dunit" for the smallest K.D (tenths of `unit`) that parse_size reads back as at least
// `bytes`: parse_size counts a fraction of a byte as a whole one, so that is the smallest
// k with k * unit / 10 > bytes - 1 (Note [size suffixes]).
std::string tenths(uint64_t bytes, uint64_t unit, const char* label) {
  const u128 k = bytes == 0 ? 0 : (static_cast<u128>(bytes - 1) * 10) / unit + 1;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%llu.%llu%s", static_cast<unsigned long long>(k / 10),
                static_cast<unsigned long long>(k % 10), label);
  return buf;
}

}  // namespace

std::string format_mib(uint64_t bytes) { return tenths(bytes, 1ull << 20, "MiB"); }

std::string format_bytes(uint64_t bytes) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  constexpr size_t kCount = sizeof kUnits / sizeof kUnits[0];
  if (bytes < 1024) return std::to_string(bytes) + "B";
  size_t u = 0;  // kUnits[u] is 1024^(u + 1) bytes
  while (u + 1 < kCount && bytes >= (1ull << (10 * (u + 2)))) ++u;
  // Just under the next unit the tenths round up to 1024.0: say 1.0 of the next one instead.
  const uint64_t unit = 1ull << (10 * (u + 1));
  if (u + 1 < kCount && (static_cast<u128>(bytes - 1) * 10) / unit + 1 >= 10240) ++u;
  return tenths(bytes, 1ull << (10 * (u + 1)), kUnits[u]);
}

}  // namespace sluice
