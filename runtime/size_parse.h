#pragma once
// Byte sizes given on the command line or in configs ("6GiB", "50%").
//
// Note [size suffixes]
// ~~~~~~~~~~~~~~~~~~~~
// Suffixes are matched case-insensitively; "b" always means bytes (never bits).
//  - KiB, MiB, GiB, TiB, PiB, EiB: binary (1024^n).
//  - K, M, G, T: binary, as in llama.cpp and ComfyUI, whose users type "8G" meaning 8 GiB.
//  - KB, MB, GB, TB, PB, EB: decimal (1000^n), as the SI prefixes say.
//  - B or no suffix: bytes; the number must then be whole.
// A fractional number ("1.5GB") is allowed with a suffix; a fraction of a byte left over
// counts as a whole byte (rounded up). "N%" is N percent of a total the caller supplies
// (the device memory for --budget), 0..100, fractions allowed, rounded down. Spaces
// around the number and between the number and the suffix are allowed. The result must
// fit in int64 (torch's size type).
//
// The sizes sluice prints (CLI output, log lines, error messages) go through format_mib or
// format_bytes: binary units spelled MiB/GiB (never "MB" for MiB), one decimal, rounded UP
// to the smallest printed value that parse_size reads back as at least the bytes. So a
// printed size typed back as a flag never means fewer bytes than it stood for (a printed
// minimum is enough), and format(parse(format(x))) == format(x)
// (tests/runtime/test_size_parse.cpp), for every size below 2^62 bytes (nearer int64's end
// the rounded-up text can exceed it).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace sluice {

// Parses `text` as a byte size. `total_for_percent` is the 100% for "N%" (std::nullopt:
// percentages are refused). Throws InvalidArgument naming `flag_name` and the text on
// empty, malformed, negative, overflowing or > 100% input. Never has UB on any input.
uint64_t parse_size(std::string_view text, std::optional<uint64_t> total_for_percent,
                    const std::string& flag_name);

// "1006.0MiB": bytes / 2^20 with one decimal, rounded up (Note [size suffixes]).
std::string format_mib(uint64_t bytes);

// Human-readable with a binary unit and one decimal, rounded up (Note [size suffixes]):
// "512B", "1.5KiB", "6.0GiB".
std::string format_bytes(uint64_t bytes);

}  // namespace sluice
