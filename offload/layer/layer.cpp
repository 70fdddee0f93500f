#include "offload/layer/layer.h"

#include <stdexcept>

#include "offload/layer/output_observer.h"
#include "offload/layer/repoint.h"
#include "runtime/fault_injection.h"

#include <c10/util/Exception.h>

#include "runtime/fp8.h"

namespace sluice::offload {

ManagedLayerImpl::ManagedLayerImpl(LayerKind kind, at::Tensor weight, std::optional<at::Tensor> bias)
    : kind_(kind), compute_dtype_(weight.scalar_type()) {
  weight_ = register_parameter("weight", std::move(weight), /*requires_grad=*/false);
  if (bias) bias_ = register_parameter("bias", std::move(*bias), /*requires_grad=*/false);
}

void ManagedLayerImpl::set_stored(at::Tensor weight, std::optional<at::Tensor> bias) {
  TORCH_CHECK(weight.sizes() == weight_.sizes(), "set_stored: weight shape ", weight.sizes(), " differs from ",
              weight_.sizes(), " in ", qualified_name_);
  repoint(weight_, weight);
  if (bias) {
    TORCH_CHECK(bias_.defined(), "set_stored: ", qualified_name_, " has no bias");
    TORCH_CHECK(bias->sizes() == bias_.sizes(), "set_stored: bias shape ", bias->sizes(), " differs from ",
                bias_.sizes(), " in ", qualified_name_);
    repoint(bias_, *bias);
  }
}

void ManagedLayerImpl::release_stored() {
  repoint(weight_, at::empty({0}, weight_.options()));
  if (bias_.defined()) repoint(bias_, at::empty({0}, bias_.options()));
  weight_scale_ = at::Tensor();
}

int64_t ManagedLayerImpl::stored_bytes() const {
  int64_t n = weight_.nbytes();
  if (bias_.defined()) n += bias_.nbytes();
  if (weight_scale_.defined()) n += weight_scale_.nbytes();
  return n;
}

LayerWeights ManagedLayerImpl::upcast_stored() const {
  LayerWeights w;
  w.weight = sluice::upcast(weight_, compute_dtype_, weight_scale_);
  if (bias_.defined()) w.bias = sluice::upcast(bias_, compute_dtype_, at::Tensor());
  return w;
}

WeightLease::WeightLease(ManagedLayerImpl& layer, Form form) : layer_(layer) {
  if (WeightProvider* p = layer.provider()) {
    weights_ = form == Form::stored ? p->acquire_stored(layer) : p->acquire(layer);
  } else if (form == Form::stored) {
    weights_.weight = layer.stored_weight();
    weights_.bias = layer.stored_bias();
    weights_.scale = layer.weight_scale();
    weights_.stored = true;
  } else {
    weights_ = layer.upcast_stored();
  }
}

WeightLease::~WeightLease() {
  weights_ = LayerWeights{};
  if (layer_.provider()) layer_.provider()->release(layer_);
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias, at::TensorOptions options)
    : ManagedLayerImpl(LayerKind::linear, at::empty({out_features, in_features}, options),
                       bias ? std::optional<at::Tensor>(at::zeros({out_features}, options)) : std::nullopt) {}

at::Tensor LinearImpl::forward(const at::Tensor& x_in) {
  // Note [input adapters]: the last added is the outermost wrapper, so it runs first.
  at::Tensor x = x_in;
  const auto& adapters = input_adapters();
  for (auto it = adapters.rbegin(); it != adapters.rend(); ++it) x = (*it->fn)(x);
  at::Tensor y;
  {
    WeightLease lease(*this);
    // A failure inside the layer's forward while its lease is held (stress driver, tests).
    if (fault::triggered("layer.forward")) throw std::runtime_error(qualified_name() + ": layer forward failed (injected fault)");
    y = at::linear(x, lease.weight(), lease.bias());
  }
  for (const auto& lora : loras()) {
    y = y + at::linear(at::linear(x.to(lora.down.scalar_type()), lora.down), lora.up).mul(lora.scale).to(y.scalar_type());
  }
  observe_output(*this, y);  // Note [layer output observer]
  return y;
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t dim, at::TensorOptions options)
    : ManagedLayerImpl(LayerKind::embedding, at::empty({num_embeddings, dim}, options), std::nullopt) {}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              qualified_name(), ": embedding ids must be int32/int64, got ", ids.scalar_type());
  at::Tensor y;
  {
    WeightLease lease(*this, WeightLease::Form::stored);  // Note [embedding rows]
    const LayerWeights& w = lease.weights();
    const at::Tensor idx = ids.to(at::kLong);
    if (!w.stored || (w.weight.scalar_type() == compute_dtype() && !w.scale.defined())) {
      y = at::embedding(w.weight, idx);
    } else {
      const at::Tensor flat = idx.reshape({-1});
      // The rows' bytes (gathered as integers of the same width: index_select need not know
      // fp8), then their upcast.
      const at::Tensor& table = w.weight;
      const at::ScalarType bits = table.element_size() == 1 ? at::kByte : table.element_size() == 2 ? at::kShort
                                                                                                    : at::kInt;
      at::Tensor rows = table.view(bits).index_select(0, flat).view(table.scalar_type());
      at::Tensor scale = w.scale;
      if (scale.defined() && scale.dim() == 1 && scale.size(0) == table.size(0)) scale = scale.index_select(0, flat);
      std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
      shape.push_back(table.size(1));
      y = sluice::upcast(rows, compute_dtype(), scale).view(shape);
    }
  }
  observe_output(*this, y);  // Note [layer output observer]
  return y;
}

std::vector<std::pair<std::string, ManagedLayerImpl*>> managed_layers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, ManagedLayerImpl*>> out;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (auto* layer = dynamic_cast<ManagedLayerImpl*>(item.value().get())) out.emplace_back(item.key(), layer);
  }
  return out;
}

}  // namespace sluice::offload
