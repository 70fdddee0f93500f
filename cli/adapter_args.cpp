#include "cli/adapter_args.h"

#include <cmath>
#include <ostream>
#include <sstream>

namespace sluice::cli {

namespace {

// The problem with `spec`, or "" (filling path and scale).
std::string lora_spec_problem(const std::string& spec, std::string& path, double& scale) {
  const size_t colon = spec.rfind(':');
  if (colon == std::string::npos) {
    if (spec.empty()) return "expected FILE[:SCALE], got an empty value";
    path = spec;
    scale = 1.0;
    return {};
  }
  path = spec.substr(0, colon);
  const std::string text = spec.substr(colon + 1);
  if (path.empty()) return "'" + spec + "': no file before ':'";
  try {
    size_t used = 0;
    scale = std::stod(text, &used);
    if (used == text.size() && std::isfinite(scale)) return {};
  } catch (const std::exception&) {
  }
  return "'" + spec + "': scale '" + text + "' is not a finite number (FILE[:SCALE])";
}

}  // namespace

std::pair<std::string, double> parse_lora_spec(const std::string& spec, const std::string& flag) {
  std::string path;
  double scale = 1.0;
  const std::string problem = lora_spec_problem(spec, path, scale);
  if (!problem.empty()) throw CLI::ValidationError(flag, problem);
  return {path, scale};
}

void add_adapter_options(CLI::App* sub, AdapterFlags& flags) {
  sub->add_option("--lora", flags.loras,
                  "LoRA safetensors file to apply, FILE[:SCALE] (scale default 1); repeatable, applied in order")
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {
            std::string path;
            double scale = 1.0;
            return lora_spec_problem(value, path, scale);
          },
          "FILE[:SCALE]", "lora"));
  sub->add_option("--adapter-blocks", flags.adapter_blocks,
                  "Where the blocks of an adapter (--lora, --lllite) trained on a shallower Anima go: measured (the "
                  "blocks it was trained on, in a 40- or 52-block Anima-2.9B/3.8B) or as-is (by index)")
      ->check(CLI::IsMember({"measured", "as-is"}))
      ->capture_default_str();
}

std::vector<LoraHandle> apply_loras(LockedModel& model, const AdapterFlags& flags, std::ostream* out) {
  std::vector<LoraHandle> handles;
  const BlockLayout layout = flags.layout();
  for (const auto& spec : flags.loras) {
    const auto [path, scale] = parse_lora_spec(spec);
    handles.push_back(model.apply_lora(path, scale, layout));
    if (out) {
      std::ostringstream s;
      s << "LoRA '" << path << "' at scale " << scale << ": " << handles.back().patched_layers() << " layers\n";
      *out << s.str();
    }
  }
  return handles;
}

}  // namespace sluice::cli
