#include "models/anima/convert.h"

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <map>
#include <utility>
#include <vector>

#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "runtime/skip_patterns.h"

namespace sluice::anima {
namespace {

constexpr const char* kPrefix = "net.";

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The model's name for the output's config: the source's own metadata name, else its file
// name without ".safetensors" (the loader names a file's config after its path).
std::string source_name(const std::string& path) {
  const auto f = safetensors::File::open(path);
  const auto meta = f->metadata().find(kMetaConfig);
  if (meta != f->metadata().end()) {
    const nlohmann::json j = nlohmann::json::parse(meta->second, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("name") && j["name"].is_string()) return j["name"].get<std::string>();
  }
  std::string stem = path.substr(path.find_last_of('/') + 1);
  const std::string ext = ".safetensors";
  if (stem.size() > ext.size() && stem.compare(stem.size() - ext.size(), ext.size(), ext) == 0)
    stem.resize(stem.size() - ext.size());
  return stem;
}

uint64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

}  // namespace

ConvertReport convert_checkpoint(const std::string& in, const std::string& out, const Fp8Options& storage,
                                 int threads) {
  if (!is_fp8(storage.storage)) {
    throw InvalidArgument("convert: --storage " + dtype_name(storage.storage) +
                          " is not an fp8 dtype (float8_e4m3fn or float8_e5m2)");
  }
  if (same_file(in, out)) throw InvalidArgument("convert: --out '" + out + "' is the input file '" + in + "'");
  LoadOptions lo;
  lo.storage = storage;
  lo.threads = threads;
  AnimaModel model = load_anima(in, lo);  // CPU: the stored dtypes are exactly the requested ones
  AnimaConfig config = model->config();
  config.name = source_name(in);
  ConvertReport r;
  r.model_name = config.name;
  r.in_bytes = file_size(in);

  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    tensors.emplace_back(kPrefix + item.key(), item.value().contiguous());
    if (item.value().scalar_type() == storage.storage) ++r.fp8_tensors;
  }
  nlohmann::json quantized = nlohmann::json::object();
  for (const auto& [name, layer] : offload::managed_layers(*model)) {
    if (!is_fp8(layer->stored_weight().scalar_type())) {
      ++r.skipped_layers;
      continue;
    }
    const at::Tensor& scale = layer->weight_scale();
    if (!scale.defined()) continue;
    // Per tensor a scalar, per channel [out, 1] (Note [convert layout]).
    const at::Tensor s = scale.dim() == 0 ? scale.to(at::kFloat) : scale.to(at::kFloat).reshape({-1, 1});
    tensors.emplace_back(kPrefix + name + ".weight_scale", s.contiguous());
    quantized[kPrefix + name] = {{"format", dtype_name(storage.storage)}, {"full_precision_matrix_mult", true}};
    ++r.scales;
  }
  r.tensors = static_cast<int64_t>(tensors.size());

  const SkipList skips = SkipList::from_options(storage, declared_fp8_skips());
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {kMetaConfig, config_to_json(config).dump()},
      {"sluice.storage", dtype_name(storage.storage)},
      {"sluice.compute", dtype_name(model->compute_dtype())},
      {"sluice.scale", to_string(storage.scale_mode)},
      {"sluice.skips", nlohmann::json(skips.patterns()).dump()},
  };
  if (r.scales > 0) {
    metadata["_quantization_metadata"] =
        nlohmann::json{{"format_version", "1.0"}, {"layers", std::move(quantized)}}.dump();
  }
  safetensors::save(out, tensors, metadata);
  r.out_bytes = file_size(out);
  return r;
}

}  // namespace sluice::anima
