#pragma once
// Conversions between storage and compute dtypes: the storage cast (with its out-of-range
// policy and optional scales) and the upcast every forward runs. This header is the one
// entry point the layers and the streaming engine use.
//
// Note [fp8 out-of-range values]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's fp8 casts do not saturate: e4m3fn turns |w| >= 480 into NaN, the fnuz types do
// the same beyond their range, and e5m2 makes inf. sluice never stores a non-finite value
// it was not given:
//  - Finite values beyond +-max finite are saturated to +-max finite (default). Saturation is
//    what the value would be closest to, and one outlier should not cost a whole model load;
//    one warning names the tensor and the count of clipped values so it is never silent.
//    With OutOfRangePolicy::refuse the cast throws InvalidArgument naming the tensor instead.
//  - NaN or inf already in the input is always refused (InvalidArgument naming the tensor):
//    it is a broken checkpoint, and storing it would poison every forward.
// "Clipped" counts values with |w| > max finite. Values in (max, midpoint to the next power)
// would round to max anyway; they are counted too, because the plain cast is not trusted
// near the edge (e4m3fn rounds [464, 480) up into its NaN pattern).
//
// Note [fp8 upcast paths]
// ~~~~~~~~~~~~~~~~~~~~~~~
// upcast()/upcast_into() pick, for fp8 storage:
//  - CPU: 256-entry tables built once per fp8 dtype (fp8_tables()), a plain gather into the
//    output, split over threads with at::parallel_for for large tensors. Scaled storage
//    multiplies the table's float by the row's scale and rounds to nearest even, exactly
//    like ATen's (stored.to(float) * scale).to(compute).
//  - A device with a registered kernel (CUDA, once offload::register_cuda_kernels() ran):
//    that kernel, on the current stream. runtime/ never links CUDA code; offload/ plugs the
//    kernel in through register_device_upcast().
//  - Anything else: ATen's .to(), with the scale applied in fp32.
// Non-fp8 storage always takes the ATen path (it is a plain dtype conversion).
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "runtime/dtype_policy.h"

namespace sluice {

// The result of casting one tensor to its storage dtype.
struct StorageCast {
  at::Tensor stored;    // storage dtype, same device and shape as the input
  at::Tensor scale;     // fp32 [] or [out] dequantization scale; undefined when unscaled
  int64_t clipped = 0;  // values saturated to +-max finite (see Note [fp8 out-of-range values])
};

// Casts `w` to `storage`. Refuses NaN/inf for every storage dtype and applies
// options.out_of_range to finite values beyond the storage dtype's largest finite value
// (fp8; float16's 65504; bfloat16's from float32). For an fp8 storage dtype with
// options.scale_mode != none it also returns the fp32 scale (amax / max finite; 1 for an
// all-zero tensor or row) with stored = cast(w / scale). Scales apply only to tensors of 2
// or more dims (weights); 1-d tensors (biases) are cast unscaled, because layers upcast
// biases without a scale. A non-fp8 storage dtype is otherwise a plain .to(); an fp8 input
// there is checked on its bytes (its upcast is exact). `name` is used in messages only.
// options.storage/compute are not consulted.
StorageCast cast_to_storage(const at::Tensor& w, at::ScalarType storage, const std::string& name,
                            const Fp8Options& options = {});

// The pieces of cast_to_storage that other casts (runtime/fused_read.h) share, so that
// every path refuses, warns and scales alike:
// NaN and Inf among `n` fp8 bytes of dtype `fp8` (e4m3fn: NaN is S.1111.111, no Inf; e5m2:
// Inf S.11111.00, NaN S.11111.xx; the fnuz types: NaN is 0x80 only).
struct Fp8NonFinite {
  int64_t nans = 0;
  int64_t infs = 0;
};
Fp8NonFinite count_fp8_non_finite(at::ScalarType fp8, const uint8_t* bytes, int64_t n);
// NaN and Inf among `n` elements of dtype `t` at `bytes`: any fp8 dtype, bfloat16, float16
// or float32 (InvalidArgument for another dtype). A vectorized scan (runtime/fp8_kernels.h);
// the elements are told apart one by one only when it finds any.
Fp8NonFinite count_non_finite(at::ScalarType t, const void* bytes, int64_t n);
// Throws InvalidArgument naming `name`, the counts and `storage` when nans + infs > 0:
// "<where>: tensor 'w' holds 1 NaN and 0 inf values; refusing to store it as bfloat16"
// (`where` names the file, "file 'x.safetensors'"; empty: "cast_to_storage").
void refuse_non_finite(const std::string& name, int64_t nans, int64_t infs, at::ScalarType storage,
                       const std::string& where = {});
// The largest finite value of a storage dtype: fp8_max_finite for fp8, 65504 for float16,
// bfloat16's 3.3895e38, float32's FLT_MAX; InvalidArgument for another dtype.
double storage_max_finite(at::ScalarType storage);
// `clipped` of `numel` values beyond +-storage_max_finite(storage) (largest |w| `amax`):
// throws InvalidArgument under OutOfRangePolicy::refuse, else logs the one saturation warning.
void report_out_of_range(const std::string& name, int64_t clipped, int64_t numel, double amax, at::ScalarType storage,
                         OutOfRangePolicy policy);
// The per-tensor scale of a tensor whose largest |w| is `amax`: amax / max finite in
// double, then fp32; 1 for an all-zero tensor; at least FLT_MIN.
float fp8_tensor_scale(double amax, at::ScalarType fp8);

// Returns `stored` as `compute` dtype on the same device, multiplied by `scale` when it
// is defined (per tensor [] / [1], or per output channel [size(0)]). Returns `stored`
// itself, not a copy, when no conversion is needed. A float8 `compute` throws
// InvalidArgument. See Note [fp8 upcast paths].
at::Tensor upcast(const at::Tensor& stored, at::ScalarType compute, const at::Tensor& scale);

// As upcast(), into a preallocated `out` (the streaming engine reuses scratch buffers):
// `out` must be contiguous, on stored's device, with stored's number of elements, in a
// compute dtype (bfloat16, float16, float32). Throws InvalidArgument otherwise.
void upcast_into(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out);
// upcast_into()'s path on a device without a kernel (and for non-fp8 storage), callable
// directly so that tests can run it on the CPU: ATen's copy_ into `out`, then the scale
// multiplied in place, bit-identical to upcast() and allocating nothing of out's size
// where ATen casts on the fly (GPUs). Arguments as upcast_into(), unchecked.
void aten_upcast_into(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out);

// Exact conversion tables of one fp8 dtype, indexed by the fp8 byte. Built once.
struct Fp8Tables {
  uint16_t bf16[256];  // bfloat16 bit patterns
  uint16_t f16[256];   // float16 bit patterns
  float f32[256];
};
// Throws InvalidArgument for a non-fp8 dtype.
const Fp8Tables& fp8_tables(at::ScalarType fp8);

// A device kernel for the fp8 upcast. Called with: stored fp8 and contiguous; scale
// undefined or fp32, contiguous, numel 1 or stored.size(0), on stored's device; out
// contiguous, same numel and device. Returns false when it does not handle the combination
// (the caller then takes the ATen path). Throws on launch errors.
using DeviceUpcastFn = bool (*)(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out);

// Installs (or, with nullptr, removes) the upcast kernel for one device type.
void register_device_upcast(c10::DeviceType type, DeviceUpcastFn fn);
// The kernel registered for `type`, or nullptr.
DeviceUpcastFn device_upcast(c10::DeviceType type);

}  // namespace sluice
