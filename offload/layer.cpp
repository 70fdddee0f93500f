#include "offload/layer.h"

#include <stdexcept>

#include "offload/output_observer.h"
#include "offload/repoint.h"
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

WeightLease::WeightLease(ManagedLayerImpl& layer) : layer_(layer) {
  weights_ = layer.provider() ? layer.provider()->acquire(layer) : layer.upcast_stored();
}

WeightLease::~WeightLease() {
  weights_ = LayerWeights{};
  if (layer_.provider()) layer_.provider()->release(layer_);
}

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias, at::TensorOptions options)
    : ManagedLayerImpl(LayerKind::linear, at::empty({out_features, in_features}, options),
                       bias ? std::optional<at::Tensor>(at::zeros({out_features}, options)) : std::nullopt) {}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
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
    WeightLease lease(*this);
    y = at::embedding(lease.weight(), ids.to(at::kLong));
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
