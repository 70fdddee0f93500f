#include "offload/layer/output_observer.h"

namespace sluice::offload {
namespace {

thread_local const OutputObserver* current = nullptr;

}  // namespace

ObserveOutputs::ObserveOutputs(OutputObserver observer) : observer_(std::move(observer)), previous_(current) {
  current = observer_ ? &observer_ : nullptr;
}

ObserveOutputs::~ObserveOutputs() { current = previous_; }

void observe_output(const torch::nn::Module& module, const at::Tensor& output) {
  if (current != nullptr) (*current)(module, output);
}

}  // namespace sluice::offload
