#include "runtime/dtype_policy.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/hardware.h"
#include "runtime/logging.h"

namespace sluice {
namespace {

struct NamedDtype {
  const char* name;
  at::ScalarType type;
};

// Canonical names first, then aliases; lookups are on the lower-cased name.
constexpr NamedDtype kDtypeNames[] = {
    {"float8_e4m3fn", at::kFloat8_e4m3fn},
    {"float8_e5m2", at::kFloat8_e5m2},
    {"float8_e4m3fnuz", at::kFloat8_e4m3fnuz},
    {"float8_e5m2fnuz", at::kFloat8_e5m2fnuz},
    {"bfloat16", at::kBFloat16},
    {"float16", at::kHalf},
    {"float32", at::kFloat},
    {"fp8", at::kFloat8_e4m3fn},
    {"e4m3fn", at::kFloat8_e4m3fn},
    {"fp8_e4m3fn", at::kFloat8_e4m3fn},
    {"e5m2", at::kFloat8_e5m2},
    {"fp8_e5m2", at::kFloat8_e5m2},
    {"e4m3fnuz", at::kFloat8_e4m3fnuz},
    {"fp8_e4m3fnuz", at::kFloat8_e4m3fnuz},
    {"e5m2fnuz", at::kFloat8_e5m2fnuz},
    {"fp8_e5m2fnuz", at::kFloat8_e5m2fnuz},
    {"bf16", at::kBFloat16},
    {"fp16", at::kHalf},
    {"half", at::kHalf},
    {"fp32", at::kFloat},
    {"float", at::kFloat},
};

constexpr const char* kValidStorage =
    "float8_e4m3fn (fp8), float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, bfloat16 (bf16), float16 (fp16), float32 (fp32)";
constexpr const char* kValidCompute = "bfloat16 (bf16), float16 (fp16), float32 (fp32)";

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::optional<at::ScalarType> lookup(std::string_view name) {
  std::string key = lower(name);
  if (key.rfind("torch.", 0) == 0) key = key.substr(6);
  for (const auto& entry : kDtypeNames) {
    if (key == entry.name) return entry.type;
  }
  return std::nullopt;
}

bool is_compute(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }

// ---- probe cache ----------------------------------------------------------------------

struct ProbeState {
  std::mutex mu;
  std::set<std::tuple<int, int, int>> ok;  // (device type, index, fp8 dtype)
  detail::Fp8ProbeStats stats;
  detail::Fp8ProbeFn override_fn;
};

ProbeState& probe_state() {
  static ProbeState s;
  return s;
}

// Tensor of every byte pattern of `fp8` whose value is not NaN, as host fp8 values.
std::vector<uint8_t> non_nan_bytes(at::ScalarType fp8) {
  const Fp8Tables& tab = fp8_tables(fp8);
  std::vector<uint8_t> bytes;
  for (int b = 0; b < 256; ++b) {
    if (!std::isnan(tab.f32[b])) bytes.push_back(static_cast<uint8_t>(b));
  }
  return bytes;
}

bool probe_impl(at::Device device, at::ScalarType fp8, std::string* why) {
  const Fp8Tables& tab = fp8_tables(fp8);
  std::vector<uint8_t> bytes = non_nan_bytes(fp8);
  const auto n = static_cast<int64_t>(bytes.size());
  std::vector<float> values(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) values[i] = tab.f32[bytes[i]];

  at::NoGradGuard no_grad;
  // What a model load does: cast on the host...
  const at::Tensor host = at::from_blob(values.data(), {n}, at::kFloat).to(fp8);
  const at::Tensor host_bytes = host.view(at::kByte);
  if (std::memcmp(host_bytes.data_ptr(), bytes.data(), bytes.size()) != 0) {
    if (why) *why = "the host cast to " + dtype_name(fp8) + " is not exact";
    return false;
  }
  // ...copy the stored bytes to the device, upcast there, and read the result back.
  const at::Tensor on_device = host.to(device);
  for (at::ScalarType compute : {at::kBFloat16, at::kHalf}) {
    const at::Tensor back = upcast(on_device, compute, at::Tensor()).to(at::kCPU).contiguous();
    const uint16_t* expect = compute == at::kBFloat16 ? tab.bf16 : tab.f16;
    const auto* got = static_cast<const uint16_t*>(back.data_ptr());
    if (back.scalar_type() != compute || back.numel() != n) {
      if (why) *why = "upcast to " + dtype_name(compute) + " returned the wrong dtype or size";
      return false;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (got[i] != expect[bytes[static_cast<size_t>(i)]]) {
        if (why) {
          *why = c10::str("upcast of byte 0x", std::hex, int{bytes[static_cast<size_t>(i)]}, " to ",
                          dtype_name(compute), " gave bits 0x", got[i], ", expected 0x",
                          expect[bytes[static_cast<size_t>(i)]]);
        }
        return false;
      }
    }
  }
  return true;
}

}  // namespace

bool DtypePair::fp8() const { return is_fp8(storage); }

bool is_fp8(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kFloat8_e4m3fnuz || t == at::kFloat8_e5m2fnuz;
}

double fp8_max_finite(at::ScalarType fp8) {
  switch (fp8) {
    case at::kFloat8_e4m3fn: return 448.0;
    case at::kFloat8_e5m2: return 57344.0;
    case at::kFloat8_e4m3fnuz: return 240.0;
    case at::kFloat8_e5m2fnuz: return 57344.0;
    default: throw InvalidArgument("fp8_max_finite: " + dtype_name(fp8) + " is not a float8 dtype");
  }
}

std::string dtype_name(at::ScalarType t) {
  for (const auto& entry : kDtypeNames) {
    if (entry.type == t) return entry.name;  // canonical names come first
  }
  switch (t) {  // torch's names ("torch.int8"), where c10's differ ("Char")
    case at::kDouble: return "float64";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return lower(c10::toString(t));
  }
}

at::ScalarType parse_storage_dtype(std::string_view name) {
  const auto t = lookup(name);
  if (!t) {
    throw InvalidArgument("invalid storage dtype '" + std::string(name) + "'; valid: " + kValidStorage);
  }
  return *t;
}

at::ScalarType parse_compute_dtype(std::string_view name) {
  const auto t = lookup(name);
  if (t && is_fp8(*t)) {
    throw InvalidArgument("compute dtype '" + std::string(name) +
                          "' refused: float8 is a storage dtype only (sluice upcasts before every matmul); valid: " +
                          kValidCompute);
  }
  if (!t) throw InvalidArgument("invalid compute dtype '" + std::string(name) + "'; valid: " + kValidCompute);
  return *t;
}

void check_storage_dtype(at::ScalarType t) {
  if (!is_fp8(t) && !is_compute(t)) {
    throw InvalidArgument("invalid storage dtype '" + dtype_name(t) + "'; valid: " + kValidStorage);
  }
}

void check_compute_dtype(at::ScalarType t) {
  if (is_fp8(t)) {
    throw InvalidArgument("compute dtype '" + dtype_name(t) +
                          "' refused: float8 is a storage dtype only (sluice upcasts before every matmul); valid: " +
                          kValidCompute);
  }
  if (!is_compute(t)) throw InvalidArgument("invalid compute dtype '" + dtype_name(t) + "'; valid: " + kValidCompute);
}

ComputeChoice choose_compute_dtype(std::string_view request, at::Device device, const Fp16Verdict& model_fp16) {
  if (lower(request) != "auto") {
    ComputeChoice c;
    c.dtype = parse_compute_dtype(request);
    c.reason = "requested";
    return c;
  }
  ComputeChoice c;
  c.automatic = true;
  const NativeAnswer bf16 = native_matmul(device, at::kBFloat16);
  if (bf16.native) {
    c.dtype = at::kBFloat16;
    c.reason = "auto: bfloat16, because " + bf16.why;
    return c;
  }
  const NativeAnswer f16 = native_matmul(device, at::kHalf);
  if (f16.native && model_fp16.fit) {
    c.dtype = at::kHalf;
    c.reason = "auto: float16, because " + bf16.why + "; fp16 is native (" + f16.why + ") and fits the model (" +
               model_fp16.note + ")";
    return c;
  }
  c.dtype = at::kFloat;
  c.reason = "auto: float32, because " + bf16.why +
             (f16.native             ? "; fp16 is native but not chosen: " + model_fp16.note
              : f16.why == bf16.why ? std::string("; the same holds for fp16")
                                    : "; nor fp16: " + f16.why);
  return c;
}

DtypePair resolve_dtypes(std::optional<at::ScalarType> storage, std::optional<at::ScalarType> compute,
                         at::Device device) {
  DtypePair pair;
  pair.compute = compute.value_or(at::kBFloat16);
  check_compute_dtype(pair.compute);
  pair.storage = storage.value_or(at::kFloat8_e4m3fn);
  check_storage_dtype(pair.storage);
  if (is_fp8(pair.storage) && !device_supports_fp8_storage(device, pair.storage)) {
    log::warn("fp8: device " + device.str() + " cannot store " + dtype_name(pair.storage) +
              "; weights are stored in " + dtype_name(pair.compute) + " instead (more memory, same results as " +
              dtype_name(pair.compute) + " weights)");
    pair.storage = pair.compute;
  }
  return pair;
}

bool device_supports_fp8_storage(at::Device device, at::ScalarType fp8) {
  if (!is_fp8(fp8)) throw InvalidArgument("device_supports_fp8_storage: " + dtype_name(fp8) + " is not a float8 dtype");
  if (device.is_cpu() || device.is_cuda()) return true;

  ProbeState& st = probe_state();
  const auto key = std::make_tuple(static_cast<int>(device.type()), static_cast<int>(device.index()),
                                   static_cast<int>(fp8));
  detail::Fp8ProbeFn fn;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.ok.count(key)) {
      ++st.stats.cache_hits;
      return true;
    }
    ++st.stats.probes;
    fn = st.override_fn;
  }
  std::string why;
  bool ok = false;
  if (fn) {
    ok = fn(device, fp8);
    if (!ok) why = "the probe failed";
  } else {
    try {
      ok = probe_impl(device, fp8, &why);
    } catch (const std::exception& e) {
      why = e.what();
      ok = false;
    }
  }
  std::lock_guard<std::mutex> lock(st.mu);
  if (ok) {
    st.ok.insert(key);
  } else {
    ++st.stats.failures;
    const std::string first_line = why.substr(0, why.find('\n'));
    log::warn("fp8: storage probe of " + dtype_name(fp8) + " on " + device.str() + " failed (" + first_line + ")");
  }
  return ok;
}

namespace detail {

bool probe_fp8_storage(at::Device device, at::ScalarType fp8) {
  if (!is_fp8(fp8)) throw InvalidArgument("probe_fp8_storage: " + dtype_name(fp8) + " is not a float8 dtype");
  try {
    return probe_impl(device, fp8, nullptr);
  } catch (const std::exception&) {
    return false;
  }
}

Fp8ProbeStats fp8_probe_stats() {
  std::lock_guard<std::mutex> lock(probe_state().mu);
  return probe_state().stats;
}

void reset_fp8_probe_cache() {
  std::lock_guard<std::mutex> lock(probe_state().mu);
  probe_state().ok.clear();
  probe_state().stats = Fp8ProbeStats{};
}

ScopedFp8ProbeOverride::ScopedFp8ProbeOverride(Fp8ProbeFn fn) {
  std::lock_guard<std::mutex> lock(probe_state().mu);
  previous_ = std::exchange(probe_state().override_fn, std::move(fn));
}

ScopedFp8ProbeOverride::~ScopedFp8ProbeOverride() {
  std::lock_guard<std::mutex> lock(probe_state().mu);
  probe_state().override_fn = std::move(previous_);
}

}  // namespace detail

OutOfRangePolicy parse_out_of_range_policy(std::string_view name) {
  const std::string key = lower(name);
  if (key == "saturate") return OutOfRangePolicy::saturate;
  if (key == "refuse") return OutOfRangePolicy::refuse;
  throw InvalidArgument("invalid fp8 out-of-range policy '" + std::string(name) + "'; valid: saturate, refuse");
}

ScaleMode parse_scale_mode(std::string_view name) {
  const std::string key = lower(name);
  if (key == "none") return ScaleMode::none;
  if (key == "per_tensor" || key == "tensor") return ScaleMode::per_tensor;
  if (key == "per_channel" || key == "channel") return ScaleMode::per_channel;
  throw InvalidArgument("invalid fp8 scale mode '" + std::string(name) + "'; valid: none, per_tensor, per_channel");
}

std::string to_string(OutOfRangePolicy p) { return p == OutOfRangePolicy::saturate ? "saturate" : "refuse"; }

std::string to_string(ScaleMode m) {
  switch (m) {
    case ScaleMode::none: return "none";
    case ScaleMode::per_tensor: return "per_tensor";
    case ScaleMode::per_channel: return "per_channel";
  }
  return "none";
}

}  // namespace sluice
