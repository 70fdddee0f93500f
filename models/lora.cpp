#include "models/lora.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <set>

#include "models/anima/block_layout.h"
#include "offload/layer/layer.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "runtime/shape_str.h"

namespace sluice {

int64_t LoraAdapter::rank() const {
  int64_t r = 0;
  for (const auto& t : targets) r = std::max(r, t.down.size(0));
  return r;
}

namespace {

std::string list_some(const std::vector<std::string>& items) {
  std::string s;
  const size_t n = std::min<size_t>(items.size(), 10);
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + items[i];
  if (items.size() > n) s += c10::str(", ... (", items.size(), " in all)");
  return s;
}

// Checks that `t` can be added to `layer` as part `part`; returns the problem or "".
std::string shape_problem(const offload::ManagedLayerImpl& layer, const at::Tensor& down, const at::Tensor& up) {
  const at::IntArrayRef w = layer.stored_weight().sizes();  // [out, in]
  if (layer.kind() != offload::LayerKind::linear) return layer.qualified_name() + " is not a Linear layer (LoRA needs one)";
  const bool ok = down.dim() == 2 && up.dim() == 2 && down.size(0) == up.size(1) && down.size(0) > 0 &&
                  down.size(1) == w[1] && up.size(0) == w[0];
  if (ok) return "";
  return c10::str(layer.qualified_name(), ": down ", shape_str(down.sizes()), ", up ", shape_str(up.sizes()),
                  " do not fit the layer's [out, in] = ", shape_str(w), " (want down [rank, ", w[1], "], up [", w[0],
                  ", rank])");
}

std::map<std::string, std::shared_ptr<offload::ManagedLayerImpl>> layers_by_name(torch::nn::Module& model) {
  std::map<std::string, std::shared_ptr<offload::ManagedLayerImpl>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto l = std::dynamic_pointer_cast<offload::ManagedLayerImpl>(item.value())) out.emplace(item.key(), l);
  }
  return out;
}

}  // namespace

LoraAdapter lora_from_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              torch::nn::Module& model, const std::string& source, bool measured_blocks) {
  const auto layers = offload::managed_layers(model);
  std::vector<std::string> names;
  names.reserve(layers.size());
  for (const auto& [n, l] : layers) names.push_back(n);

  // The adapter's block indices, over every key (a block the model lacks included), and the
  // model's depth decide where its block targets go (Note [Anima block layout]).
  std::vector<std::optional<LoraKeyMatch>> matches;
  matches.reserve(tensors.size());
  int64_t max_block = -1, model_depth = 0;
  for (const auto& n : names) {
    if (const auto b = block_index(n)) model_depth = std::max(model_depth, *b + 1);
  }
  for (const auto& [key, t] : tensors) {
    matches.push_back(map_lora_key(key, names));
    if (!matches.back()) continue;
    if (const auto b = block_index(matches.back()->module)) max_block = std::max(max_block, *b);
  }
  anima::AdapterBlockMap blocks;
  if (model_depth > 0) {
    blocks = anima::map_adapter_blocks(max_block, model_depth, measured_blocks, "LoRA '" + source + "'");
  }
  std::vector<std::string> sorted_names = names;
  std::sort(sorted_names.begin(), sorted_names.end());

  struct Parts {
    at::Tensor down, up, alpha;
    std::string down_key, up_key;
  };
  std::map<std::string, Parts> by_module;
  std::vector<std::string> not_lora, unknown, duplicate, bad_values;
  std::set<std::string> unknown_seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [key, t] = tensors[i];
    auto& m = matches[i];
    if (!m) {
      not_lora.push_back(key);
      continue;
    }
    if (!m->known) {
      if (unknown_seen.insert(m->module).second) unknown.push_back(m->module);
      continue;
    }
    if (blocks.remapped()) {
      if (const auto b = block_index(m->module)) m->module = with_block_index(m->module, blocks(*b));
      if (!std::binary_search(sorted_names.begin(), sorted_names.end(), m->module)) {
        if (unknown_seen.insert(m->module).second) unknown.push_back(m->module);
        continue;
      }
    }
    if (!t.is_floating_point()) {
      bad_values.push_back(c10::str(key, " has dtype ", t.scalar_type()));
      continue;
    }
    Parts& p = by_module[m->module];
    at::Tensor& slot = m->part == LoraPart::down ? p.down : m->part == LoraPart::up ? p.up : p.alpha;
    if (slot.defined()) {
      duplicate.push_back(key);
      continue;
    }
    slot = t;
    if (m->part == LoraPart::down) p.down_key = key;
    if (m->part == LoraPart::up) p.up_key = key;
  }

  std::vector<std::string> incomplete, mismatched;
  std::map<std::string, const offload::ManagedLayerImpl*> layer_of;
  for (const auto& [n, l] : layers) layer_of[n] = l;
  for (const auto& [module, p] : by_module) {
    if (!p.down.defined() || !p.up.defined()) {
      incomplete.push_back(module + (p.down.defined() ? " (no up/lora_B)" : " (no down/lora_A)"));
      continue;
    }
    const std::string problem = shape_problem(*layer_of.at(module), p.down, p.up);
    if (!problem.empty()) mismatched.push_back(problem);
    if (p.alpha.defined() && p.alpha.numel() != 1) {
      mismatched.push_back(c10::str(module, ".alpha has shape ", shape_str(p.alpha.sizes()), " (want a scalar)"));
    }
  }

  if (!not_lora.empty() || !unknown.empty() || !duplicate.empty() || !bad_values.empty() || !incomplete.empty() ||
      !mismatched.empty()) {
    std::string msg = "LoRA '" + source + "' does not fit the model:";
    std::string sep = " ";
    auto add = [&](const std::vector<std::string>& v, const char* what) {
      if (v.empty()) return;
      msg += c10::str(sep, v.size(), " ", what, ": ", list_some(v));
      sep = "; ";
    };
    add(not_lora, "keys that are no LoRA key");
    add(unknown, "unknown target modules");
    add(duplicate, "duplicate keys");
    add(bad_values, "non-float tensors");
    add(incomplete, "incomplete pairs");
    add(mismatched, "shape mismatches");
    throw CheckpointError(msg);
  }

  at::NoGradGuard no_grad;
  LoraAdapter a;
  a.source = source;
  for (const auto& [name, layer] : layers) {
    auto it = by_module.find(name);
    if (it == by_module.end()) continue;
    const Parts& p = it->second;
    LoraTarget t;
    t.module = name;
    // Owned copies: the inputs may be views on a file mapping.
    t.down = p.down.to(at::kCPU).contiguous().clone();
    t.up = p.up.to(at::kCPU).contiguous().clone();
    for (const auto& [key, v] : {std::pair<const std::string&, const at::Tensor&>{p.down_key, t.down},
                                 std::pair<const std::string&, const at::Tensor&>{p.up_key, t.up}}) {
      if (!at::isfinite(v.to(at::kFloat)).all().item<bool>()) {
        throw CheckpointError("LoRA '" + source + "': tensor '" + key + "' holds NaN or inf values");
      }
    }
    const double rank = static_cast<double>(t.down.size(0));
    if (p.alpha.defined()) {
      const double alpha = p.alpha.to(at::kDouble).item<double>();
      if (!std::isfinite(alpha)) {
        throw CheckpointError(c10::str("LoRA '", source, "': ", name, ".alpha is ", alpha, " (must be finite)"));
      }
      t.alpha_scale = alpha / rank;
    }
    a.targets.push_back(std::move(t));
  }
  if (blocks.remapped()) log::info(blocks.describe("LoRA '" + source + "'"));
  return a;
}

LoraAdapter load_lora(const std::string& path, torch::nn::Module& model, bool measured_blocks) {
  const auto file = safetensors::File::open(path);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  tensors.reserve(file->tensors().size());
  for (const auto& info : file->tensors()) {
    if (fault::triggered("lora.read")) {
      throw FileError("LoRA '" + path + "': cannot read tensor '" + info.name + "': I/O error (injected fault)");
    }
    tensors.emplace_back(info.name, file->read(info.name));
  }
  return lora_from_tensors(tensors, model, path, measured_blocks);
}

namespace {
std::atomic<int64_t> next_lora_id{1};
}

LoraScope::LoraScope(torch::nn::Module& model, const LoraAdapter& adapter, double strength,
                     std::optional<at::Device> device, offload::SidecarPlacer* placer)
    : id_(next_lora_id.fetch_add(1)) {
  if (!std::isfinite(strength)) {
    throw InvalidArgument(c10::str("LoRA '", adapter.source, "': strength ", strength, " is not finite"));
  }
  const auto layers = layers_by_name(model);
  if (!placer && !device) {  // attached: the engine that streams the model places them
    for (const auto& [name, layer] : layers) {
      if ((placer = dynamic_cast<offload::SidecarPlacer*>(layer->provider()))) break;
    }
  }
  // Validate and convert everything first, so that a failure patches nothing.
  std::vector<std::pair<std::shared_ptr<offload::ManagedLayerImpl>, offload::LoraSidecar>> staged;
  std::vector<std::string> missing, mismatched;
  at::NoGradGuard no_grad;
  for (const auto& t : adapter.targets) {
    auto it = layers.find(t.module);
    if (it == layers.end()) {
      missing.push_back(t.module);
      continue;
    }
    const std::string problem = shape_problem(*it->second, t.down, t.up);
    if (!problem.empty()) {
      mismatched.push_back(problem);
      continue;
    }
    const auto& layer = it->second;
    if (fault::triggered("lora.patch")) {
      throw ResourceError("LoRA '" + adapter.source + "': cannot place the sidecar of '" + t.module +
                          "' on the device (injected fault)");
    }
    offload::LoraSidecar s;
    if (!placer) {
      const at::Device dev = device.value_or(layer->stored_weight().device());
      s.down = t.down.to(dev, layer->compute_dtype());
      s.up = t.up.to(dev, layer->compute_dtype());
    }
    s.scale = t.alpha_scale * strength;
    s.id = id_;
    staged.emplace_back(layer, std::move(s));
  }
  if (!missing.empty() || !mismatched.empty()) {
    std::string msg = "LoRA '" + adapter.source + "' cannot patch this model:";
    if (!missing.empty()) msg += c10::str(" ", missing.size(), " unknown target modules: ", list_some(missing));
    if (!mismatched.empty()) {
      msg += c10::str(missing.empty() ? " " : "; ", mismatched.size(), " shape mismatches: ", list_some(mismatched));
    }
    throw CheckpointError(msg);
  }
  if (placer) {
    // All at once, so that the placer makes room for the whole adapter (or refuses it).
    std::vector<at::Tensor> host;
    std::vector<at::ScalarType> dtypes;
    for (size_t i = 0; i < staged.size(); ++i) {
      const auto& t = adapter.targets[i];
      const at::ScalarType dt = staged[i].first->compute_dtype();
      host.push_back(t.down);
      host.push_back(t.up);
      dtypes.insert(dtypes.end(), {dt, dt});
    }
    std::vector<at::Tensor> placed = placer->place_sidecars(host, dtypes, "LoRA '" + adapter.source + "'");
    for (size_t i = 0; i < staged.size(); ++i) {
      staged[i].second.down = std::move(placed[2 * i]);
      staged[i].second.up = std::move(placed[2 * i + 1]);
    }
    placer_ = placer;
  }
  for (const auto& [layer, s] : staged) bytes_ += s.down.nbytes() + s.up.nbytes();
  layers_.reserve(staged.size());
  for (auto& [layer, s] : staged) {
    layer->loras().push_back(std::move(s));
    layers_.push_back(layer);
  }
}

LoraScope::~LoraScope() {
  for (const auto& layer : layers_) {
    auto& v = layer->loras();
    v.erase(std::remove_if(v.begin(), v.end(), [&](const offload::LoraSidecar& s) { return s.id == id_; }), v.end());
  }
  if (placer_) placer_->sidecars_released(bytes_);  // after the sidecars are gone
}

}  // namespace sluice
