#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <ATen/Context.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/hardware.h"

using sluice::DtypePair;

namespace {

const at::ScalarType kFp8[] = {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz};

template <typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const sluice::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("dtype policy: dtype names parse both ways, with aliases and case-insensitively") {
  for (at::ScalarType t : {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz,
                           at::kBFloat16, at::kHalf, at::kFloat}) {
    CHECK(sluice::parse_storage_dtype(sluice::dtype_name(t)) == t);
  }
  CHECK(sluice::dtype_name(at::kFloat8_e4m3fn) == "float8_e4m3fn");
  CHECK(sluice::dtype_name(at::kBFloat16) == "bfloat16");
  CHECK(sluice::dtype_name(at::kHalf) == "float16");
  CHECK(sluice::parse_storage_dtype("fp8") == at::kFloat8_e4m3fn);
  CHECK(sluice::parse_storage_dtype("E5M2") == at::kFloat8_e5m2);
  CHECK(sluice::parse_storage_dtype("torch.float8_e4m3fnuz") == at::kFloat8_e4m3fnuz);
  CHECK(sluice::parse_storage_dtype("bf16") == at::kBFloat16);
  CHECK(sluice::parse_compute_dtype("BF16") == at::kBFloat16);
  CHECK(sluice::parse_compute_dtype("half") == at::kHalf);
  CHECK(sluice::parse_compute_dtype("torch.float32") == at::kFloat);
}

TEST_CASE("dtype policy: a bad dtype name is named and the valid ones are listed") {
  const std::string m = message_of([] { sluice::parse_storage_dtype("float8_e3m4"); });
  CHECK(contains(m, "'float8_e3m4'"));
  CHECK(contains(m, "float8_e4m3fn"));
  CHECK(contains(m, "float8_e5m2fnuz"));
  CHECK(contains(m, "bfloat16"));
  const std::string c = message_of([] { sluice::parse_compute_dtype("int8"); });
  CHECK(contains(c, "'int8'"));
  CHECK(contains(c, "float16"));
}

TEST_CASE("dtype policy: an fp8 compute dtype is refused as storage-only") {
  const std::string m = message_of([] { sluice::parse_compute_dtype("fp8"); });
  CHECK(contains(m, "'fp8'"));
  CHECK(contains(m, "storage dtype only"));
  CHECK(contains(message_of([] { sluice::check_compute_dtype(at::kFloat8_e5m2); }), "float8_e5m2"));
  CHECK(contains(message_of([] { sluice::resolve_dtypes(std::nullopt, at::kFloat8_e4m3fn, at::kCPU); }),
                 "storage dtype only"));
  CHECK(contains(message_of([] { sluice::check_compute_dtype(at::kInt); }), "int"));
  CHECK(contains(message_of([] { sluice::check_storage_dtype(at::kLong); }), "invalid storage dtype"));
  CHECK(message_of([] { sluice::check_storage_dtype(at::kFloat8_e4m3fnuz); }).empty());
}

TEST_CASE("dtype policy: fp8_max_finite is the largest finite value each encoding decodes to") {
  for (at::ScalarType t : kFp8) {
    const auto& tab = sluice::fp8_tables(t);
    float largest = 0;
    for (float v : tab.f32) {
      if (std::isfinite(v)) largest = std::max(largest, v);
    }
    CHECK(sluice::fp8_max_finite(t) == largest);
  }
  CHECK(sluice::fp8_max_finite(at::kFloat8_e4m3fn) == 448.0);
  CHECK(sluice::fp8_max_finite(at::kFloat8_e4m3fnuz) == 240.0);
  CHECK_THROWS_AS(sluice::fp8_max_finite(at::kBFloat16), sluice::InvalidArgument);
}

TEST_CASE("dtype policy: resolve_dtypes: defaults, honoured non-fp8 storage, validation") {
  const DtypePair d = sluice::resolve_dtypes(std::nullopt, std::nullopt, at::kCPU);
  CHECK(d.storage == at::kFloat8_e4m3fn);
  CHECK(d.compute == at::kBFloat16);
  CHECK(d.fp8());
  const DtypePair h = sluice::resolve_dtypes(at::kFloat8_e5m2, at::kHalf, at::Device(at::kCUDA, 1));
  CHECK(h.storage == at::kFloat8_e5m2);
  CHECK(h.compute == at::kHalf);
  const DtypePair plain = sluice::resolve_dtypes(at::kBFloat16, at::kFloat, at::kCPU);
  CHECK(plain.storage == at::kBFloat16);
  CHECK(plain.compute == at::kFloat);
  CHECK_FALSE(plain.fp8());
  CHECK_THROWS_AS(sluice::resolve_dtypes(at::kInt, std::nullopt, at::kCPU), sluice::InvalidArgument);
}

TEST_CASE("dtype policy: CPU and CUDA are answered without a probe") {
  sluice::detail::reset_fp8_probe_cache();
  int calls = 0;
  sluice::detail::ScopedFp8ProbeOverride fake([&](at::Device, at::ScalarType) {
    ++calls;
    return false;
  });
  CHECK(sluice::device_supports_fp8_storage(at::kCPU));
  CHECK(sluice::device_supports_fp8_storage(at::Device(at::kCUDA, 0), at::kFloat8_e4m3fnuz));
  CHECK(calls == 0);
  CHECK(sluice::detail::fp8_probe_stats().probes == 0);
}

TEST_CASE("dtype policy: the real probe passes on CPU for every fp8 dtype and fails on meta") {
  for (at::ScalarType t : kFp8) CHECK(sluice::detail::probe_fp8_storage(at::kCPU, t));
  // meta tensors hold no data, so the read-back cannot compare: a backend that cannot hold
  // the bytes must be reported as such, not crash.
  CHECK_FALSE(sluice::detail::probe_fp8_storage(at::kMeta, at::kFloat8_e4m3fn));
  CHECK_THROWS_AS(sluice::detail::probe_fp8_storage(at::kCPU, at::kBFloat16), sluice::InvalidArgument);
}

TEST_CASE("dtype policy: probe successes are cached per device and dtype, failures are not") {
  sluice::detail::reset_fp8_probe_cache();
  int calls = 0;
  sluice::detail::ScopedFp8ProbeOverride fake([&](at::Device d, at::ScalarType) {
    ++calls;
    return d.index() != 3;  // device 3 of the fake backend cannot hold fp8
  });
  const at::Device dev0(at::kPrivateUse1, 0);
  CHECK(sluice::device_supports_fp8_storage(dev0));
  CHECK(sluice::device_supports_fp8_storage(dev0));
  CHECK(sluice::device_supports_fp8_storage(dev0));
  CHECK(calls == 1);
  auto s = sluice::detail::fp8_probe_stats();
  CHECK(s.probes == 1);
  CHECK(s.cache_hits == 2);

  CHECK(sluice::device_supports_fp8_storage(dev0, at::kFloat8_e5m2));  // another dtype: own probe
  CHECK(sluice::device_supports_fp8_storage(at::Device(at::kPrivateUse1, 1)));  // another index
  CHECK(calls == 3);

  const at::Device bad(at::kPrivateUse1, 3);
  CHECK_FALSE(sluice::device_supports_fp8_storage(bad));
  CHECK_FALSE(sluice::device_supports_fp8_storage(bad));
  CHECK(calls == 5);
  s = sluice::detail::fp8_probe_stats();
  CHECK(s.failures == 2);
  CHECK(s.cache_hits == 2);
}

TEST_CASE("dtype policy: resolve_dtypes falls back to the compute dtype where fp8 cannot be stored") {
  sluice::detail::reset_fp8_probe_cache();
  {
    sluice::detail::ScopedFp8ProbeOverride fake([](at::Device d, at::ScalarType) { return d.index() == 0; });
    const DtypePair ok = sluice::resolve_dtypes(at::kFloat8_e4m3fn, at::kHalf, at::Device(at::kPrivateUse1, 0));
    CHECK(ok.storage == at::kFloat8_e4m3fn);
    const DtypePair fallback = sluice::resolve_dtypes(at::kFloat8_e4m3fn, at::kHalf, at::Device(at::kPrivateUse1, 1));
    CHECK(fallback.storage == at::kHalf);
    CHECK(fallback.compute == at::kHalf);
    CHECK_FALSE(fallback.fp8());
  }
  // Without an override the real probe runs: meta cannot hold the bytes.
  const DtypePair meta = sluice::resolve_dtypes(std::nullopt, std::nullopt, at::kMeta);
  CHECK(meta.storage == at::kBFloat16);
  CHECK(sluice::detail::fp8_probe_stats().failures == 2);
}

TEST_CASE("dtype policy: policy and scale-mode names parse, and Fp8Options defaults are the documented ones") {
  CHECK(sluice::parse_out_of_range_policy("Saturate") == sluice::OutOfRangePolicy::saturate);
  CHECK(sluice::parse_out_of_range_policy("refuse") == sluice::OutOfRangePolicy::refuse);
  CHECK(sluice::parse_scale_mode("per_channel") == sluice::ScaleMode::per_channel);
  CHECK(sluice::parse_scale_mode("per_tensor") == sluice::ScaleMode::per_tensor);
  CHECK(sluice::parse_scale_mode("none") == sluice::ScaleMode::none);
  CHECK(contains(message_of([] { sluice::parse_scale_mode("block"); }), "'block'"));
  CHECK(contains(message_of([] { sluice::parse_out_of_range_policy("wrap"); }), "saturate, refuse"));
  for (auto m : {sluice::ScaleMode::none, sluice::ScaleMode::per_tensor, sluice::ScaleMode::per_channel}) {
    CHECK(sluice::parse_scale_mode(sluice::to_string(m)) == m);
  }

  const sluice::Fp8Options o;
  CHECK(o.storage == at::kFloat8_e4m3fn);
  CHECK(o.compute == at::kBFloat16);
  CHECK(o.use_default_skips);
  CHECK(o.use_model_skips);
  CHECK(o.extra_skip_patterns.empty());
  CHECK(o.out_of_range == sluice::OutOfRangePolicy::saturate);
  CHECK(o.scale_mode == sluice::ScaleMode::none);
}

// ---------------------------------------------------------------------------------------
// The rules of Note [compute dtype auto] (runtime/dtype_policy.h).

namespace {

// Switches torch's oneDNN off for a scope, as SLUICE_CPU_ONEDNN=off does: the slow bf16
// path of a CPU without AVX-512, reproduced on one that has it.
struct OneDnnOff {
  bool was = at::globalContext().userEnabledMkldnn();
  OneDnnOff() { at::globalContext().setUserEnabledMkldnn(false); }
  ~OneDnnOff() { at::globalContext().setUserEnabledMkldnn(was); }
};

const sluice::Fp16Verdict kFit{true, "measured fit"};
const sluice::Fp16Verdict kUnfit{false, "overflows past 65504"};

}  // namespace

TEST_CASE("dtype policy: compute auto follows torch's bf16 capability on the CPU") {
  const sluice::NativeAnswer bf16 = sluice::native_matmul(at::kCPU, at::kBFloat16);
  const sluice::ComputeChoice c = sluice::choose_compute_dtype("auto", at::kCPU, kUnfit);
  CHECK(c.automatic);
  CHECK(contains(c.reason, "auto: "));
  CHECK(contains(c.reason, bf16.why));
  // The answer mirrors torch's oneDNN bf16 check: AVX-512 core on x86.
  const auto& ext = sluice::cpu_description().vector_extensions;
  auto has = [&](const char* e) { return std::find(ext.begin(), ext.end(), e) != ext.end(); };
  if (sluice::cpu_description().architecture == "x86_64" && at::hasMKLDNN() &&
      at::globalContext().userEnabledMkldnn()) {
    CHECK(bf16.native == (has("avx512_bw") && has("avx512_vl") && has("avx512_dq")));
  }
  CHECK(c.dtype == (bf16.native ? at::kBFloat16 : at::kFloat));
}

TEST_CASE("dtype policy: compute auto picks float32 where torch's oneDNN is off and says why") {
  OneDnnOff off;
  CHECK_FALSE(sluice::native_matmul(at::kCPU, at::kBFloat16).native);
  CHECK_FALSE(sluice::native_matmul(at::kCPU, at::kHalf).native);
  for (const auto& verdict : {kFit, kUnfit}) {
    const sluice::ComputeChoice c = sluice::choose_compute_dtype("AUTO", at::kCPU, verdict);
    CHECK(c.dtype == at::kFloat);
    CHECK(c.automatic);
    CHECK(contains(c.reason, "auto: float32, because torch's oneDNN is switched off"));
  }
}

TEST_CASE("dtype policy: an explicit compute dtype always wins over auto") {
  OneDnnOff off;
  for (const auto& [name, t] : {std::pair<const char*, at::ScalarType>{"bfloat16", at::kBFloat16},
                                {"fp16", at::kHalf}, {"float32", at::kFloat}}) {
    const sluice::ComputeChoice c = sluice::choose_compute_dtype(name, at::kCPU, kUnfit);
    CHECK(c.dtype == t);
    CHECK_FALSE(c.automatic);
    CHECK(c.reason == "requested");
  }
  CHECK(contains(message_of([] { sluice::choose_compute_dtype("fastest", at::kCPU, kFit); }),
                 "invalid compute dtype 'fastest'"));
  CHECK(contains(message_of([] { sluice::choose_compute_dtype("e4m3fn", at::kCPU, kFit); }), "storage dtype only"));
}

TEST_CASE("dtype policy: the CPU is named with its model and vector extensions") {
  const std::string s = sluice::cpu_summary();
  CHECK_FALSE(sluice::cpu_description().model.empty());
  CHECK(contains(s, sluice::cpu_description().model));
  CHECK(contains(s, "cores"));
  if (sluice::cpu_description().architecture == "x86_64") CHECK(contains(s, "avx2"));
  CHECK(contains(sluice::hardware_summary(at::kCPU), "CPU " + s));
  CHECK(contains(sluice::hardware_summary(at::Device(at::kCUDA, 0)), "; CPU "));
}
