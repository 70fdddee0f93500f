#pragma once
// sluice::OffloadedModel: sluice's streaming engine behind a torch model someone else wrote
// (issue 31). The host hands over the model's Linear layers by name (their weights are
// stored in sluice's host storage, in the storage dtype) and its other parameters and
// buffers (moved to the device and back in place); its own forward then calls linear()
// for each of those layers, between begin_forward() and end_forward(). Python's
// `sluice.offload(module)` is built on it (python/sluice/__init__.py).
//
// Today: one model per OffloadedModel, on its own budget (not yet inside a ModelCache).
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sluice {

namespace detail {
struct OffloadState;
}

// One Linear layer of the host's model.
struct OffloadLayer {
  std::string name;                // dotted name in the model
  at::Tensor weight;               // [out, in] on the host
  std::optional<at::Tensor> bias;  // [out]
};

struct OffloadOptions {
  std::string device = "cpu";              // "cpu", "cuda", "cuda:1", ... (as RuntimeOptions::device)
  std::string vram_budget;                 // "6GiB", "50%", "" = all device memory
  std::string working_memory = "256MiB";   // part of the budget kept for activations
  std::string storage = "float8_e4m3fn";   // the layers' storage dtype (bfloat16/float16/float32: no fp8)
  std::string compute = "bfloat16";        // the dtype linear() takes and returns
  std::vector<std::string> skip;           // layer patterns kept in their own dtype
  std::optional<double> max_resident;      // cap on resident streamable bytes, 0..1
  std::string pin_memory = "auto";         // auto | on | off
};

class OffloadedModel {
 public:
  // Stores the layers and attaches the model to the device under the budget. Throws
  // InvalidArgument naming a bad option, layer or tensor, ResourceError naming the minimum
  // budget when it is too small.
  OffloadedModel(std::vector<OffloadLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                 const OffloadOptions& options);
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
  // y = x W^T + b for layer i (x in the compute dtype, on the device), computed without
  // autograd (inference only). InvalidArgument after remove().
  at::Tensor linear(int64_t i, const at::Tensor& x);
  // One forward of the model, for the stats and the recorded layer order; end_forward
  // with `aborted` when it left by an exception.
  void begin_forward(const std::string& kind = "");
  void end_forward(bool aborted = false);
  // The engine's stats as JSON (the fields of `sluice run --stats-json`'s model section).
  std::string stats_json(int indent = 2) const;
  // A new budget ("6GiB", "50%"); ResourceError when too small.
  void set_vram_budget(const std::string& budget);
  // Gives the extras back on the host, where they were, and frees the device memory.
  // InvalidArgument when already removed.
  void remove();
  bool removed() const;

 private:
  void require_attached() const;  // InvalidArgument after remove()
  std::unique_ptr<detail::OffloadState> state_;
};

}  // namespace sluice
