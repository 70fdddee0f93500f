#pragma once
// A scoped observer of module outputs in execution order: every ManagedLayer's output
// (after its LoRA sidecars) and the outputs that models report for their blocks. Used to
// re-run a forward with a per-layer check (Note [non-finite values] in runtime/nonfinite.h).
//
// Note [layer output observer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// libtorch's C++ modules have no forward hooks (Note [weight leases] in layer.h), so the
// layers and the models call observe_output(module, output) themselves at the points a
// Python forward hook would see: LinearImpl and EmbeddingImpl at the end of forward, the
// Anima model after each DiT block, the timestep norm, the final layer, each LLM adapter
// block and its norm. The observer is per thread (a forward runs on its caller's thread)
// and set by an ObserveOutputs scope; without one, observe_output is a thread-local read
// and nothing else: no synchronisation, no allocation, no names built. The observer gets
// the module, not its name: it maps modules to names itself (named_modules() of the model),
// only when it is there.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>

namespace sluice::offload {

using OutputObserver = std::function<void(const torch::nn::Module& module, const at::Tensor& output)>;

// Sets `observer` for forwards on this thread while alive (restoring the previous one).
class ObserveOutputs {
 public:
  explicit ObserveOutputs(OutputObserver observer);
  ~ObserveOutputs();
  ObserveOutputs(const ObserveOutputs&) = delete;
  ObserveOutputs& operator=(const ObserveOutputs&) = delete;

 private:
  OutputObserver observer_;
  const OutputObserver* previous_;
};

// Hands `output` of `module` to this thread's observer, if any. Exceptions from the
// observer propagate (they end the forward like any error in it).
void observe_output(const torch::nn::Module& module, const at::Tensor& output);

}  // namespace sluice::offload
