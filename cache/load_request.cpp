#include "cache/load_request.h"

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace sluice::cache {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string file_stem(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t dot = base.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? base : base.substr(0, dot);
}

// Absolute path without symlinks, or `path` itself when it cannot be resolved (the load
// then fails with the file's own error).
std::string canonical(const std::string& path) {
  char* r = ::realpath(path.c_str(), nullptr);
  if (!r) return path;
  std::string out(r);
  std::free(r);
  return out;
}

}  // namespace

SourceKind source_kind(const std::string& source) {
  for (const auto& p : anima::preset_names()) {
    if (p == source) return SourceKind::preset;
  }
  return ends_with(source, ".json") ? SourceKind::json_config : SourceKind::checkpoint;
}

LoadRequest LoadRequest::resolve(const LoadSpec& spec, at::Device device) {
  if (spec.max_resident && !(*spec.max_resident >= 0.0 && *spec.max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*spec.max_resident));
  }
  LoadRequest r;
  r.spec = spec;
  r.kind = source_kind(spec.source);
  r.dtypes = resolve_dtypes(spec.storage.storage, spec.storage.compute, device);
  r.skips = SkipList::from_options(spec.storage, anima::declared_fp8_skips());
  r.config = spec.config;
  r.key = r.kind == SourceKind::preset ? "preset:" + spec.source : "file:" + canonical(spec.source);
  if (r.kind != SourceKind::checkpoint) r.key += "#seed=" + std::to_string(spec.seed);
  std::ostringstream settings;
  settings << "storage=" << dtype_name(r.dtypes.storage) << " compute=" << dtype_name(r.dtypes.compute) << " skips=[";
  for (const auto& p : r.skips.patterns()) settings << p << ";";
  settings << "] config=" << (spec.config ? anima::config_to_json(*spec.config).dump() : "");
  r.settings = settings.str();
  return r;
}

const anima::AnimaConfig& LoadRequest::resolve_config() {
  if (config) return *config;
  switch (kind) {
    case SourceKind::preset:
    case SourceKind::json_config: config = anima::config_from_name_or_file(spec.source); break;
    case SourceKind::checkpoint: {
      const auto file = safetensors::File::open(spec.source);
      const anima::CheckpointProbe probe = anima::probe_checkpoint(*file);
      if (!probe.has_dit) throw CheckpointError("'" + spec.source + "' is not an Anima checkpoint: " + probe.reason);
      config = probe.inferred;
      break;
    }
  }
  return *config;
}

std::string LoadRequest::model_name() const {
  if (!spec.name.empty()) return spec.name;
  if (spec.config) return spec.config->name;
  if (kind == SourceKind::checkpoint) return file_stem(spec.source);
  if (kind == SourceKind::json_config && config) return config->name;
  return spec.source;
}

}  // namespace sluice::cache
