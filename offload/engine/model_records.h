#pragma once
// ModelRecords: what a streaming engine knows about the tensors of the model it holds, read
// once at attach: one LayerRecord (layer_record.h) per managed layer, in execution order,
// with its host copies, its device copies while resident and the layout a staging slot and
// the upcast scratch need; and the model's other parameters and buffers (norms, RoPE
// tables), which always live on the device while the model is attached ("extras").
// It reads the model and points its tensors at device or host copies; which layers are
// resident is decided elsewhere (model_residency.h), and so is the budget every device
// byte is charged to.
//
// Note [attached model on the host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A model is attached from RAM: every managed layer's stored tensors, and every other
// parameter and buffer, must be on the host (attach refuses the model otherwise, naming
// the tensor), and no layer may already have a weight provider (it would be attached to
// two engines). The host copies are aliased, not copied (contiguous ones as they are), and
// kept for as long as the model is attached: giving the model back (restore_to_host) only
// re-points its tensors at them, so nothing is ever copied device->host. (Where pinning
// replaced a streamed layer's host copy by a page-locked one, Note [residency applier],
// that copy is the one the layer gets back: same values, pinned memory.)
#include <torch/nn/module.h>

#include <cstdint>
#include <regex>
#include <string>
#include <unordered_map>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/engine_options.h"
#include "offload/layer/layer.h"
#include "offload/engine/layer_record.h"
#include "offload/plan/residency_plan.h"

namespace sluice::offload {

// The compiled EngineOptions::required_patterns; InvalidArgument naming a bad one.
std::vector<std::regex> required_regexes(const EngineOptions& options);

class ModelRecords {
 public:
  // A parameter or buffer outside the managed layers.
  struct Extra {
    at::Tensor handle;  // the module's tensor (same impl), re-pointed in place (repoint.h)
    at::Tensor host;
    at::Tensor dev;
  };

  // InvalidArgument, naming the layer, when `model` cannot be attached: a managed layer off
  // the host or with a weight provider already. Reads only.
  static void check_attachable(torch::nn::Module& model, const std::string& model_name);
  // Fills the (empty) records from `model` (reads only). `check_host`: refuse tensors that are not
  // on the host (attach; sizing reads a model wherever it is). A layer is required when it
  // is an embedding, matches `required`, or (require_unconverted) is stored unconverted.
  void collect(torch::nn::Module& model, const std::string& model_name, const std::vector<std::regex>& required,
               bool require_unconverted, bool check_host);
  // Allocates the extras on the device under `budget` (MemoryKind::params), copies them,
  // waits for the copies and points the model at them. A failed copy throws here; a failed
  // allocation leaves the copies made so far to restore_to_host(), whose frees wait for them.
  void place_extras(DeviceBackend& device, const std::shared_ptr<MemoryLedger>& budget);
  // Points every layer and extra back at its host copy, drops the device copies and the
  // layers' provider. Never throws: a failure is logged per tensor.
  void restore_to_host() noexcept;
  void clear() noexcept;

  size_t size() const { return layers_.size(); }
  std::vector<LayerRecord>& layers() { return layers_; }
  const std::vector<LayerRecord>& layers() const { return layers_; }
  LayerRecord& at(int64_t id) { return layers_[static_cast<size_t>(id)]; }
  const LayerRecord& at(int64_t id) const { return layers_[static_cast<size_t>(id)]; }
  // The index of `layer` in layers(), -1 when it is not one of them.
  int64_t find(const ManagedLayerImpl* layer) const;
  const std::vector<Extra>& extras() const { return extras_; }
  uint64_t extra_bytes() const { return extra_bytes_; }
  // The largest upcast output of any layer: the planned scratch buffer.
  uint64_t scratch_bytes() const { return scratch_bytes_; }
  // Stored bytes of every layer and extra: the model's host copy.
  uint64_t stored_bytes() const;
  // The layers as the residency planner sees them.
  std::vector<PlanLayer> plan_layers() const;

 private:
  std::vector<LayerRecord> layers_;
  std::unordered_map<const ManagedLayerImpl*, int64_t> index_;
  std::vector<Extra> extras_;
  uint64_t extra_bytes_ = 0;
  uint64_t scratch_bytes_ = 0;
};

}  // namespace sluice::offload
