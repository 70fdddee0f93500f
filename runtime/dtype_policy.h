#pragma once
// Storage dtype vs compute dtype: names, validation, the one resolver, and the fp8 options
// every component reads. See Note [dtype resolution].
//
// Note [dtype resolution]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A weight has a *storage* dtype (what sits in RAM/VRAM between forwards) and a *compute*
// dtype (what a forward multiplies in). resolve_dtypes() is the only place that turns a
// request into the effective pair; its rules, in order:
//  1. compute: unset -> bfloat16 (callers resolve "auto" first with choose_compute_dtype,
//     Note [compute dtype auto]). It must be bfloat16, float16 or float32. A float8 compute
//     dtype is refused (InvalidArgument): sluice stores fp8 but never multiplies in it.
//  2. storage: unset -> float8_e4m3fn (the reference system's storage dtype). It must be one
//     of the four float8 dtypes or bfloat16/float16/float32.
//  3. A non-fp8 storage dtype means "no fp8": it is honoured as given (bf16 storage with
//     fp32 compute halves memory; fp32 storage with bf16 compute is legal, merely wasteful).
//  4. An fp8 storage dtype on a device that cannot hold it (device_supports_fp8_storage)
//     falls back to storage = compute, with one warning per resolve_dtypes call.
// The *fnuz variants are the ROCm encodings; sluice only stores them and upcasts them with
// its own decode, so they are accepted on every device that passes the storage probe.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sluice {

// The effective dtypes of stored weights, as resolve_dtypes() decided them.
struct DtypePair {
  at::ScalarType storage = at::kBFloat16;
  at::ScalarType compute = at::kBFloat16;
  bool fp8() const;  // storage is one of the four float8 dtypes
};

// True for float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz.
bool is_fp8(at::ScalarType t);

// Largest finite value of an fp8 dtype (448, 57344, 240, 57344); throws InvalidArgument
// for a non-fp8 dtype.
double fp8_max_finite(at::ScalarType fp8);

// Canonical name as torch prints it without the "torch." prefix ("float8_e4m3fn", "bfloat16").
std::string dtype_name(at::ScalarType t);

// Parses a storage dtype: the four float8 names ("fp8" = float8_e4m3fn, "e4m3fn", "e5m2",
// "fp8_e5m2", ... accepted), or "bfloat16"/"bf16", "float16"/"fp16"/"half",
// "float32"/"fp32"/"float". Case-insensitive; an optional "torch." prefix is ignored.
// Throws InvalidArgument naming the bad value and listing the valid ones.
at::ScalarType parse_storage_dtype(std::string_view name);

// Parses a compute dtype ("bfloat16", "float16", "float32" and their aliases). A float8
// name is refused with an InvalidArgument saying fp8 is storage-only.
at::ScalarType parse_compute_dtype(std::string_view name);

// Throw InvalidArgument naming the dtype when it is not a valid storage / compute dtype.
void check_storage_dtype(at::ScalarType t);
void check_compute_dtype(at::ScalarType t);

// Note [compute dtype auto]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A compute request is "auto" or a dtype name; an explicit dtype always wins. "auto"
// picks, for the device that computes (runtime/hardware.h, Note [native bf16]):
//  1. bfloat16 where the device computes bf16 matrix products natively (AVX-512 CPUs with
//     torch's oneDNN on, Ampere and later GPUs, ROCm);
//  2. otherwise float16 where the device computes it natively AND the model declares fp16
//     fit for its activations (a model is fit only where its fp16 error against fp32 was
//     measured; Anima's verdict and numbers: models/anima/config.h, anima::fp16_verdict);
//  3. otherwise float32, which holds every model's range and is fast everywhere (on an
//     AVX2-only CPU torch's bf16 matmul is ~100x slower than fp32).
// The choice and its reason are logged once per load, shown on `sluice run`'s header line
// and in the model's stats JSON ("model.compute").
struct ComputeChoice {
  at::ScalarType dtype = at::kBFloat16;
  bool automatic = false;  // chosen by "auto"
  std::string reason;      // "auto: float32, because ..." or "requested"
};

// A model's answer to "may auto compute it in fp16?": fit, or the reason it is not.
struct Fp16Verdict {
  bool fit = false;
  std::string note;  // why (fit: the measured error; unfit: what goes wrong)
};

// Resolves a compute request ("auto", "bfloat16", "float16", "float32" and aliases) for
// `device` and a model's fp16 verdict. Throws InvalidArgument for a bad name.
ComputeChoice choose_compute_dtype(std::string_view request, at::Device device, const Fp16Verdict& model_fp16);

// The resolver. `device` is the compute device, where stored bytes are upcast. See
// Note [dtype resolution] for the rules.
DtypePair resolve_dtypes(std::optional<at::ScalarType> storage, std::optional<at::ScalarType> compute,
                         at::Device device);

// Whether `device` can hold `fp8` bytes and upcast them exactly. CPU and CUDA (ROCm builds
// report "cuda" too) are known to; any other backend is probed once by doing what the
// runtime does. See Note [fp8 storage probe].
//
// Note [fp8 storage probe]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The probe casts every non-NaN byte pattern of `fp8` on the host, copies the tensor to the
// device, upcasts it there to bfloat16 and float16 with sluice::upcast, copies back and
// compares bitwise with the host tables. A success is cached per (device type, index, fp8
// dtype); a failure (wrong values or any exception) is not cached, so a backend that comes
// up later is probed again, and each failure logs one warning.
bool device_supports_fp8_storage(at::Device device, at::ScalarType fp8 = at::kFloat8_e4m3fn);

namespace detail {

// The probe itself, callable on any device (tests run it on CPU and on meta).
bool probe_fp8_storage(at::Device device, at::ScalarType fp8);

// Counters of device_supports_fp8_storage() calls that reached the probe/cache stage.
struct Fp8ProbeStats {
  int64_t probes = 0;      // probe runs
  int64_t cache_hits = 0;  // answered from the success cache
  int64_t failures = 0;    // probes that returned false (one warning each)
};
Fp8ProbeStats fp8_probe_stats();
// Clears the success cache and the counters.
void reset_fp8_probe_cache();

using Fp8ProbeFn = std::function<bool(at::Device, at::ScalarType)>;
// Replaces the probe used by device_supports_fp8_storage() until destroyed (tests inject a
// fake backend). Not thread-safe against concurrent probing; tests only.
class ScopedFp8ProbeOverride {
 public:
  explicit ScopedFp8ProbeOverride(Fp8ProbeFn fn);
  ~ScopedFp8ProbeOverride();
  ScopedFp8ProbeOverride(const ScopedFp8ProbeOverride&) = delete;
  ScopedFp8ProbeOverride& operator=(const ScopedFp8ProbeOverride&) = delete;

 private:
  Fp8ProbeFn previous_;
};

}  // namespace detail

// What to do with finite values beyond the fp8 dtype's largest finite value.
// See Note [fp8 out-of-range values] in runtime/fp8.h.
enum class OutOfRangePolicy {
  saturate,  // clamp to +-max finite, one warning naming the tensor and the count
  refuse,    // throw InvalidArgument naming the tensor
};

// Optional dequantization scale stored next to an fp8 tensor.
enum class ScaleMode {
  none,         // plain cast
  per_tensor,   // one fp32 scale = amax / max_finite
  per_channel,  // one fp32 scale per output channel (row 0 of dim 0)
};

OutOfRangePolicy parse_out_of_range_policy(std::string_view name);  // "saturate" | "refuse"
ScaleMode parse_scale_mode(std::string_view name);  // "none" | "per_tensor" | "per_channel"
std::string to_string(OutOfRangePolicy p);
std::string to_string(ScaleMode m);

// Everything a model load needs to decide how weights are stored.
struct Fp8Options {
  at::ScalarType storage = at::kFloat8_e4m3fn;  // storage dtype; bf16/fp16/fp32 mean "no fp8"
  at::ScalarType compute = at::kBFloat16;       // dtype forwards compute in
  std::vector<std::string> extra_skip_patterns;  // user patterns kept in compute dtype
  bool use_default_skips = true;                 // include default_skip_patterns()
  bool use_model_skips = true;                   // include the model's declared patterns
  OutOfRangePolicy out_of_range = OutOfRangePolicy::saturate;  // |w| > max finite
  ScaleMode scale_mode = ScaleMode::none;        // scaled fp8 storage (opt-in)
};

}  // namespace sluice
