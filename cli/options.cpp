#include "cli/options.h"


#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

#include "offload/device/device.h"
#include "offload/plan/prefetch_scheduler.h"
#include "offload/plan/residency_plan.h"
#include "offload/engine/vram_budget.h"
#include "runtime/error.h"
#include "runtime/size_parse.h"

namespace sluice::cli {
namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : "|") + s;
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Whether `spec` names a device type that a library in SLUICE_DEVICE_LIBRARY registered
// with torch (Note [device libraries] in offload/device/device.cpp), e.g. the test accelerator's
// "testaccel:0"; sets `index` (-1 when absent). Throws InvalidArgument naming a library
// that does not load.
bool library_device(const std::string& spec, int& index) {
  offload::load_device_libraries();
  try {
    const c10::Device d(spec);
    index = d.has_index() ? d.index() : -1;
    return d.type() == c10::DeviceType::PrivateUse1;
  } catch (const c10::Error&) {
    return false;
  }
}

// Splits "cuda:3" into ("cuda", 3); index -1 when absent. False when malformed.
bool split_device(const std::string& spec, std::string& type, int& index) {
  const auto colon = spec.find(':');
  type = spec.substr(0, colon);
  index = -1;
  if (colon == std::string::npos && (type == "cpu" || type == "cuda")) return true;
  const std::string digits = colon == std::string::npos ? std::string() : spec.substr(colon + 1);
  if (type != "cuda") return library_device(spec, index);
  if (digits.empty() || digits.size() > 4 ||
      !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); }))
    return false;
  index = std::stoi(digits);
  return true;
}

}  // namespace

CLI::Validator dtype_validator(const std::vector<std::string>& allowed) {
  return CLI::Validator(
      [allowed](std::string& value) -> std::string {
        if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return {};
        return "unknown dtype '" + value + "' (expected " + join(allowed) + ")";
      },
      join(allowed), "dtype");
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw InvalidArgument("unknown dtype '" + name + "' (expected float32|bfloat16|float16)");
}

std::string dtype_flag_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return std::string(c10::toString(t));
  }
}

CLI::Validator device_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        std::string type;
        int index = -1;
        try {
          if (split_device(value, type, index)) return {};
        } catch (const std::exception& e) {
          return e.what();  // a device library that does not load
        }
        return "bad device '" + value + "' (expected cpu, cuda or cuda:N)";
      },
      "cpu|cuda[:N]", "device");
}

namespace {

// What is wrong with writing `value` (Note [output paths]), empty when nothing is.
std::string output_path_problem(const std::string& value) {
  if (value.empty()) return "expected a file name, got ''";
  struct stat st;
  const bool there = ::stat(value.c_str(), &st) == 0;
  if ((there && S_ISDIR(st.st_mode)) || value.back() == '/') return "'" + value + "' is a folder, not a file";
  const size_t slash = value.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : value.substr(0, slash));
  struct stat dst;
  if (::stat(dir.c_str(), &dst) != 0 || !S_ISDIR(dst.st_mode))
    return "cannot write '" + value + "': folder '" + dir + "' does not exist";
  if (::access(dir.c_str(), W_OK) != 0) return "cannot write '" + value + "': folder '" + dir + "' is not writable";
  if (there && ::access(value.c_str(), W_OK) != 0) return "cannot write '" + value + "': the file is not writable";
  return {};
}

// Which file `path` names, whatever its spelling: the device and inode of a file that is
// there, else the real path of its folder and its name.
std::string file_identity(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0)
    return "inode " + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  char real[PATH_MAX];
  return "path " + std::string(::realpath(dir.c_str(), real) != nullptr ? real : dir.c_str()) + "/" + name;
}

}  // namespace

CLI::Validator output_file_validator() {
  return CLI::Validator([](std::string& value) -> std::string { return output_path_problem(value); }, "FILE",
                        "output file");
}

void check_output_paths(CLI::App* sub, std::vector<PathFlag> outputs, std::vector<PathFlag> inputs) {
  sub->callback([outputs, inputs] {
    std::vector<std::pair<const PathFlag*, std::string>> seen;  // outputs checked so far, with their identity
    for (const PathFlag& out : outputs) {
      if (out.path->empty()) continue;
      if (const std::string problem = output_path_problem(*out.path); !problem.empty())
        throw CLI::ValidationError(out.flag, problem);
      const std::string id = file_identity(*out.path);
      for (const PathFlag& in : inputs) {
        // An input that is not there (a preset name, a missing file) cannot be overwritten.
        struct stat st;
        if (in.path->empty() || ::stat(in.path->c_str(), &st) != 0) continue;
        if (file_identity(*in.path) == id)
          throw CLI::ValidationError(out.flag, "'" + *out.path + "' is " +
                                                   (in.flag.rfind("--", 0) == 0 ? "the " + in.flag + " input" : in.flag) +
                                                   ": writing it would destroy what the command reads");
      }
      for (const auto& [other, other_id] : seen) {
        if (other_id == id)
          throw CLI::ValidationError(out.flag, "'" + *out.path + "' is also the " + other->flag +
                                                   " file: give each output its own file");
      }
      seen.emplace_back(&out, id);
    }
  });
}

std::string api_names_to_flags(const std::string& message) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"vram_budget", "--vram-budget"},
      {"vram_headroom", "--vram-headroom"},
      {"working_memory", "--working-memory"},
      {"pin_memory_limit", "--pin-memory-limit"},
  };
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; };
  std::string out;
  for (size_t i = 0; i < message.size();) {
    bool replaced = false;
    if (i == 0 || !word(message[i - 1])) {
      for (const auto& [name, flag] : kNames) {
        const size_t n = std::char_traits<char>::length(name);
        if (message.compare(i, n, name) == 0 && (i + n == message.size() || !word(message[i + n]))) {
          out += flag;
          i += n;
          replaced = true;
          break;
        }
      }
    }
    if (!replaced) out += message[i++];
  }
  return out;
}

at::Device resolve_device(const std::string& spec) {
  std::string type;
  int index = -1;
  if (!split_device(spec, type, index)) throw InvalidArgument("bad device '" + spec + "' (expected cpu, cuda or cuda:N)");
  if (type == "cpu") return at::Device(at::kCPU);
  if (type != "cuda") {  // a library's device type (split_device checked it)
    const c10::DeviceType t = c10::DeviceType::PrivateUse1;
    const int n = c10::impl::getDeviceGuardImpl(t)->deviceCount();
    if (index >= n) throw ResourceError("device '" + spec + "' does not exist (" + std::to_string(n) + " device(s))");
    return c10::Device(t, static_cast<c10::DeviceIndex>(index < 0 ? 0 : index));
  }
  const int count = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
  if (count == 0) throw ResourceError("device '" + spec + "' requested but no CUDA/ROCm device is available");
  if (index >= count)
    throw ResourceError("device '" + spec + "' does not exist (" + std::to_string(count) + " device(s) visible)");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index < 0 ? 0 : index));
}

std::unique_ptr<ModelCache> make_model_cache(const RuntimeOptions& options) {
  try {
    return std::make_unique<ModelCache>(options);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(api_names_to_flags(e.what()));
  }
}

CLI::Validator size_validator(const std::string& flag, bool allow_percent, bool allow_auto) {
  return CLI::Validator(
      [flag, allow_percent, allow_auto](std::string& value) -> std::string {
        if (allow_auto && offload::is_auto_vram_budget(value)) return {};
        try {
          parse_size(value, allow_percent ? std::optional<uint64_t>(1ull << 40) : std::nullopt, flag);
          return {};
        } catch (const std::exception& e) {
          // CLI11 puts the flag in front of the message; parse_size did too.
          std::string message = e.what();
          if (message.rfind(flag + ": ", 0) == 0) message.erase(0, flag.size() + 2);
          return message;
        }
      },
      std::string(allow_auto ? "auto|" : "") + (allow_percent ? "BYTES|N%" : "BYTES"), "size");
}

namespace {

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// `value` as a whole number in [lo, hi]: decimal digits only (no sign, so "-1" never wraps).
bool parse_whole(const std::string& value, uint64_t lo, uint64_t hi) {
  if (value.empty() || value.size() > 20 ||
      !std::all_of(value.begin(), value.end(), [](unsigned char c) { return std::isdigit(c); }))
    return false;
  unsigned __int128 v = 0;
  for (char c : value) v = v * 10 + static_cast<unsigned>(c - '0');
  return v >= lo && v <= hi;
}

}  // namespace

CLI::Validator number_validator(double lo, double hi) {
  const std::string range = "from " + number_text(lo) + " to " + number_text(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && std::isfinite(v) && v >= lo && v <= hi) return {};
        } catch (const std::exception&) {
        }
        return "expected a number " + range + ", got '" + value + "'";
      },
      "FLOAT in [" + number_text(lo) + ", " + number_text(hi) + "]", "number");
}

CLI::Validator integer_validator(uint64_t lo, uint64_t hi) {
  const std::string range = "from " + std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& value) -> std::string {
        if (parse_whole(value, lo, hi)) return {};
        return "expected a whole number " + range + ", got '" + value + "'";
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", "integer");
}

CLI::Validator seed_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        if (parse_whole(value, 0, UINT64_MAX)) return {};
        return "expected a whole number from 0 to 18446744073709551615, got '" + value + "'";
      },
      "UINT64", "seed");
}

namespace {
// A validator that accepts what `parse` accepts and reports its error message.
template <class Parse>
CLI::Validator parsing_validator(Parse parse, const std::string& desc, const std::string& name) {
  return CLI::Validator(
      [parse](std::string& value) -> std::string {
        try {
          parse(value);
          return {};
        } catch (const std::exception& e) {
          return e.what();
        }
      },
      desc, name);
}
}  // namespace

CLI::Validator prefetch_validator() {
  return parsing_validator([](const std::string& v) { offload::parse_prefetch(v, ""); }, "auto|N", "prefetch");
}

CLI::Validator policy_validator() {
  return parsing_validator([](const std::string& v) { offload::parse_residency_policy(v, ""); },
                           "balanced|spread|front_first", "policy");
}

void add_vram_budget_options(CLI::App* sub, std::string& vram_budget, std::string& vram_headroom,
                             const std::string& default_text) {
  sub->add_option("--vram-budget", vram_budget,
                  "Device budget: a size (6GiB, 512MiB; MB and GB are decimal) no larger than the device's memory, a "
                  "percentage of the TOTAL device memory (50%), or auto (free memory now minus --vram-headroom) "
                  "(default: " + default_text + ")")
      ->check(size_validator("--vram-budget", true, true));
  sub->add_option("--vram-headroom", vram_headroom,
                  "With --vram-budget auto: device memory left free, bytes or a percentage of the TOTAL memory "
                  "(default: max(512MiB, 5%))")
      ->check(size_validator("--vram-headroom", true));
}

void add_load_threads_option(CLI::App* sub, int& load_threads) {
  sub->add_option("--load-threads", load_threads,
                  "Threads that read a checkpoint and cast it to its storage dtype, 0 for every core")
      ->check(integer_validator(0, 4096))
      ->capture_default_str();
}

CLI::Validator config_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        if (ends_with(value, ".json")) return {};
        const auto names = anima::preset_names();
        if (std::find(names.begin(), names.end(), value) != names.end()) return {};
        std::string known;
        for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
        return "unknown model preset '" + value + "' (known: " + known + "; or a .json config file)";
      },
      "PRESET|FILE.json", "config");
}

anima::AnimaConfig load_config(const std::string& name_or_file) {
  anima::AnimaConfig c = anima::config_from_name_or_file(name_or_file);
  c.validate();
  return c;
}

std::vector<int64_t> parse_mask_blocks(const std::string& spec, int64_t num_blocks) {
  std::vector<int64_t> blocks;
  if (spec.empty() || spec == "even") return blocks;
  if (spec == "odd" || spec == "all") {
    for (int64_t i = spec == "odd" ? 1 : 0; i < num_blocks; i += spec == "odd" ? 2 : 1) blocks.push_back(i);
    return blocks;
  }
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t i = -1;
    try {
      i = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size()) {
      throw InvalidArgument("--mask-blocks '" + spec + "' is not even, odd, all or comma-separated block indices");
    }
    blocks.push_back(i);
  }
  if (blocks.empty()) throw InvalidArgument("--mask-blocks '" + spec + "' names no block");
  for (const int64_t i : blocks) {
    if (i < 0 || i >= num_blocks) {
      throw InvalidArgument("--mask-blocks has block " + std::to_string(i) + ", the model has " +
                            std::to_string(num_blocks) + " blocks (0.." + std::to_string(num_blocks - 1) + ")");
    }
  }
  return blocks;
}

}  // namespace sluice::cli
