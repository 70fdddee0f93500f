#pragma once
// sluice::OffloadedModel: sluice's streaming engine behind a torch model someone else wrote
// (issue 31). The host hands over the model's weighted layers by name (Linear layers,
// embeddings, convolutions: their weights are stored in sluice's host storage, in the
// storage dtype) and its other parameters and buffers (moved to the device and back in
// place); its own forward then calls linear(), embedding() or call() for each of those
// layers, between begin_forward() and end_forward(). Python's `sluice.offload(module)` is
// built on it (README, "Offloading a torch model you already have").
//
// The model lives in a ModelCache: one the host gives, beside the cache's other models
// (several offloaded modules of one frontend, its text encoder and its transformer, share
// the cache's device budget: a module's forward gets its share first, taken from unlocked
// models as for any lock), or one of its own made from the options' device and budget.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sluice/stats.hpp"  // SLUICE_DECLARE_OPTION (Note [field lists])

namespace sluice {

namespace detail {
struct OffloadState;
}

// What a layer of the host's model is, and so how its forward reaches its weights.
enum class OffloadLayerKind {
  linear,     // linear(): y = x W^T + b
  embedding,  // embedding(): rows of W [num, dim] (no bias)
  other,      // call(): the host computes with the leased weights (a convolution)
};

// One layer of the host's model.
struct OffloadLayer {
  std::string name;                // dotted name in the model
  at::Tensor weight;               // on the host: [out, in], [num, dim], or any shape with out first
  std::optional<at::Tensor> bias;  // [out]
  OffloadLayerKind kind = OffloadLayerKind::linear;
  // The dtype the layer computes in; empty: OffloadOptions::compute. A layer the skip list
  // keeps in its own dtype computes in that dtype whatever is named here.
  std::string compute{};
};

// Two field lists (Note [field lists] in sluice/stats.hpp): the model's fields, and its
// own cache's, which are named as the RuntimeOptions fields they become.
#define SLUICE_OFFLOAD_MODEL_FIELDS(F)                                                                        \
  F(std::string, name, "")                   /* in logs and stats; empty: "offloaded model" */               \
  F(std::string, storage, "float8_e4m3fn")   /* the layers' storage dtype (bfloat16/float16/float32: no fp8) */ \
  F(std::string, compute, "bfloat16")        /* what linear() takes and returns, for layers naming none */   \
  F(std::vector<std::string>, skip, {})      /* layer patterns kept in their own dtype */                    \
  F(std::optional<double>, max_resident, {}) /* cap on resident streamable bytes, 0..1 */
// Its own cache's (the constructor without a ModelCache). With a ModelCache these are the
// cache's: giving one of them other than its default is an InvalidArgument naming it.
#define SLUICE_OFFLOAD_CACHE_FIELDS(F)                                                                        \
  F(std::string, device, "cpu")              /* "cpu", "cuda", "cuda:1", ... (as RuntimeOptions::device) */  \
  F(std::string, vram_budget, "")            /* "6GiB", "50%", "" = all device memory */                     \
  F(std::string, working_memory, "256MiB")   /* part of the budget kept for activations */                   \
  F(std::string, pin_memory, "auto")         /* auto | on | off */                                           \
  F(std::string, prefetch, "auto")           /* most streamed layers copied ahead: "auto" or "0".."65536" */ \
  F(bool, trace, false)                      /* record per-layer spans for write_trace / write_timeline_svg */
struct OffloadOptions {
  SLUICE_OFFLOAD_MODEL_FIELDS(SLUICE_DECLARE_OPTION)
  SLUICE_OFFLOAD_CACHE_FIELDS(SLUICE_DECLARE_OPTION)
};

class ModelCache;

class OffloadedModel {
 public:
  // Stores the layers and attaches the model to the device under the budget. Throws
  // InvalidArgument naming a bad option, layer or tensor, ResourceError naming the minimum
  // budget when it is too small.
  OffloadedModel(std::vector<OffloadLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                 const OffloadOptions& options);
  // The same inside `cache`, under its budget beside its other models; the cache lives
  // as long as this model does.
  OffloadedModel(std::vector<OffloadLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                 ModelCache& cache, const OffloadOptions& options);
  // A model built a layer at a time (so that the host can free each original before it
  // hands over the next): add_layer() each, then finish() with the extras, which attaches
  // it as the constructors above do. Nothing but add_layer, layers, stored_dtype, finish and
  // remove may be called before finish().
  explicit OffloadedModel(const OffloadOptions& options);
  OffloadedModel(ModelCache& cache, const OffloadOptions& options);
  // Stores one layer (cast to its storage dtype into sluice's own host memory: the caller's
  // tensors are not kept); returns its index. InvalidArgument naming the layer, as the
  // constructors; after one, the model is as before the call.
  int64_t add_layer(OffloadLayer layer);
  void finish(std::vector<std::pair<std::string, at::Tensor>> extras);
  ~OffloadedModel();
  OffloadedModel(const OffloadedModel&) = delete;
  OffloadedModel& operator=(const OffloadedModel&) = delete;

  size_t layers() const;
  // The dtype layer i is stored in: the storage dtype, or the weight's own for a layer the
  // skip list names (or already fp8).
  at::ScalarType stored_dtype(int64_t i) const;
  // Copies of layer i's stored weight and bias, on the host, after remove() (a host that
  // freed its own tensors gives them back from these where stored_dtype is theirs);
  // InvalidArgument before.
  std::pair<at::Tensor, std::optional<at::Tensor>> stored_layer(int64_t i) const;
  // Frees layer i's stored tensors after remove() (a host that took a layer back frees
  // sluice's copy before it takes the next: its host memory peaks one layer above the
  // model, not twice it). The layer has no tensors afterwards.
  void release_layer(int64_t i);
  // y = x W^T + b for layer i (x in the compute dtype, on the device), computed without
  // autograd (inference only). Outside begin_forward/end_forward it is a forward of its
  // own. InvalidArgument after remove().
  at::Tensor linear(int64_t i, const at::Tensor& x);
  // Rows `ids` (int32/int64) of embedding i, in the compute dtype; as linear() otherwise.
  at::Tensor embedding(int64_t i, const at::Tensor& ids);
  // fn(weight, bias) with layer i's weights leased in the compute dtype on the device for
  // the call (bias undefined when the layer has none): how a host computes a layer of its
  // own kind. fn's result is returned; the weights must not outlive the call. As linear()
  // otherwise.
  using LayerFn = std::function<at::Tensor(const at::Tensor& weight, const at::Tensor& bias)>;
  at::Tensor call(int64_t i, const LayerFn& fn);
  // One forward of the model, for the stats and the recorded layer order; end_forward
  // with `aborted` when it left by an exception. The outermost pair locks the model in its
  // cache (its device share first: ResourceError when models in use hold the budget) and
  // holds the engine; pairs inside it nest. One thread at a time: a forward of the same
  // model from another thread waits in begin_forward for the first to end.
  void begin_forward(const std::string& kind = "");
  void end_forward(bool aborted = false);
  // The stats as JSON: `sluice run --stats-json`'s document of one model (its forwards,
  // residency, transfers, budget share, and the cache's counters).
  std::string stats_json(int indent = 2) const;
  // The per-layer trace (Chrome trace JSON) and the SVG timeline of one forward, as
  // Model::write_trace and write_timeline_svg: InvalidArgument when tracing is off.
  void write_trace(const std::string& path) const;
  void write_timeline_svg(const std::string& path) const;
  // A new budget ("6GiB", "50%") for its own cache; ResourceError when too small.
  // InvalidArgument for a model in a ModelCache the host gave (set the cache's budget).
  void set_vram_budget(const std::string& budget);
  // Takes the model out of its cache: the extras back on the host, where they were, and
  // the device memory freed. InvalidArgument when already removed or during a forward.
  void remove();
  bool removed() const;

 private:
  void require_finished() const;  // InvalidArgument before finish()
  void require_attached() const;  // InvalidArgument after remove() or before finish()
  // fn(layer i's index) inside this thread's forward, or inside one of its own (kind
  // "layer") when none runs; InvalidArgument for a negative i.
  at::Tensor in_forward(int64_t i, const std::function<at::Tensor(size_t)>& fn);
  void begin(const OffloadOptions& options);  // the empty model, its options checked
  std::unique_ptr<detail::OffloadState> state_;
};

}  // namespace sluice
