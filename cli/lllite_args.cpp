#include "cli/lllite_args.h"

#include <png.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include <c10/util/StringUtil.h>

#include "runtime/error.h"

namespace sluice::cli {
namespace {

bool parse_number(const std::string& s, double& out) {
  try {
    size_t used = 0;
    out = std::stod(s, &used);
    return used == s.size() && std::isfinite(out);
  } catch (const std::exception&) {
    return false;
  }
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

LLLiteSpec parse_lllite_spec(const std::string& spec, bool with_range, const std::string& flag) {
  const std::string form = with_range ? "FILE[:WEIGHT[:BEGIN:END]]" : "FILE[:WEIGHT]";
  auto bad = [&](const std::string& why) {
    return CLI::ValidationError(flag + " '" + spec + "': " + why + " (want " + form + ")");
  };
  std::vector<std::string> parts;
  size_t pos = 0;
  while (true) {
    const size_t colon = spec.find(':', pos);
    parts.push_back(spec.substr(pos, colon == std::string::npos ? std::string::npos : colon - pos));
    if (colon == std::string::npos) break;
    pos = colon + 1;
  }
  LLLiteSpec s;
  s.path = parts[0];
  if (s.path.empty()) throw bad("no file");
  if (parts.size() == 3 || parts.size() > 4 || (!with_range && parts.size() > 2)) {
    throw bad(c10::str(parts.size() - 1, " values after the file"));
  }
  if (parts.size() >= 2) {
    if (!parse_number(parts[1], s.weight)) throw bad("weight '" + parts[1] + "' is not a number");
    if (s.weight < -10.0 || s.weight > 10.0) throw bad("weight " + number_text(s.weight) + " is outside -10..10");
  }
  if (parts.size() == 4) {
    if (!parse_number(parts[2], s.begin)) throw bad("begin '" + parts[2] + "' is not a number");
    if (!parse_number(parts[3], s.end)) throw bad("end '" + parts[3] + "' is not a number");
    if (s.begin < 0.0 || s.end > 1.0 || s.begin > s.end) {
      throw bad("begin " + number_text(s.begin) + " and end " + number_text(s.end) +
                " must satisfy 0 <= begin <= end <= 1");
    }
  }
  return s;
}

CLI::Validator lllite_spec_validator(bool with_range, const std::string& flag) {
  return CLI::Validator(
      [with_range, flag](std::string& value) -> std::string {
        try {
          parse_lllite_spec(value, with_range, flag);
        } catch (const CLI::ValidationError& e) {
          return e.what();
        }
        return {};
      },
      with_range ? "FILE[:WEIGHT[:BEGIN:END]]" : "FILE[:WEIGHT]", "lllite spec");
}

double lllite_step_weight(const LLLiteSpec& spec, int64_t i, int64_t steps) {
  const double first = std::floor(spec.begin * static_cast<double>(steps));
  const double last = std::ceil(spec.end * static_cast<double>(steps));
  const double step = static_cast<double>(i);
  return step < first || step > last ? 0.0 : spec.weight;
}

at::Tensor read_png(const std::string& path, bool rgb) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, path.c_str())) {
    throw FileError("cannot read PNG '" + path + "': " + image.message);
  }
  struct Free {
    png_image* i;
    ~Free() { png_image_free(i); }
  } free_on_exit{&image};
  if (image.format & PNG_FORMAT_FLAG_LINEAR) {
    // 16-bit files are read as linear 16-bit by libpng's simplified API: refused, not silently gamma-mapped.
    throw FileError("PNG '" + path + "' has 16-bit samples (want 8-bit gray, RGB or RGBA)");
  }
  image.format = PNG_FORMAT_RGB;
  const int64_t h = image.height, w = image.width;
  if (h <= 0 || w <= 0) throw FileError("PNG '" + path + "' is empty");
  at::Tensor buf = at::empty({h, w, 3}, at::kByte);
  if (!png_image_finish_read(&image, nullptr, buf.data_ptr<uint8_t>(), 0, nullptr)) {
    throw FileError("cannot read PNG '" + path + "': " + image.message);
  }
  const at::Tensor img = buf.permute({2, 0, 1}).to(at::kFloat).div(255.0).contiguous();  // [3, H, W]
  if (rgb) return img;
  return (img[0] * 0.299 + img[1] * 0.587 + img[2] * 0.114).contiguous();
}

}  // namespace sluice::cli
