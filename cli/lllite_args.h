#pragma once
// The CLI's ControlNet-LLLite flags (README, "ControlNet-LLLite"): the --lllite spec
// FILE[:WEIGHT[:BEGIN:END]], InvokeAI's step gate, and reading the control image and mask
// from PNG files (libpng; 8-bit gray, gray+alpha, RGB or RGBA; alpha dropped).
// Tested by: tests/cli/test_lllite_cli.cpp.
#include <ATen/ATen.h>

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace sluice::cli {

struct LLLiteSpec {
  std::string path;
  double weight = 1.0;  // -10 .. 10
  double begin = 0.0;   // step fractions, 0 <= begin <= end <= 1
  double end = 1.0;
};

// Parses FILE[:WEIGHT] (with_range false) or FILE[:WEIGHT[:BEGIN:END]]. Throws
// CLI::ValidationError naming `flag` and the spec: a weight or fraction that is no number,
// a weight outside -10..10, begin > end or a fraction outside 0..1, a range where none is
// taken.
LLLiteSpec parse_lllite_spec(const std::string& spec, bool with_range, const std::string& flag);
// CLI11 check of the same.
CLI::Validator lllite_spec_validator(bool with_range, const std::string& flag);

// The weight for step i of `steps`, as InvokeAI's Anima denoise node gates an LLLite: the
// spec's weight for floor(begin * steps) <= i <= ceil(end * steps), else 0.
double lllite_step_weight(const LLLiteSpec& spec, int64_t i, int64_t steps);

// An 8-bit PNG as float in [0, 1]: [3, H, W] RGB (gray repeated) when rgb, else [H, W] (the
// luminance of a colour image: 0.299 R + 0.587 G + 0.114 B). FileError naming `path` and
// what is wrong (unreadable, no PNG, 16-bit).
at::Tensor read_png(const std::string& path, bool rgb);

}  // namespace sluice::cli
