#include "runtime/fp8.h"

#include <ATen/core/grad_mode.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <c10/util/Half.h>

#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "runtime/error.h"
#include "runtime/fp8_kernels.h"
#include "runtime/logging.h"

namespace sluice {
namespace {

// ---- tables -------------------------------------------------------------------------

template <typename F8>
Fp8Tables build_tables() {
  Fp8Tables t{};
  for (int b = 0; b < 256; ++b) {
    const float f = static_cast<float>(F8(static_cast<uint8_t>(b), F8::from_bits()));
    t.f32[b] = f;
    t.bf16[b] = c10::BFloat16(f).x;  // exact: every fp8 value is a bfloat16
    t.f16[b] = c10::Half(f).x;       // exact: every fp8 value is a float16
  }
  return t;
}

// ---- CPU kernels --------------------------------------------------------------------

// Elements per at::parallel_for chunk: large enough that thread start-up is noise, small
// enough that a 2048x2048 weight (4 Mi elements) is split across cores.
constexpr int64_t kGrain = int64_t{1} << 18;

// The unscaled upcast is a table gather. Eight input bytes are read with one load and the
// eight lookups are independent, so the loop runs at the load ports' rate. x86 has no 16-bit
// gather; an AVX2 32-bit vpgatherdd + pack variant measured slower than this scalar loop
// (Zen 3: 5.4 vs 8.3 GB/s moved), as did non-temporal stores, so the portable loop stays.
template <typename T>
void gather(const uint8_t* in, T* out, int64_t n, const T* table) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, in + i, sizeof w);
    out[i + 0] = table[w & 0xFF];
    out[i + 1] = table[(w >> 8) & 0xFF];
    out[i + 2] = table[(w >> 16) & 0xFF];
    out[i + 3] = table[(w >> 24) & 0xFF];
    out[i + 4] = table[(w >> 32) & 0xFF];
    out[i + 5] = table[(w >> 40) & 0xFF];
    out[i + 6] = table[(w >> 48) & 0xFF];
    out[i + 7] = table[(w >> 56) & 0xFF];
  }
  for (; i < n; ++i) out[i] = table[in[i]];
}

// Rounds the fp32 product to the output type the way ATen's .to() does (nearest even).
// c10's round_to_nearest_even, written without a branch so the loop stays tight; the NaN
// pattern is the same 0x7FC0 c10 produces.
struct ToBf16 {
  uint16_t operator()(float v) const {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    const auto rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return v != v ? uint16_t{0x7FC0} : rounded;
  }
};
struct ToF16 {
  uint16_t operator()(float v) const { return c10::Half(v).x; }
};
struct ToF32 {
  float operator()(float v) const { return v; }
};

// out[i] = round(f32[in[i]] * scale[row(i)]) over [begin, end); a per-tensor scale is one
// row as long as the tensor.
template <typename T, typename Round>
void scaled_range(const uint8_t* in, T* out, int64_t begin, int64_t end, const float* f32, const float* scale,
                  int64_t row_len, Round round) {
  int64_t row = begin / row_len;
  int64_t i = begin;
  while (i < end) {
    const int64_t stop = std::min(end, (row + 1) * row_len);
    const float s = scale[row];
    for (; i < stop; ++i) out[i] = round(f32[in[i]] * s);
    ++row;
  }
}

template <typename T, typename Round>
void cpu_scaled(const uint8_t* in, T* out, int64_t n, const float* f32, const float* scale, int64_t row_len,
                Round round) {
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { scaled_range(in, out, b, e, f32, scale, row_len, round); });
}

template <typename T>
void cpu_gather(const uint8_t* in, T* out, int64_t n, const T* table) {
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { gather(in + b, out + b, e - b, table); });
}

// src: fp8, contiguous, CPU. scale: undefined or fp32 contiguous CPU. out: contiguous CPU.
void cpu_upcast(const at::Tensor& src, const at::Tensor& scale, const at::Tensor& out) {
  const Fp8Tables& tab = fp8_tables(src.scalar_type());
  const int64_t n = src.numel();
  if (n == 0) return;
  const auto* in = static_cast<const uint8_t*>(src.data_ptr());
  const at::ScalarType compute = out.scalar_type();
  if (!scale.defined()) {
    switch (compute) {
      case at::kBFloat16: return cpu_gather(in, static_cast<uint16_t*>(out.data_ptr()), n, tab.bf16);
      case at::kHalf: return cpu_gather(in, static_cast<uint16_t*>(out.data_ptr()), n, tab.f16);
      case at::kFloat: return cpu_gather(in, static_cast<float*>(out.data_ptr()), n, tab.f32);
      default: TORCH_INTERNAL_ASSERT(false, "cpu_upcast: unchecked compute dtype ", compute);
    }
  }
  const float* s = scale.data_ptr<float>();
  const int64_t row_len = scale.numel() == 1 ? n : n / scale.numel();
  switch (compute) {
    case at::kBFloat16:
      return cpu_scaled(in, static_cast<uint16_t*>(out.data_ptr()), n, tab.f32, s, row_len, ToBf16{});
    case at::kHalf: return cpu_scaled(in, static_cast<uint16_t*>(out.data_ptr()), n, tab.f32, s, row_len, ToF16{});
    case at::kFloat: return cpu_scaled(in, static_cast<float*>(out.data_ptr()), n, tab.f32, s, row_len, ToF32{});
    default: TORCH_INTERNAL_ASSERT(false, "cpu_upcast: unchecked compute dtype ", compute);
  }
}

// ---- helpers ------------------------------------------------------------------------

bool is_compute_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat; }

// The scale shaped to broadcast against `stored`: [] per tensor, [out, 1, ...] per row.
at::Tensor broadcastable_scale(const at::Tensor& scale, const at::Tensor& stored) {
  if (scale.numel() == 1) return scale.reshape({});
  std::vector<int64_t> shape(static_cast<size_t>(stored.dim()), 1);
  shape[0] = stored.size(0);
  return scale.reshape(shape);
}

void check_scale(const at::Tensor& stored, const at::Tensor& scale) {
  if (!scale.defined()) return;
  const bool per_tensor = scale.numel() == 1;
  const bool per_row = stored.dim() >= 1 && scale.numel() == stored.size(0) && scale.dim() <= 1;
  if (!per_tensor && !per_row) {
    throw InvalidArgument(c10::str("upcast: scale of shape ", scale.sizes(), " fits neither per tensor ([] or [1]) nor ",
                                   "per output channel of a stored tensor of shape ", stored.sizes()));
  }
  if (!scale.is_floating_point()) {
    throw InvalidArgument(c10::str("upcast: scale must be floating point, got ", scale.scalar_type()));
  }
}

// The reference path: ATen's conversion, scale applied in fp32.
at::Tensor aten_upcast(const at::Tensor& stored, at::ScalarType compute, const at::Tensor& scale) {
  if (!scale.defined()) return stored.to(compute);
  const at::Tensor s = broadcastable_scale(scale.to(stored.device(), at::kFloat), stored);
  return (stored.to(at::kFloat) * s).to(compute);
}

std::array<std::atomic<DeviceUpcastFn>, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
device_kernels() {
  static std::array<std::atomic<DeviceUpcastFn>, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      table{};
  return table;
}

}  // namespace

const Fp8Tables& fp8_tables(at::ScalarType fp8) {
  switch (fp8) {
    case at::kFloat8_e4m3fn: {
      static const Fp8Tables t = build_tables<c10::Float8_e4m3fn>();
      return t;
    }
    case at::kFloat8_e5m2: {
      static const Fp8Tables t = build_tables<c10::Float8_e5m2>();
      return t;
    }
    case at::kFloat8_e4m3fnuz: {
      static const Fp8Tables t = build_tables<c10::Float8_e4m3fnuz>();
      return t;
    }
    case at::kFloat8_e5m2fnuz: {
      static const Fp8Tables t = build_tables<c10::Float8_e5m2fnuz>();
      return t;
    }
    default: throw InvalidArgument("fp8_tables: " + dtype_name(fp8) + " is not a float8 dtype");
  }
}

void register_device_upcast(c10::DeviceType type, DeviceUpcastFn fn) {
  const auto i = static_cast<size_t>(type);
  TORCH_INTERNAL_ASSERT(i < device_kernels().size(), "register_device_upcast: bad device type");
  device_kernels()[i].store(fn);
}

DeviceUpcastFn device_upcast(c10::DeviceType type) {
  const auto i = static_cast<size_t>(type);
  return i < device_kernels().size() ? device_kernels()[i].load() : nullptr;
}

Fp8NonFinite count_fp8_non_finite(at::ScalarType fp8, const uint8_t* b, int64_t n) {
  Fp8NonFinite r;
  int64_t bad = 0;
  switch (fp8) {
    case at::kFloat8_e4m3fn:
      r.nans = fp8_kernels::count_masked(b, n, 0x7F, 0x7F);
      break;
    case at::kFloat8_e5m2:
      bad = fp8_kernels::count_masked(b, n, 0x7C, 0x7C);
      if (bad != 0) {
        for (int64_t i = 0; i < n; ++i) {
          if ((b[i] & 0x7C) == 0x7C) (b[i] & 0x03) != 0 ? ++r.nans : ++r.infs;
        }
      }
      break;
    case at::kFloat8_e4m3fnuz:
    case at::kFloat8_e5m2fnuz:
      r.nans = fp8_kernels::count_masked(b, n, 0xFF, 0x80);
      break;
    default: throw InvalidArgument("count_fp8_non_finite: " + dtype_name(fp8) + " is not a float8 dtype");
  }
  return r;
}

Fp8NonFinite count_non_finite(at::ScalarType t, const void* bytes, int64_t n) {
  if (is_fp8(t)) return count_fp8_non_finite(t, static_cast<const uint8_t*>(bytes), n);
  Fp8NonFinite r;
  if (t == at::kBFloat16 || t == at::kHalf) {
    const auto* in = static_cast<const uint16_t*>(bytes);
    const uint16_t inf = t == at::kBFloat16 ? 0x7F80 : 0x7C00;
    if (fp8_kernels::stats_16(in, n, static_cast<uint16_t>(inf - 1)).over == 0) return r;
    for (int64_t i = 0; i < n; ++i) {
      const auto m = static_cast<uint16_t>(in[i] & 0x7FFF);
      if (m > inf) ++r.nans;
      if (m == inf) ++r.infs;
    }
    return r;
  }
  if (t == at::kFloat) {
    const auto* in = static_cast<const uint32_t*>(bytes);
    if (fp8_kernels::stats_32(in, n, 0x7F7FFFFFu).over == 0) return r;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t m = in[i] & 0x7FFFFFFFu;
      if (m > 0x7F800000u) ++r.nans;
      if (m == 0x7F800000u) ++r.infs;
    }
    return r;
  }
  throw InvalidArgument("count_non_finite: " + dtype_name(t) + " is not an fp8, bfloat16, float16 or float32 dtype");
}

void refuse_non_finite(const std::string& name, int64_t nans, int64_t infs, at::ScalarType storage,
                       const std::string& where) {
  if (nans + infs == 0) return;
  throw InvalidArgument(c10::str(where.empty() ? std::string("cast_to_storage") : where, ": tensor '", name,
                                 "' holds ", nans, " NaN and ", infs, " inf values; refusing to store it as ",
                                 dtype_name(storage)));
}

double storage_max_finite(at::ScalarType storage) {
  if (is_fp8(storage)) return fp8_max_finite(storage);
  switch (storage) {
    case at::kHalf: return 65504.0;
    case at::kBFloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    case at::kFloat: return static_cast<double>(FLT_MAX);
    default: throw InvalidArgument("storage_max_finite: " + dtype_name(storage) + " is not a storage dtype");
  }
}

void report_out_of_range(const std::string& name, int64_t clipped, int64_t numel, double amax, at::ScalarType storage,
                         OutOfRangePolicy policy) {
  const double max_finite = storage_max_finite(storage);
  if (policy == OutOfRangePolicy::refuse) {
    throw InvalidArgument(c10::str("cast_to_storage: tensor '", name, "' has ", clipped, " of ", numel,
                                   " values beyond +-", max_finite, " (max |w| = ", amax, "), the range of ",
                                   dtype_name(storage),
                                   is_fp8(storage) ? "; use scaled storage or out_of_range=saturate"
                                                   : "; use a wider storage dtype or out_of_range=saturate"));
  }
  log::warn(c10::str(is_fp8(storage) ? "fp8" : "storage", ": tensor '", name, "': ", clipped, " of ", numel,
                     " values beyond +-", max_finite, " (max |w| = ", amax, ") saturated to +-", max_finite, " for ",
                     dtype_name(storage)));
}

float fp8_tensor_scale(double amax, at::ScalarType fp8) {
  // Floored at FLT_MIN so that w / scale cannot overflow (amax / FLT_MIN <= max finite
  // holds whenever that floor applies).
  float s = static_cast<float>(amax / fp8_max_finite(fp8));
  if (amax == 0.0) s = 1.0f;
  return std::max(s, FLT_MIN);
}

StorageCast cast_to_storage(const at::Tensor& w, at::ScalarType storage, const std::string& name,
                            const Fp8Options& options) {
  check_storage_dtype(storage);
  if (!w.defined()) throw InvalidArgument("cast_to_storage: tensor '" + name + "' is undefined");
  if (!w.is_floating_point()) {
    throw InvalidArgument(c10::str("cast_to_storage: tensor '", name, "' has dtype ", dtype_name(w.scalar_type()),
                                   "; only floating-point tensors are cast to a storage dtype"));
  }
  at::NoGradGuard no_grad;
  StorageCast r;
  if (w.numel() == 0) {
    r.stored = w.to(storage);
    return r;
  }
  if (!is_fp8(storage)) {
    if (is_fp8(w.scalar_type())) {
      // An exact upcast (every fp8 value is finite in bfloat16/float16/float32): only the
      // bytes need a look.
      if (w.device().is_cpu()) {
        const at::Tensor c = w.contiguous();
        const Fp8NonFinite bad = count_fp8_non_finite(c.scalar_type(), static_cast<const uint8_t*>(c.data_ptr()), c.numel());
        refuse_non_finite(name, bad.nans, bad.infs, storage);
      } else {
        const at::Tensor f = w.to(at::kFloat);
        refuse_non_finite(name, at::isnan(f).sum().item<int64_t>(), at::isinf(f).sum().item<int64_t>(), storage);
      }
      r.stored = w.to(storage);
      return r;
    }
    const double amax = w.abs().amax().item<double>();  // NaN propagates through amax, inf is its own max
    if (!std::isfinite(amax)) {
      refuse_non_finite(name, at::isnan(w).sum().item<int64_t>(), at::isinf(w).sum().item<int64_t>(), storage);
    }
    const double max_finite = storage_max_finite(storage);
    if (amax > max_finite) {
      // float16 from bfloat16/float32, bfloat16 from float32: what would round to inf.
      // Compared and clamped in fp32 (or fp64): 65504 is not a bfloat16 value, and rounds up
      // to 65536 there.
      const at::Tensor wide = w.scalar_type() == at::kDouble ? w : w.to(at::kFloat);
      r.clipped = wide.abs().gt(max_finite).sum().item<int64_t>();
      report_out_of_range(name, r.clipped, w.numel(), amax, storage, options.out_of_range);
      r.stored = wide.clamp(-max_finite, max_finite).to(storage);
      return r;
    }
    r.stored = w.to(storage);
    return r;
  }
  // fp8 input (re-encoding, e.g. e5m2 -> e4m3fn, which can overflow) goes through fp32,
  // which is exact; ATen has no abs/amax for fp8.
  const at::Tensor x = is_fp8(w.scalar_type()) ? w.to(at::kFloat) : w;

  const double max_finite = fp8_max_finite(storage);
  // One reduction answers both questions: NaN propagates through amax, inf is its own max.
  const double amax = x.abs().amax().item<double>();
  if (!std::isfinite(amax)) {
    refuse_non_finite(name, at::isnan(x).sum().item<int64_t>(), at::isinf(x).sum().item<int64_t>(), storage);
  }

  const bool scaled = options.scale_mode != ScaleMode::none && x.dim() >= 2;
  if (!scaled) {
    at::Tensor src = x;
    if (amax > max_finite) {
      r.clipped = x.abs().gt(max_finite).sum().item<int64_t>();
      report_out_of_range(name, r.clipped, x.numel(), amax, storage, options.out_of_range);
      src = x.clamp(-max_finite, max_finite);
    }
    r.stored = src.to(storage);
    return r;
  }

  // Scaled: scale = amax / max_finite, floored at FLT_MIN so that the division below cannot
  // overflow (amax / FLT_MIN <= max_finite holds whenever that floor applies), and 1 for
  // an all-zero tensor or row.
  const at::Tensor wf = x.to(at::kFloat);
  at::Tensor scale;
  if (options.scale_mode == ScaleMode::per_tensor) {
    scale = at::full({}, fp8_tensor_scale(amax, storage), wf.options());
  } else {
    std::vector<int64_t> dims;
    for (int64_t d = 1; d < x.dim(); ++d) dims.push_back(d);
    const at::Tensor row_amax = wf.abs().amax(dims);
    scale = at::where(row_amax.eq(0), at::ones_like(row_amax), (row_amax / max_finite).clamp_min(FLT_MIN));
  }
  // The clamp only guards rounding of w / scale at the very top of the range.
  r.stored = (wf / broadcastable_scale(scale, wf)).clamp(-max_finite, max_finite).to(storage);
  r.scale = scale;
  return r;
}

at::Tensor upcast(const at::Tensor& stored, at::ScalarType compute, const at::Tensor& scale) {
  if (!scale.defined() && stored.scalar_type() == compute) return stored;
  if (is_fp8(compute)) check_compute_dtype(compute);  // throws: fp8 is storage-only
  check_scale(stored, scale);
  // Non-fp8 storage, or a compute dtype without a fast path (float64), is a plain ATen cast.
  if (!is_fp8(stored.scalar_type()) || !is_compute_dtype(compute)) return aten_upcast(stored, compute, scale);
  at::Tensor out = at::empty(stored.sizes(), stored.options().dtype(compute));
  upcast_into(stored, scale, out);
  return out;
}

void upcast_into(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out) {
  if (!out.defined() || !out.is_contiguous() || out.device() != stored.device() || out.numel() != stored.numel() ||
      !is_compute_dtype(out.scalar_type())) {
    throw InvalidArgument(c10::str("upcast_into: output must be a contiguous bfloat16/float16/float32 tensor of ",
                                   stored.numel(), " elements on ", stored.device(), "; got ",
                                   out.defined() ? c10::str(dtype_name(out.scalar_type()), " ", out.sizes(), " on ",
                                                            out.device(), out.is_contiguous() ? "" : " (strided)")
                                                 : std::string("an undefined tensor")));
  }
  check_scale(stored, scale);
  at::NoGradGuard no_grad;
  if (is_fp8(stored.scalar_type())) {
    const at::Tensor src = stored.contiguous();
    const at::Tensor s = scale.defined() ? scale.to(stored.device(), at::kFloat).contiguous() : scale;
    if (stored.is_cpu()) return cpu_upcast(src, s, out);
    if (DeviceUpcastFn fn = device_upcast(stored.device().type())) {
      if (fn(src, s, out)) return;
    }
  }
  aten_upcast_into(stored, scale, out);
}

void aten_upcast_into(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out) {
  // Without a full-size temporary (on a device that would be memory outside the budget):
  // convert into `out`, then scale it there. The product is taken in fp32 and rounded once,
  // as aten_upcast does, because the first step is exact: every fp8 value is a bf16, fp16
  // and fp32 value, and an unscaled conversion is rounded once either way. (On a GPU the
  // kernels cast on the fly; ATen's CPU kernels may still make temporaries, but the CPU
  // takes the table path above.)
  at::NoGradGuard no_grad;
  const at::Tensor o = out.view(stored.sizes());
  if (scale.defined() && !is_fp8(stored.scalar_type()) && stored.scalar_type() != out.scalar_type()) {
    o.copy_(aten_upcast(stored, out.scalar_type(), scale));  // a scaled non-fp8 tensor: no caller makes one
    return;
  }
  o.copy_(stored);
  if (scale.defined()) {
    // At least one dim: a 0-dim scale would count as a scalar of o's dtype (bf16 product).
    std::vector<int64_t> shape(static_cast<size_t>(std::max<int64_t>(stored.dim(), 1)), 1);
    if (scale.numel() != 1) shape[0] = stored.size(0);
    o.mul_(scale.to(stored.device(), at::kFloat).reshape(shape));
  }
}

}  // namespace sluice
