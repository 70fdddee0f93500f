#pragma once
// ForeignModel: the layers of a torch model someone else wrote (a diffusers transformer, a
// frontend's text encoder), held as sluice managed layers so that a StreamingEngine can
// stream them, with the model's other parameters and buffers beside them. It is the
// engine-side half of offloading a model in place (`sluice.offload` in Python, issue 31):
// the host's model keeps its own modules and forward, and each of its Linear layers calls
// linear() here instead of using its own weight, each embedding embedding(), and each
// other weighted layer (a convolution) computes itself with the weights with_weights()
// leases it.
//
// Note [foreign layers]
// ~~~~~~~~~~~~~~~~~~~~~
// What a foreign model hands over, and what happens to it:
//  - Each layer's weight (Linear [out, in], embedding [num, dim], convolution [out, in/g,
//    k...]) and bias are cast to the storage dtype
//    (runtime/fp8.h cast_to_storage: NaN/Inf refused, out-of-range values saturated) into a
//    new host tensor that the managed layer owns; a layer whose dotted name matches the skip
//    list keeps its weight's own dtype (stored unconverted, leased without an upcast), as
//    diffusers' layerwise casting keeps the modules its skip patterns name. A tensor that
//    is already in the dtype it is stored in is copied too: sluice never shares the caller's
//    memory, so a write through a reference the caller kept cannot reach the stored copy
//    for streamed layers and miss it for resident ones (an output that would depend on the
//    budget). The caller's tensor objects are not touched: what becomes of them is the
//    caller's choice (Python's sluice.offload frees each layer's original once add_layer()
//    has copied it, so that the host holds the original of one layer at most twice, and
//    gives them back from host_copy() at remove()).
//  - Layers come one at a time (add_layer), then the extras (add_extras), so that a host can
//    free each original before handing over the next.
//  - Each layer computes in its own compute dtype: a skipped layer in its weight's dtype,
//    any other in the one the host names for it (the options' by default).
//  - The other parameters and buffers (norms, RoPE tables, the tables of embeddings the
//    host does not hand over as layers) are the
//    caller's tensors themselves, registered under the model's dotted names without
//    copying: attaching the model re-points them at device copies in place (offload/
//    repoint.h), and detaching points them back at the very same host memory, so the
//    caller's module sees its norms move and come back bit for bit.
//  - Names keep the caller's dotted paths (the plan, the stats and the trace name the
//    layers as the caller's model does); layers are registered in the order given, which
//    the engine takes as the order to plan by until the first forward records the real one.
// A layer's compute dtype is the one linear() takes inputs in and embedding() and
// with_weights() give rows and weights in.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "offload/layer/layer.h"
#include "runtime/skip_patterns.h"
#include "runtime/dtype_policy.h"

namespace sluice::offload {

struct ForeignLayer {
  std::string name;                // dotted name in the caller's model ("blocks.0.attn.to_q")
  at::Tensor weight;               // on the host, any floating dtype: [out, in] (linear), [num, dim]
                                   // (embedding), any shape with out first (other)
  std::optional<at::Tensor> bias;  // [out]; none for an embedding
  LayerKind kind = LayerKind::linear;
  std::optional<at::ScalarType> compute;  // none: the options' (a skipped layer: its weight's dtype)
};

// A layer its host computes itself with the weights it leases (LayerKind::other): a
// convolution, whose stride, padding and groups are the host's.
class HostComputedImpl : public ManagedLayerImpl {
 public:
  HostComputedImpl(at::IntArrayRef weight_shape, bool bias, at::TensorOptions options);
};

// A layer's stored tensors, copied to new host memory.
struct StoredLayer {
  at::Tensor weight;
  std::optional<at::Tensor> bias;
};

struct ForeignOptions {
  at::ScalarType storage = at::kFloat8_e4m3fn;  // bf16/fp16/fp32: no fp8
  at::ScalarType compute = at::kBFloat16;
  std::vector<std::string> skip;  // patterns (runtime/skip_patterns.h): these layers keep their dtype
};

class ForeignModel {
 public:
  // InvalidArgument naming the layer or tensor at fault: a weight of the wrong shape for its
  // kind or not on the host, a bias of the wrong shape (or on an embedding), a name used twice or empty, a compute dtype that
  // is not floating. NaN/Inf in a weight: the storage cast's error, naming the layer.
  ForeignModel(std::vector<ForeignLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
               ForeignOptions options);
  // An empty model: add_layer() each layer, then add_extras() once.
  explicit ForeignModel(ForeignOptions options);
  // Stores one more layer (errors as the constructor's; nothing is kept of a layer refused).
  void add_layer(ForeignLayer layer);
  void add_extras(std::vector<std::pair<std::string, at::Tensor>> extras);
  // Frees layer i's stored tensors (its host copy), once the host has taken them back; the
  // layer then has none: only for a model no engine holds any more.
  void release_host(size_t i);

  // What StreamingEngine::attach takes.
  torch::nn::Module& module() { return *root_; }
  // The same, for a holder that may outlive this object (the model cache's entry).
  std::shared_ptr<torch::nn::Module> module_ptr() const { return root_; }
  size_t size() const { return layers_.size(); }
  const std::string& name(size_t i) const { return layers_.at(i)->qualified_name(); }
  // The dtype layer i is stored in (the storage dtype, or its own when skipped).
  at::ScalarType stored_dtype(size_t i) const { return layer(i).stored_weight().scalar_type(); }
  // Stored bytes of every layer and extra: the model's host copy.
  int64_t stored_bytes() const;
  LayerKind kind(size_t i) const { return layer(i).kind(); }
  // y = x W^T + b for layer i, its weights leased from its provider (the engine, when
  // attached) for the duration of the call. InvalidArgument for a bad i or a layer of
  // another kind.
  at::Tensor linear(size_t i, const at::Tensor& x);
  // Rows `ids` of embedding i's table, in the compute dtype.
  at::Tensor embedding(size_t i, const at::Tensor& ids);
  // fn(weight, bias) with layer i's weights leased for the call (bias undefined when it
  // has none), whatever its kind.
  at::Tensor with_weights(size_t i, const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& fn);
  // Copies of layer i's stored weight and bias (in the dtype stored_dtype(i) names), while
  // the model is not attached (its layers are on the host); InvalidArgument otherwise.
  StoredLayer host_copy(size_t i) const;

 private:
  void store(const ForeignLayer& layer);     // add_layer's work, its name already taken
  ManagedLayerImpl& layer(size_t i) const;  // InvalidArgument for a bad i
  ManagedLayerImpl& layer(size_t i, LayerKind kind, const char* what) const;  // and of that kind

  ForeignOptions options_;
  SkipList skip_;  // options_.skip, its patterns compiled once
  std::shared_ptr<torch::nn::Module> root_;
  std::vector<std::shared_ptr<ManagedLayerImpl>> layers_;
  std::map<std::string, std::shared_ptr<torch::nn::Module>> made_;  // parent modules by dotted path
  std::set<std::string> seen_;                                       // names given so far
  int64_t extra_bytes_ = 0;
};

}  // namespace sluice::offload
