// libFuzzer target: parse_size (runtime/size_parse.h). The first 8 input bytes (when
// there are at least 9) are the total for percentages, the rest is the text. Accepted
// sizes must fit in int64, percentages must stay within the total, the plain decimal
// form of any accepted size must parse back to itself, and its printed forms (format_mib,
// format_bytes) must parse back to at least it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "runtime/error.h"
#include "runtime/size_parse.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<uint64_t> total;
  if (size > 8) {
    uint64_t t = 0;
    std::memcpy(&t, data, 8);
    total = t;
    data += 8;
    size -= 8;
  }
  const std::string text(reinterpret_cast<const char*>(data), size);
  uint64_t v = 0;
  try {
    v = sluice::parse_size(text, total, "--budget");
  } catch (const sluice::InvalidArgument&) {
    return 0;
  }
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) std::abort();
  if (text.find('%') != std::string::npos && (!total || v > *total)) std::abort();
  try {
    if (sluice::parse_size(std::to_string(v), std::nullopt, "--budget") != v) std::abort();
  } catch (const sluice::InvalidArgument&) {
    std::abort();
  }
  // Note [size suffixes]: a printed size reads back as at least the bytes it stands for
  // (up to 2^62: nearer int64's end the rounded-up text can exceed it).
  for (const std::string& shown : {sluice::format_mib(v), sluice::format_bytes(v)}) {
    if (v > (uint64_t{1} << 62)) break;
    try {
      if (sluice::parse_size(shown, std::nullopt, "--budget") < v) std::abort();
    } catch (const sluice::InvalidArgument&) {
      std::abort();
    }
  }
  return 0;
}
