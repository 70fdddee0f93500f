#pragma once
// Re-pointing a module's tensor (a parameter or buffer handle) at other memory, in place,
// so that the module keeps the same tensor object: how a layer's weight moves between its
// host copy and device memory.
#include <ATen/ATen.h>

namespace sluice::offload {

// Note [re-pointing across devices]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Tensor::set_data refuses data whose dispatch keys it does not count as dense
// (TensorImpl::has_compatible_shallow_copy_type lists CPU, CUDA, HIP, MPS, XPU, HPU and MTIA):
// a CPU parameter cannot be re-pointed at an out-of-tree (PrivateUse1) backend's memory,
// where torch.nn.Module.to() in Python makes a new Parameter instead. sluice's handles must
// stay the same objects, so for such a pair it does what set_data does after that check:
// a shallow copy of the tensor's metadata (storage, sizes, dtype, device, keys). sluice's
// parameters never require grad, so set_data's autograd bookkeeping has nothing to do.
inline void repoint(const at::Tensor& handle, const at::Tensor& data) {
  if (at::_has_compatible_shallow_copy_type(handle, data)) {
    const_cast<at::Tensor&>(handle).set_data(data);
  } else {
    TORCH_CHECK(!handle.requires_grad(), "repoint: a tensor that requires grad cannot move to ", data.device());
    handle.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
  }
}

}  // namespace sluice::offload
