#include "offload/foreign_model.h"

#include <map>
#include <set>
#include <sstream>

#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/skip_patterns.h"

namespace sluice::offload {

namespace {

// The module at dotted path `parent` under `root`, made (empty) where missing.
torch::nn::Module& module_at(torch::nn::Module& root, std::map<std::string, std::shared_ptr<torch::nn::Module>>& made,
                             const std::string& parent) {
  if (parent.empty()) return root;
  auto it = made.find(parent);
  if (it != made.end()) return *it->second;
  const size_t dot = parent.rfind('.');
  torch::nn::Module& up = module_at(root, made, dot == std::string::npos ? "" : parent.substr(0, dot));
  auto m = up.register_module(dot == std::string::npos ? parent : parent.substr(dot + 1),
                              std::make_shared<torch::nn::Module>());
  made[parent] = m;
  return *m;
}

std::pair<std::string, std::string> split_name(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

void check_name(const std::string& name, const char* what, std::set<std::string>& seen) {
  if (name.empty() || name.front() == '.' || name.back() == '.' || name.find("..") != std::string::npos) {
    throw InvalidArgument(std::string("offload: ") + what + " name '" + name + "' is not a dotted module path");
  }
  if (!seen.insert(name).second) throw InvalidArgument(std::string("offload: ") + what + " name '" + name + "' is given twice");
}

}  // namespace

ForeignModel::ForeignModel(std::vector<ForeignLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                           ForeignOptions options)
    : root_(std::make_shared<torch::nn::Module>("ForeignModel")) {
  if (!at::isFloatingType(options.compute)) {
    throw InvalidArgument(std::string("offload: compute dtype must be floating, got ") + c10::toString(options.compute));
  }
  const SkipList skip(options.skip);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> made;
  std::set<std::string> seen;
  int64_t index = 0;
  for (auto& l : layers) {
    check_name(l.name, "layer", seen);
    const at::Tensor& w = l.weight;
    if (!w.defined() || w.dim() != 2) {
      throw InvalidArgument("offload: layer '" + l.name + "' has a weight of " + std::to_string(w.defined() ? w.dim() : 0) +
                            " dims; a Linear weight is [out, in]");
    }
    if (!w.device().is_cpu()) throw InvalidArgument("offload: the weight of layer '" + l.name + "' is not on the host");
    if (!at::isFloatingType(w.scalar_type())) {
      throw InvalidArgument(std::string("offload: the weight of layer '") + l.name + "' is " +
                            c10::toString(w.scalar_type()) + ", not floating");
    }
    if (l.bias && (l.bias->dim() != 1 || l.bias->size(0) != w.size(0) || !l.bias->device().is_cpu())) {
      throw InvalidArgument("offload: the bias of layer '" + l.name + "' is not a host tensor of " +
                            std::to_string(w.size(0)) + " values");
    }
    const bool skipped = skip.matches(l.name).has_value() || at::isFloat8Type(w.scalar_type());
    const at::ScalarType storage = skipped ? w.scalar_type() : options.storage;
    StorageCast cast = cast_to_storage(w.detach(), storage, l.name);
    // Already in the storage dtype: the caller's memory itself, not a copy (Note [foreign layers]).
    at::Tensor stored = cast.stored.contiguous();
    std::optional<at::Tensor> bias;  // stored as the weight is, as diffusers' layerwise casting does
    if (l.bias) bias = cast_to_storage(l.bias->detach(), storage, l.name + ".bias").stored.contiguous();
    auto layer = std::make_shared<LinearImpl>(w.size(1), w.size(0), bias.has_value(),
                                              at::TensorOptions().dtype(options.compute).device(at::kCPU));
    layer->set_stored(stored, bias);
    layer->set_compute_dtype(options.compute);
    layer->set_qualified_name(l.name);
    layer->set_layer_index(index++);
    const auto [parent, leaf] = split_name(l.name);
    module_at(*root_, made, parent).register_module(leaf, layer);
    layers_.push_back(std::move(layer));
  }
  for (auto& [name, t] : extras) {
    check_name(name, "parameter", seen);
    if (!t.defined() || !t.device().is_cpu()) throw InvalidArgument("offload: parameter '" + name + "' is not on the host");
    const auto [parent, leaf] = split_name(name);
    // A buffer, not a parameter: registering a parameter would set requires_grad on the
    // caller's tensor. The same tensor (same impl): the engine re-points it in place.
    module_at(*root_, made, parent).register_buffer(leaf, t);
    extra_bytes_ += static_cast<int64_t>(t.nbytes());
  }
}

int64_t ForeignModel::stored_bytes() const {
  int64_t total = extra_bytes_;
  for (const auto& l : layers_) total += l->stored_bytes();
  return total;
}

LinearImpl& ForeignModel::layer(size_t i) const {
  if (i >= layers_.size()) {
    throw InvalidArgument("offload: no layer " + std::to_string(i) + " (the model has " + std::to_string(layers_.size()) + ")");
  }
  return *layers_[i];
}

at::Tensor ForeignModel::linear(size_t i, const at::Tensor& x) { return layer(i).forward(x); }

StoredLayer ForeignModel::host_copy(size_t i) const {
  const LinearImpl& l = layer(i);
  if (!l.stored_weight().device().is_cpu() || (l.has_bias() && !l.stored_bias().device().is_cpu())) {
    throw InvalidArgument("offload: layer '" + l.qualified_name() + "' is on the device; detach the model first");
  }
  StoredLayer s;
  s.weight = l.stored_weight().clone();
  if (l.has_bias()) s.bias = l.stored_bias().clone();
  return s;
}

}  // namespace sluice::offload
