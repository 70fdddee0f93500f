#pragma once
// Finding NaN and Inf in a tensor, and naming them in one line. See Note [non-finite values].
//
// Note [non-finite values]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A NaN or Inf is reported where it enters or first appears, never silently carried:
//  - Inputs. LockedModel::forward (x, timesteps, context) and encode_text (qwen_hidden,
//    t5_weights) refuse non-finite inputs with an InvalidArgument naming the input, the
//    count and the first position: "forward: input 'x' has 3 non-finite values (first at
//    [0, 2, 0, 5, 7]: nan)". `sluice forward` and `sluice run --context` check their files
//    the same way before anything is converted. The check is one all-finite reduction per
//    input and one host read of all of them together: free for host tensors, one wait
//    for the stream for device tensors.
//  - Outputs. A forward itself never checks its output: that would be a host wait per
//    forward, and the host runs ahead of the device on a GPU. Its caller checks what it
//    uses (sluice run: each velocity, on the host copy the sampler makes anyway, and the
//    latent after each step; sluice forward: its outputs), so the normal path costs at
//    most one all-finite check per forward's output. Only when that check fails is the
//    same forward run again with a per-layer check (LockedModel::locate_nonfinite, Note
//    [layer output observer] in offload/layer/output_observer.h): a host wait after every
//    managed layer and block, to name the first module whose output went non-finite. The
//    re-run is an ordinary forward of its kind otherwise (stats, prefetch, residency), and
//    the model's stats JSON keeps its finding under "nonfinite".
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace sluice {

// Where a tensor's non-finite values are.
struct NonFiniteValues {
  int64_t count = 0;                // NaN, Inf and -Inf elements
  int64_t numel = 0;                // elements of the tensor
  std::vector<int64_t> first_index; // the first one, in row-major order
  double first_value = 0;           // its value (NaN, Inf or -Inf)
};

// True when every element is finite (integer and bool tensors always are). One reduction
// and one host read (a wait for the device's stream when `t` is on a device).
bool all_finite(const at::Tensor& t);

// True when every element of every defined tensor is finite, with one host read for all of
// them when they are on one device.
bool all_finite(const std::vector<at::Tensor>& tensors);

// Nothing when `t` is all finite (one all_finite()); otherwise the count and the first
// non-finite element.
std::optional<NonFiniteValues> find_nonfinite(const at::Tensor& t);

// "3 non-finite values (first at [0, 2, 0, 5, 7]: nan)": for "input 'x' has ...".
std::string describe(const NonFiniteValues& v);

// Throws InvalidArgument "<what> has 3 non-finite values (first at [...]: nan)" when `t`
// holds any; `what` names the tensor ("forward: input 'x'").
void require_finite(const at::Tensor& t, const std::string& what);

}  // namespace sluice
