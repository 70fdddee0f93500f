#pragma once
// ManagedLayer: the one kind of module whose weights sluice stores, moves and casts.
//
// Its registered parameters ("weight", optional "bias") are the *stored* tensors: in the
// storage dtype (fp8 or not), on the host or the device, as the residency plan says.
// They are never rewritten to the compute dtype. A forward asks for compute-dtype
// copies through a WeightLease, an RAII handle that gives them back when the forward's
// scope ends, on exception too. See Note [weight leases].
//
// Note [weight leases]
// ~~~~~~~~~~~~~~~~~~~~
// libtorch's C++ modules have no forward hooks, so the pre/post hooks that Python
// offloaders use become a scoped handle: WeightLease's constructor asks the layer's
// WeightProvider for the weights (wait for a streamed copy, upcast), and its destructor
// tells the provider the forward is over (record the event that frees a staging slot,
// drop the upcast scratch). With no provider attached, the lease upcasts in place on the
// stored tensor's device, which is what a plain, fully-resident model needs.
//
// Tested by (indirectly, through the forwards of Anima, foreign and toy models, with and without a
// provider): tests/offload/layer/test_fp8_model.cpp ("fp8 model: a throw inside any layer's forward
// leaves every parameter stored and the next forward unchanged", "fp8 model: fp8 off (storage =
// compute) is bit-identical to the plain model"), tests/models/test_lora.cpp ("lora: a LoRA sidecar
// adds scale*(x A^T) B^T with scale = alpha/rank * strength, fp8 weight untouched"),
// tests/models/anima/test_anima_model.cpp ("anima model: managed layers carry their dotted names in
// execution order"), tests/models/anima/test_lllite.cpp ("lllite: an input adapter runs before the
// matmul and before the LoRA sidecars, the last added first"),
// tests/offload/layer/test_foreign_model.cpp ("foreign model: an fp8 embedding
// looks up its rows and upcasts only those, resident or streamed"),
// tests/offload/engine/test_engine.cpp ("engine: a layer that throws mid-forward leaves the engine
// consistent"), tests/python/test_offload_guarantees.py
// (test_an_fp8_embedding_looks_up_rows_without_upcasting_its_table).
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sluice::offload {

class ManagedLayerImpl;

// Compute-dtype weights of one layer, on the compute device.
struct LayerWeights {
  at::Tensor weight;
  at::Tensor bias;   // undefined when the layer has none
  at::Tensor scale;  // with `stored`: the weight's dequantisation scale, undefined when unscaled
  bool stored = false;  // weight and bias in the storage dtype, not upcast (WeightLease::Form::stored)
};

// Supplies compute-dtype weights to layers and is told when a forward is done with them.
// The streaming engine implements it; tests implement it to inject faults.
class WeightProvider {
 public:
  virtual ~WeightProvider() = default;
  virtual LayerWeights acquire(ManagedLayerImpl& layer) = 0;
  // The same weights in their storage dtype, not upcast (their `stored` set), for a forward
  // that upcasts only the part it reads (an embedding's rows, Note [embedding rows]). The
  // default gives acquire()'s upcast weights: a provider that cannot do better stays correct.
  virtual LayerWeights acquire_stored(ManagedLayerImpl& layer) { return acquire(layer); }
  // Must not throw: it runs from WeightLease's destructor, also during unwinding.
  virtual void release(ManagedLayerImpl& layer) noexcept = 0;
};

// A low-rank residual y += scale * (x A^T) B^T added at forward time. A is [rank, in],
// B is [out, rank], both kept in the compute dtype; the stored weight is never touched.
struct LoraSidecar {
  at::Tensor down;  // A: [rank, in]
  at::Tensor up;    // B: [out, rank]
  double scale = 1.0;
  int64_t id = 0;   // owner token, so one adapter's sidecars can be removed together
};

// Perturbs a Linear's input before its matmul (and before its LoRA sidecars): an
// LLLite module (models/anima/lllite.h). Returns `x` itself to pass through.
//
// Note [input adapters]
// ~~~~~~~~~~~~~~~~~~~~~
// An input adapter wraps a Linear's forward the way InvokeAI's LLLite does: the layer
// computes W(x') + LoRA(x') with x' = adapter(x), so a LoRA on the same layer sees the
// perturbed input. With several adapters the one added last is the outermost wrapper and
// runs first (LinearImpl::forward walks the list from the back). The stored weights are
// never touched; an adapter that returns its input unchanged leaves the output bit for bit.
class InputPerturbation {
 public:
  virtual ~InputPerturbation() = default;
  virtual at::Tensor operator()(const at::Tensor& x) = 0;
};

struct InputAdapter {
  std::shared_ptr<InputPerturbation> fn;
  int64_t id = 0;  // owner token, so one adapter's entries can be removed together
};

// Places a model's device-side extras (LoRA sidecars) so that they count where the model's
// device memory is counted. The streaming engine implements it (Note [device extras] in
// model_budget.h); without one, a LoraScope places sidecars with a plain .to(device).
class SidecarPlacer {
 public:
  virtual ~SidecarPlacer() = default;
  // Device copies of host[i] in dtypes[i], all or none; throws ResourceError naming `what`
  // when they do not fit.
  virtual std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host,
                                                 const std::vector<at::ScalarType>& dtypes, const std::string& what) = 0;
  // Sidecars of `bytes` that place_sidecars() returned are no longer used (dropped).
  virtual void sidecars_released(uint64_t bytes) noexcept = 0;
};

// other: a layer whose host computes with the leased weights itself (a convolution of a
// torch model offloaded in place: HostComputedImpl, offload/layer/foreign_model.h).
enum class LayerKind { linear, embedding, other };

class ManagedLayerImpl : public torch::nn::Module {
 public:
  ManagedLayerImpl(LayerKind kind, at::Tensor weight, std::optional<at::Tensor> bias);

  LayerKind kind() const { return kind_; }
  // The registered (stored) parameters.
  const at::Tensor& stored_weight() const { return weight_; }
  const at::Tensor& stored_bias() const { return bias_; }
  bool has_bias() const { return bias_.defined(); }

  // Replace the stored tensors' data (storage cast, move between host and device),
  // keeping the registered parameter objects, so named_parameters() stays valid.
  void set_stored(at::Tensor weight, std::optional<at::Tensor> bias = std::nullopt);
  // Lets go of the stored tensors (empty tensors in their place): a layer whose model is
  // being taken apart (ForeignModel::release_host).
  void release_stored();

  // Optional dequantization scale for scaled fp8 storage: per tensor ([]) or per output
  // channel ([out]), fp32. Undefined when the storage is unscaled.
  const at::Tensor& weight_scale() const { return weight_scale_; }
  void set_weight_scale(at::Tensor scale) { weight_scale_ = std::move(scale); }

  // The dtype the forward computes in. Defaults to the dtype the weights were built in.
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  void set_compute_dtype(at::ScalarType t) { compute_dtype_ = t; }

  // Dotted name inside the model (e.g. "blocks.3.mlp.layer1"); set by the model.
  const std::string& qualified_name() const { return qualified_name_; }
  void set_qualified_name(std::string n) { qualified_name_ = std::move(n); }

  // Position in execution order within its model; -1 until the model assigns it.
  int64_t layer_index() const { return layer_index_; }
  void set_layer_index(int64_t i) { layer_index_ = i; }

  WeightProvider* provider() const { return provider_; }
  void set_provider(WeightProvider* p) { provider_ = p; }

  std::vector<LoraSidecar>& loras() { return loras_; }
  const std::vector<LoraSidecar>& loras() const { return loras_; }
  // Note [input adapters]: applied to a Linear's input, the last added first.
  std::vector<InputAdapter>& input_adapters() { return input_adapters_; }
  const std::vector<InputAdapter>& input_adapters() const { return input_adapters_; }

  // Stored bytes of weight + bias (+ scale).
  int64_t stored_bytes() const;

  // Upcasts the stored tensors to compute dtype on their own device: the lease's work
  // when no provider is attached. Providers call it on the tensors they stage.
  LayerWeights upcast_stored() const;

 protected:
  at::Tensor weight_;
  at::Tensor bias_;

 private:
  LayerKind kind_;
  at::Tensor weight_scale_;
  at::ScalarType compute_dtype_;
  std::string qualified_name_;
  int64_t layer_index_ = -1;
  WeightProvider* provider_ = nullptr;
  std::vector<LoraSidecar> loras_;
  std::vector<InputAdapter> input_adapters_;
};

// RAII handle on a layer's compute-dtype weights. See Note [weight leases].
class WeightLease {
 public:
  // compute: the weights upcast to the compute dtype; stored: as stored, where the provider
  // can (weights().stored says which it gave).
  enum class Form { compute, stored };
  explicit WeightLease(ManagedLayerImpl& layer, Form form = Form::compute);
  ~WeightLease();
  WeightLease(const WeightLease&) = delete;
  WeightLease& operator=(const WeightLease&) = delete;

  const at::Tensor& weight() const { return weights_.weight; }
  const at::Tensor& bias() const { return weights_.bias; }
  const LayerWeights& weights() const { return weights_; }

 private:
  ManagedLayerImpl& layer_;
  LayerWeights weights_;
};

// y = x' W^T + b (+ LoRA sidecars on x'), x' the input after its input adapters (Note [input
// adapters]). W is [out, in]. Like EmbeddingImpl, it hands its output
// to observe_output (Note [layer output observer] in output_observer.h).
class LinearImpl : public ManagedLayerImpl {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& x);
  int64_t in_features() const { return weight_.size(1); }
  int64_t out_features() const { return weight_.size(0); }
};
TORCH_MODULE(Linear);

// Row lookup into W [num, dim].
//
// Note [embedding rows]
// ~~~~~~~~~~~~~~~~~~~~~
// A table stored in fp8 is not upcast whole for a lookup (a Qwen3-0.6B table is 297 MiB of
// bf16, a Qwen3.5-4B one 1.2 GiB): the forward leases the stored table (WeightLease::Form::
// stored), gathers the rows asked for in the storage dtype, and upcasts those rows only,
// with their rows of a per-row scale. Resident or streamed alike; a provider without a
// stored form gives the upcast table, and the lookup is then the plain one.
class EmbeddingImpl : public ManagedLayerImpl {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& ids);
};
TORCH_MODULE(Embedding);

// Every ManagedLayer of `root` with its dotted name, in registration order (which the
// models make equal to execution order).
std::vector<std::pair<std::string, ManagedLayerImpl*>> managed_layers(torch::nn::Module& root);

}  // namespace sluice::offload
