#include "offload/layer/foreign_model.h"

#include <map>
#include <set>
#include <sstream>

#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/host_memory.h"
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
    : ForeignModel(std::move(options)) {
  for (auto& l : layers) add_layer(std::move(l));
  add_extras(std::move(extras));
}

ForeignModel::ForeignModel(ForeignOptions options)
    : options_(std::move(options)), skip_(options_.skip), root_(std::make_shared<torch::nn::Module>("ForeignModel")) {
  if (!at::isFloatingType(options_.compute)) {
    throw InvalidArgument(std::string("offload: compute dtype must be floating, got ") + c10::toString(options_.compute));
  }
}

void ForeignModel::add_layer(ForeignLayer l) {
  check_name(l.name, "layer", seen_);
  try {
    store(l);
  } catch (...) {
    seen_.erase(l.name);  // a refused layer leaves nothing behind, its name included
    throw;
  }
}

void ForeignModel::store(const ForeignLayer& l) {
  const at::Tensor& w = l.weight;
  const char* kind = l.kind == LayerKind::linear ? "a Linear weight is [out, in]"
                     : l.kind == LayerKind::embedding ? "an embedding table is [num, dim]"
                                                      : "a weight has at least one dim";
  const bool shape_ok = w.defined() && (l.kind == LayerKind::other ? w.dim() >= 1 : w.dim() == 2);
  if (!shape_ok) {
    throw InvalidArgument("offload: layer '" + l.name + "' has a weight of " + std::to_string(w.defined() ? w.dim() : 0) +
                          " dims; " + kind);
  }
  if (!w.device().is_cpu()) throw InvalidArgument("offload: the weight of layer '" + l.name + "' is not on the host");
  if (!at::isFloatingType(w.scalar_type())) {
    throw InvalidArgument(std::string("offload: the weight of layer '") + l.name + "' is " +
                          c10::toString(w.scalar_type()) + ", not floating");
  }
  if (l.bias && l.kind == LayerKind::embedding) throw InvalidArgument("offload: embedding '" + l.name + "' has a bias");
  if (l.bias && (l.bias->dim() != 1 || l.bias->size(0) != w.size(0) || !l.bias->device().is_cpu())) {
    throw InvalidArgument("offload: the bias of layer '" + l.name + "' is not a host tensor of " +
                          std::to_string(w.size(0)) + " values");
  }
  if (l.compute && !at::isFloatingType(*l.compute)) {
    throw InvalidArgument(std::string("offload: layer '") + l.name + "' has compute dtype " + c10::toString(*l.compute) +
                          ", not floating");
  }
  const bool skipped = skip_.matches(l.name).has_value() || at::isFloat8Type(w.scalar_type());
  const at::ScalarType storage = skipped ? w.scalar_type() : options_.storage;
  // A layer kept in its own dtype computes in it, as without sluice; another in the one named.
  const at::ScalarType compute = skipped && !at::isFloat8Type(w.scalar_type()) ? w.scalar_type()
                                                                               : l.compute.value_or(options_.compute);
  // Always sluice's own memory, never the caller's (Note [foreign layers]), and from
  // host_empty(): a large layer in a mapping of its own, given back to the system the moment
  // it is freed (pinning moves it into the arena; remove() frees it layer by layer), not
  // kept in the C library's heap.
  auto own = [](const at::Tensor& stored) { return to_host_owned(stored, stored.scalar_type()); };
  at::Tensor stored = own(cast_to_storage(w.detach(), storage, l.name).stored);
  std::optional<at::Tensor> bias;  // stored as the weight is, as diffusers' layerwise casting does
  if (l.bias) bias = own(cast_to_storage(l.bias->detach(), storage, l.name + ".bias").stored);
  const at::TensorOptions built = at::TensorOptions().dtype(compute).device(at::kCPU);
  std::shared_ptr<ManagedLayerImpl> layer;
  switch (l.kind) {
    case LayerKind::linear: layer = std::make_shared<LinearImpl>(w.size(1), w.size(0), bias.has_value(), built); break;
    case LayerKind::embedding: layer = std::make_shared<EmbeddingImpl>(w.size(0), w.size(1), built); break;
    case LayerKind::other: layer = std::make_shared<HostComputedImpl>(w.sizes(), bias.has_value(), built); break;
  }
  layer->set_stored(stored, bias);
  layer->set_compute_dtype(compute);
  layer->set_qualified_name(l.name);
  layer->set_layer_index(static_cast<int64_t>(layers_.size()));
  const auto [parent, leaf] = split_name(l.name);
  module_at(*root_, made_, parent).register_module(leaf, layer);
  layers_.push_back(std::move(layer));
}

void ForeignModel::add_extras(std::vector<std::pair<std::string, at::Tensor>> extras) {
  for (auto& [name, t] : extras) {
    check_name(name, "parameter", seen_);
    if (!t.defined() || !t.device().is_cpu()) throw InvalidArgument("offload: parameter '" + name + "' is not on the host");
    const auto [parent, leaf] = split_name(name);
    // A buffer, not a parameter: registering a parameter would set requires_grad on the
    // caller's tensor. The same tensor (same impl): the engine re-points it in place.
    module_at(*root_, made_, parent).register_buffer(leaf, t);
    extra_bytes_ += static_cast<int64_t>(t.nbytes());
  }
}

void ForeignModel::release_host(size_t i) {
  ManagedLayerImpl& l = layer(i);
  if (!l.stored_weight().device().is_cpu()) {
    throw InvalidArgument("offload: layer '" + l.qualified_name() + "' is on the device; detach the model first");
  }
  l.release_stored();
}

int64_t ForeignModel::stored_bytes() const {
  int64_t total = extra_bytes_;
  for (const auto& l : layers_) total += l->stored_bytes();
  return total;
}

HostComputedImpl::HostComputedImpl(at::IntArrayRef weight_shape, bool bias, at::TensorOptions options)
    : ManagedLayerImpl(LayerKind::other, at::empty(weight_shape, options),
                       bias ? std::optional<at::Tensor>(at::zeros({weight_shape[0]}, options)) : std::nullopt) {}

ManagedLayerImpl& ForeignModel::layer(size_t i) const {
  if (i >= layers_.size()) {
    throw InvalidArgument("offload: no layer " + std::to_string(i) + " (the model has " + std::to_string(layers_.size()) + ")");
  }
  return *layers_[i];
}

ManagedLayerImpl& ForeignModel::layer(size_t i, LayerKind kind, const char* what) const {
  ManagedLayerImpl& l = layer(i);
  if (l.kind() != kind) throw InvalidArgument("offload: layer '" + l.qualified_name() + "' is not " + what);
  return l;
}

at::Tensor ForeignModel::linear(size_t i, const at::Tensor& x) {
  return static_cast<LinearImpl&>(layer(i, LayerKind::linear, "a Linear layer")).forward(x);
}

at::Tensor ForeignModel::embedding(size_t i, const at::Tensor& ids) {
  auto& e = static_cast<EmbeddingImpl&>(layer(i, LayerKind::embedding, "an embedding"));
  if (ids.scalar_type() != at::kLong && ids.scalar_type() != at::kInt) {
    throw InvalidArgument("offload: embedding '" + e.qualified_name() + "' takes int32/int64 ids, got " +
                          c10::toString(ids.scalar_type()));
  }
  return e.forward(ids);
}

at::Tensor ForeignModel::with_weights(size_t i, const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& fn) {
  ManagedLayerImpl& l = layer(i);
  WeightLease lease(l);
  return fn(lease.weight(), lease.bias());
}

StoredLayer ForeignModel::host_copy(size_t i) const {
  const ManagedLayerImpl& l = layer(i);
  if (!l.stored_weight().device().is_cpu() || (l.has_bias() && !l.stored_bias().device().is_cpu())) {
    throw InvalidArgument("offload: layer '" + l.qualified_name() + "' is on the device; detach the model first");
  }
  StoredLayer s;
  s.weight = l.stored_weight().clone();
  if (l.has_bias()) s.bias = l.stored_bias().clone();
  return s;
}

}  // namespace sluice::offload
