#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "offload/device/upcast_registry.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/fp8_format.h"

#ifdef SLUICE_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace {

const at::ScalarType kFp8[] = {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz};
const at::ScalarType kCompute[] = {at::kBFloat16, at::kHalf, at::kFloat};

// Every byte pattern 0..255 as an fp8 tensor.
at::Tensor all_bytes(at::ScalarType fp8) { return at::arange(256, at::kInt).to(at::kByte).view(fp8); }

// Random fp8 bytes, NaN patterns included.
at::Tensor random_fp8(at::IntArrayRef shape, at::ScalarType fp8, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, 256, shape, gen, at::TensorOptions().dtype(at::kInt)).to(at::kByte).view(fp8);
}

// Same values, bit for bit, except that NaNs only need to be NaN on both sides.
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor fa = a.to(at::kFloat), fb = b.to(at::kFloat);
  const at::Tensor nan_a = at::isnan(fa), nan_b = at::isnan(fb);
  if (!at::equal(nan_a, nan_b)) return false;
  const at::Tensor int_type_a = a.scalar_type() == at::kFloat ? a.view(at::kInt) : a.view(at::kShort);
  const at::Tensor int_type_b = b.scalar_type() == at::kFloat ? b.view(at::kInt) : b.view(at::kShort);
  return at::equal(int_type_a.masked_select(~nan_a), int_type_b.masked_select(~nan_b));
}

std::string dtype_case(at::ScalarType a, at::ScalarType b) {
  return sluice::dtype_name(a) + " -> " + sluice::dtype_name(b);
}

uint16_t bits16(const at::Tensor& t, int64_t i) { return static_cast<const uint16_t*>(t.data_ptr())[i]; }

}  // namespace

TEST_CASE("fp8: tables equal ATen's conversion for all 256 bytes of every fp8 dtype") {
  for (at::ScalarType t : kFp8) {
    const sluice::Fp8Tables& tab = sluice::fp8_tables(t);
    const at::Tensor x = all_bytes(t);
    const at::Tensor bf = x.to(at::kBFloat16).contiguous(), hf = x.to(at::kHalf).contiguous();
    const at::Tensor f = x.to(at::kFloat).contiguous();
    for (int b = 0; b < 256; ++b) {
      INFO(sluice::dtype_name(t) << " byte " << b);
      const float ref = f.data_ptr<float>()[b];
      if (std::isnan(ref)) {
        CHECK(std::isnan(tab.f32[b]));
        CHECK(std::isnan(static_cast<float>(c10::BFloat16(tab.bf16[b], c10::BFloat16::from_bits()))));
        CHECK(std::isnan(static_cast<float>(c10::Half(tab.f16[b], c10::Half::from_bits()))));
      } else {
        CHECK(std::memcmp(&tab.f32[b], &ref, sizeof ref) == 0);
        CHECK(tab.bf16[b] == bits16(bf, b));
        CHECK(tab.f16[b] == bits16(hf, b));
      }
    }
  }
  CHECK_THROWS_AS(sluice::fp8_tables(at::kBFloat16), sluice::InvalidArgument);
}

TEST_CASE("fp8: the CUDA kernel's bit-level decode equals ATen for all 256 bytes of every format") {
  using sluice::fp8::Format;
  const std::pair<at::ScalarType, Format> formats[] = {{at::kFloat8_e4m3fn, Format::e4m3fn},
                                                       {at::kFloat8_e5m2, Format::e5m2},
                                                       {at::kFloat8_e4m3fnuz, Format::e4m3fnuz},
                                                       {at::kFloat8_e5m2fnuz, Format::e5m2fnuz}};
  for (const auto& [t, fmt] : formats) {
    const at::Tensor ref = all_bytes(t).to(at::kFloat).contiguous();
    for (int b = 0; b < 256; ++b) {
      INFO(sluice::dtype_name(t) << " byte " << b);
      const float want = ref.data_ptr<float>()[b];
      const float got = sluice::fp8::decode(fmt, static_cast<uint8_t>(b));
      if (std::isnan(want)) {
        CHECK(std::isnan(got));
      } else {
        CHECK(std::memcmp(&got, &want, sizeof got) == 0);
      }
    }
  }
}

TEST_CASE("fp8: CPU upcast equals ATen .to() for every fp8/compute pair, odd sizes and strided input") {
  // 9 and 13 exercise the 8-wide loop's tail; 600001 spans several parallel_for chunks.
  // (The large size runs for one compute dtype only: ATen's fp8 reference is slow.)
  for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{13}, int64_t{4099}, int64_t{600001}}) {
    for (at::ScalarType t : kFp8) {
      const at::Tensor x = random_fp8({n}, t, 7 + n);
      for (at::ScalarType c : kCompute) {
        if (n > 4099 && c != at::kBFloat16) continue;
        INFO(dtype_case(t, c) << " n=" << n);
        CHECK(same_values(sluice::upcast(x, c, at::Tensor()), x.to(c)));
      }
    }
  }
  const at::Tensor m = random_fp8({33, 70}, at::kFloat8_e4m3fn, 3);
  const at::Tensor strided = m.t();  // not contiguous
  const at::Tensor up = sluice::upcast(strided, at::kBFloat16, at::Tensor());
  CHECK(up.sizes() == strided.sizes());
  CHECK(same_values(up, strided.to(at::kBFloat16)));
}

TEST_CASE("fp8: upcast returns the stored tensor itself when no conversion is needed") {
  const at::Tensor w = at::randn({4, 4}).to(at::kBFloat16);
  CHECK(sluice::upcast(w, at::kBFloat16, at::Tensor()).unsafeGetTensorImpl() == w.unsafeGetTensorImpl());
  const at::Tensor f = sluice::upcast(w, at::kFloat, at::Tensor());
  CHECK(f.scalar_type() == at::kFloat);
  CHECK(at::equal(f, w.to(at::kFloat)));
  CHECK_THROWS_AS(sluice::upcast(random_fp8({4}, at::kFloat8_e4m3fn, 1), at::kFloat8_e5m2, at::Tensor()),
                  sluice::InvalidArgument);
  CHECK_THROWS_AS(sluice::upcast(w, at::kFloat8_e4m3fn, at::Tensor()), sluice::InvalidArgument);
  // No fast path for float64: ATen answers.
  const at::Tensor x = random_fp8({5}, at::kFloat8_e5m2, 4);
  CHECK(same_values(sluice::upcast(x, at::kDouble, at::Tensor()).to(at::kFloat), x.to(at::kFloat)));
}

TEST_CASE("fp8: scaled CPU upcast equals (stored.to(float) * scale).to(compute) exactly") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (at::ScalarType t : kFp8) {
    for (at::ScalarType c : kCompute) {
      // 37 columns: rows end mid-way through the parallel chunks. The large shape (more
      // than one at::parallel_for chunk) runs once per fp8 dtype: ATen's reference is slow.
      const int64_t rows = c == at::kBFloat16 ? 9000 : 700;
      const at::Tensor x = random_fp8({rows, 37}, t, 5);
      const at::Tensor per_row = at::rand({rows}, gen) * 3 + 1e-3;
      const at::Tensor per_tensor = at::full({}, 0.0173f);
      INFO(dtype_case(t, c));
      const at::Tensor ref_row = (x.to(at::kFloat) * per_row.view({-1, 1})).to(c);
      const at::Tensor ref_tensor = (x.to(at::kFloat) * per_tensor).to(c);
      CHECK(same_values(sluice::upcast(x, c, per_row), ref_row));
      CHECK(same_values(sluice::upcast(x, c, per_tensor), ref_tensor));
      CHECK(same_values(sluice::upcast(x, c, per_tensor.reshape({1})), ref_tensor));
    }
  }
  const at::Tensor x = random_fp8({6, 4}, at::kFloat8_e4m3fn, 2);
  CHECK_THROWS_AS(sluice::upcast(x, at::kBFloat16, at::ones({4})), sluice::InvalidArgument);
  // A scale given in another dtype is applied in fp32.
  CHECK(same_values(sluice::upcast(x, at::kBFloat16, at::full({6}, 0.5, at::kDouble)),
                    (x.to(at::kFloat) * 0.5f).to(at::kBFloat16)));
}

TEST_CASE("fp8: upcast_into fills a preallocated buffer and checks it") {
  const at::Tensor x = random_fp8({64, 48}, at::kFloat8_e5m2, 9);
  at::Tensor flat = at::empty({64 * 48}, at::kHalf);
  sluice::upcast_into(x, at::Tensor(), flat);
  CHECK(same_values(flat.view({64, 48}), x.to(at::kHalf)));
  at::Tensor shaped = at::empty({64, 48}, at::kBFloat16);
  const at::Tensor scale = at::rand({64}) + 0.5;
  sluice::upcast_into(x, scale, shaped);
  CHECK(same_values(shaped, (x.to(at::kFloat) * scale.view({-1, 1})).to(at::kBFloat16)));
  // Non-fp8 storage goes through ATen into the buffer too.
  const at::Tensor b = at::randn({64, 48}).to(at::kBFloat16);
  at::Tensor f = at::empty({64, 48}, at::kFloat);
  sluice::upcast_into(b, at::Tensor(), f);
  CHECK(at::equal(f, b.to(at::kFloat)));

  CHECK_THROWS_AS(sluice::upcast_into(x, at::Tensor(), at::empty({64 * 48 - 1}, at::kHalf)), sluice::InvalidArgument);
  CHECK_THROWS_AS(sluice::upcast_into(x, at::Tensor(), at::empty({64 * 48}, at::kInt)), sluice::InvalidArgument);
  CHECK_THROWS_AS(sluice::upcast_into(x, at::Tensor(), at::empty({48, 64}, at::kHalf).t()), sluice::InvalidArgument);
  CHECK_THROWS_AS(sluice::upcast_into(x, at::Tensor(), at::Tensor()), sluice::InvalidArgument);
}

namespace {

// Counts what ATen's CPU allocator hands out while it is installed (the largest block),
// delegating to the allocator it replaced.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  CountingCpuAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, /*priority=*/255); }
  ~CountingCpuAllocator() override { c10::SetCPUAllocator(inner_, /*priority=*/255); }
  c10::DataPtr allocate(size_t n) override {
    largest = std::max(largest, n);
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  size_t largest = 0;

 private:
  c10::Allocator* inner_;
};

}  // namespace

TEST_CASE("fp8: the ATen upcast path writes into the buffer without a temporary of its size") {
  // On a device without a kernel, a temporary the size of the layer would be device memory
  // outside the budget. copy_ converts on the fly, so nothing that large is allocated.
  const at::Tensor stored = at::randn({512, 256});  // fp32 storage, bf16 compute: the ATen path
  at::Tensor out = at::empty({512 * 256}, at::kBFloat16);
  size_t largest = 0;
  {
    CountingCpuAllocator counting;
    sluice::upcast_into(stored, at::Tensor(), out);
    largest = counting.largest;
  }
  CHECK(largest < out.nbytes() / 4);
  CHECK(at::equal(out.view({512, 256}), stored.to(at::kBFloat16)));
}

TEST_CASE("fp8: the ATen upcast path is bit-identical to (stored.to(float) * scale).to(compute)") {
  // The path devices without a kernel take (copy_, then the scale in place), run on the CPU.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  for (at::ScalarType t : kFp8) {
    for (at::ScalarType c : kCompute) {
      INFO(dtype_case(t, c));
      const at::Tensor x = random_fp8({300, 41}, t, 3);
      const at::Tensor per_row = at::rand({300}, gen) * 3 + 1e-3;
      const at::Tensor per_tensor = at::full({}, 0.0173f);
      at::Tensor out = at::empty({300, 41}, c);
      sluice::aten_upcast_into(x, per_row, out);
      CHECK(same_values(out, (x.to(at::kFloat) * per_row.view({-1, 1})).to(c)));
      sluice::aten_upcast_into(x, per_tensor, out);
      CHECK(same_values(out, (x.to(at::kFloat) * per_tensor).to(c)));
      sluice::aten_upcast_into(x, at::Tensor(), out);
      CHECK(same_values(out, x.to(c)));
    }
  }
}

TEST_CASE("fp8: fp8 -> bf16/fp16 -> fp8 round-trips every non-NaN byte bitwise") {
  for (at::ScalarType t : kFp8) {
    const at::Tensor x = all_bytes(t);
    const at::Tensor not_nan = ~at::isnan(x.to(at::kFloat));
    for (at::ScalarType c : {at::kBFloat16, at::kHalf}) {
      INFO(dtype_case(t, c));
      const at::Tensor up = sluice::upcast(x, c, at::Tensor());
      const at::Tensor back = up.to(t).view(at::kByte);
      CHECK(at::equal(back.masked_select(not_nan), x.view(at::kByte).masked_select(not_nan)));
      // Through the storage cast as well (what restoring a layer does); it refuses e5m2's
      // infinities by design, so only finite values go through it.
      const at::Tensor finite = at::isfinite(x.to(at::kFloat));
      const sluice::StorageCast again = sluice::cast_to_storage(up.masked_select(finite), t, "roundtrip");
      CHECK(again.clipped == 0);
      CHECK(at::equal(again.stored.view(at::kByte), x.view(at::kByte).masked_select(finite)));
    }
  }
}

TEST_CASE("fp8: cast_to_storage saturates out-of-range values to +-max finite and counts them") {
  for (at::ScalarType t : kFp8) {
    const double max = sluice::fp8_max_finite(t);
    INFO(sluice::dtype_name(t));
    const at::Tensor w = at::tensor({max * 1.5, -max * 4, max, 1.0, -max * 1.01, 0.0}, at::kFloat);
    const sluice::StorageCast r = sluice::cast_to_storage(w, t, "blocks.0.mlp.layer1.weight");
    CHECK(r.clipped == 3);
    CHECK_FALSE(r.scale.defined());
    CHECK(r.stored.scalar_type() == t);
    const at::Tensor expect = at::tensor({max, -max, max, 1.0, -max, 0.0}, at::kFloat);
    CHECK(at::equal(r.stored.to(at::kFloat), expect));
  }
  // The reason the policy exists: the plain cast makes NaN out of 500.
  CHECK(at::isnan(at::tensor({500.0f}).to(at::kFloat8_e4m3fn).to(at::kFloat)).item<bool>());
  const at::Tensor bf = at::tensor({500.0f, 2.0f}).to(at::kBFloat16);
  const auto r = sluice::cast_to_storage(bf, at::kFloat8_e4m3fn, "bf16 input");
  CHECK(r.clipped == 1);
  CHECK(r.stored.to(at::kFloat)[0].item<float>() == 448.0f);
  CHECK_FALSE(at::isnan(r.stored.to(at::kFloat)).any().item<bool>());
}

TEST_CASE("fp8: refuse policy and non-finite input raise InvalidArgument naming the tensor") {
  sluice::Fp8Options refuse;
  refuse.out_of_range = sluice::OutOfRangePolicy::refuse;
  auto message_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const sluice::InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  const at::Tensor big = at::tensor({1.0f, 300.0f});
  CHECK(message_of([&] { sluice::cast_to_storage(big, at::kFloat8_e4m3fnuz, "final_layer.linear.weight", refuse); })
            .find("'final_layer.linear.weight'") != std::string::npos);
  CHECK(message_of([&] { sluice::cast_to_storage(big, at::kFloat8_e4m3fn, "fits", refuse); }).empty());

  for (float bad : {NAN, INFINITY, -INFINITY}) {
    const at::Tensor w = at::tensor({1.0f, bad, 2.0f});
    for (const sluice::Fp8Options& o : {sluice::Fp8Options{}, refuse}) {
      const std::string m = message_of([&] { sluice::cast_to_storage(w, at::kFloat8_e5m2, "x_embedder.proj.1", o); });
      CHECK(m.find("'x_embedder.proj.1'") != std::string::npos);
    }
  }
  CHECK_THROWS_AS(sluice::cast_to_storage(at::tensor({1, 2}), at::kFloat8_e4m3fn, "ids"), sluice::InvalidArgument);
}

TEST_CASE("fp8: scaled storage: per-tensor and per-channel scales, exact at the top of each row") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
  at::Tensor w = at::randn({16, 64}, gen);
  w[3] *= 5000;     // a row far beyond e4m3fn's range
  w[5].zero_();     // an all-zero row
  w[7] *= 1e-30;    // a row whose amax/448 would be a float denormal
  w = w.to(at::kBFloat16);
  const at::Tensor wf = w.to(at::kFloat);
  for (at::ScalarType t : kFp8) {
    const double max = sluice::fp8_max_finite(t);
    INFO(sluice::dtype_name(t));
    sluice::Fp8Options per_channel;
    per_channel.scale_mode = sluice::ScaleMode::per_channel;
    const auto r = sluice::cast_to_storage(w, t, "blocks.0.mlp.layer1.weight", per_channel);
    REQUIRE(r.scale.defined());
    CHECK(r.scale.sizes() == at::IntArrayRef{16});
    CHECK(r.scale.scalar_type() == at::kFloat);
    CHECK(r.clipped == 0);
    const at::Tensor amax = wf.abs().amax({1});
    CHECK(r.scale[5].item<float>() == 1.0f);
    CHECK(at::allclose(r.scale[3], amax[3] / max, 1e-6));
    const at::Tensor back = sluice::upcast(r.stored, at::kFloat, r.scale);
    CHECK_FALSE(at::isnan(back).any().item<bool>());
    // Every row's largest magnitude lands on max finite, so it comes back (nearly) exactly.
    CHECK(at::allclose(back.abs().amax({1}), amax, 1e-5, 0));
    // Relative error is bounded by the format's mantissa (e4m3: 2^-4, e5m2: 2^-3) for values
    // in the normal range of the row; check on the large row.
    const double tol = (t == at::kFloat8_e4m3fn || t == at::kFloat8_e4m3fnuz) ? 1.0 / 16 : 1.0 / 8;
    const at::Tensor row = wf[3], err = (back[3] - row).abs();
    const at::Tensor big = row.abs() > amax[3] / 8;
    CHECK((err.masked_select(big) <= row.abs().masked_select(big) * tol).all().item<bool>());
    CHECK(back[5].abs().max().item<float>() == 0.0f);

    sluice::Fp8Options per_tensor;
    per_tensor.scale_mode = sluice::ScaleMode::per_tensor;
    const auto p = sluice::cast_to_storage(w, t, "w", per_tensor);
    CHECK(p.scale.dim() == 0);
    CHECK(at::allclose(p.scale, wf.abs().max() / max, 1e-6));
    CHECK(at::allclose(sluice::upcast(p.stored, at::kFloat, p.scale).abs().max(), wf.abs().max(), 1e-5, 0));
  }
  // Biases (1-d) are stored unscaled: layers upcast them without a scale.
  sluice::Fp8Options per_channel;
  per_channel.scale_mode = sluice::ScaleMode::per_channel;
  const auto bias = sluice::cast_to_storage(at::tensor({1.0f, 2.0f}), at::kFloat8_e4m3fn, "bias", per_channel);
  CHECK_FALSE(bias.scale.defined());
  const auto zero = sluice::cast_to_storage(at::zeros({4, 4}), at::kFloat8_e4m3fn, "zeros", per_channel);
  CHECK(at::equal(zero.scale, at::ones({4})));
}

TEST_CASE("fp8: non-fp8 storage is a plain conversion") {
  const at::Tensor w = at::randn({8, 8});
  const auto r = sluice::cast_to_storage(w, at::kBFloat16, "w");
  CHECK(r.stored.scalar_type() == at::kBFloat16);
  CHECK(at::equal(r.stored, w.to(at::kBFloat16)));
  CHECK_FALSE(r.scale.defined());
  CHECK_THROWS_AS(sluice::cast_to_storage(w, at::kInt, "w"), sluice::InvalidArgument);
}

namespace {
int g_fake_calls = 0;
bool g_fake_handles = true;
bool fake_meta_upcast(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out) {
  ++g_fake_calls;
  CHECK(stored.is_contiguous());
  CHECK(out.is_contiguous());
  CHECK(out.numel() == stored.numel());
  CHECK((!scale.defined() || scale.scalar_type() == at::kFloat));
  return g_fake_handles;
}
}  // namespace

TEST_CASE("fp8: a registered device kernel receives fp8 upcasts for its device type") {
  const at::Tensor x = at::empty({8, 3}, at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(at::kMeta));
  g_fake_calls = 0;
  sluice::register_device_upcast(at::kMeta, &fake_meta_upcast);
  CHECK(sluice::device_upcast(at::kMeta) == &fake_meta_upcast);
  at::Tensor y = sluice::upcast(x, at::kBFloat16, at::Tensor());
  CHECK(g_fake_calls == 1);
  CHECK(y.scalar_type() == at::kBFloat16);
  CHECK(y.device().is_meta());
  sluice::upcast(x, at::kHalf, at::ones({8}, at::kMeta));
  CHECK(g_fake_calls == 2);
  g_fake_handles = false;  // declines: the ATen path answers
  y = sluice::upcast(x, at::kHalf, at::Tensor());
  CHECK(g_fake_calls == 3);
  CHECK(y.scalar_type() == at::kHalf);
  g_fake_handles = true;
  sluice::register_device_upcast(at::kMeta, nullptr);
  sluice::upcast(x, at::kBFloat16, at::Tensor());
  CHECK(g_fake_calls == 3);
  // CPU never consults the hook table.
  sluice::register_device_upcast(at::kCPU, &fake_meta_upcast);
  sluice::upcast(random_fp8({4}, at::kFloat8_e4m3fn, 1), at::kBFloat16, at::Tensor());
  CHECK(g_fake_calls == 3);
  sluice::register_device_upcast(at::kCPU, nullptr);
}

TEST_CASE("fp8: register_cuda_kernels installs the CUDA kernel exactly when the build has it") {
  sluice::register_device_upcast(at::kCUDA, nullptr);
  const bool installed = sluice::offload::register_cuda_kernels();
  CHECK(installed == sluice::offload::has_cuda_kernels());
  CHECK((sluice::device_upcast(at::kCUDA) != nullptr) == installed);
  CHECK(sluice::offload::register_cuda_kernels() == installed);  // idempotent
#ifdef SLUICE_HAS_CUDA
  CHECK(installed);
#else
  CHECK_FALSE(installed);
#endif
}

#ifdef SLUICE_HAS_CUDA
TEST_CASE("fp8: CUDA kernel equals the CPU tables, scaled and unscaled, aligned and not") {
  if (!at::hasCUDA()) {
    WARN("no CUDA device: CUDA kernel case skipped");
    return;
  }
  sluice::offload::register_cuda_kernels();
  for (at::ScalarType t : kFp8) {
    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{4096 * 37 + 5}}) {
      const at::Tensor host = random_fp8({n}, t, 100 + n);
      const at::Tensor dev = host.to(at::kCUDA);
      const at::Tensor scale = at::rand({1}) + 0.25;
      for (at::ScalarType c : {at::kBFloat16, at::kHalf}) {
        INFO(dtype_case(t, c) << " n=" << n);
        CHECK(same_values(sluice::upcast(dev, c, at::Tensor()).cpu(), sluice::upcast(host, c, at::Tensor())));
        CHECK(same_values(sluice::upcast(dev, c, scale.cuda()).cpu(), sluice::upcast(host, c, scale)));
        if (n > 1) {  // an offset view: pointers not 16-byte aligned
          CHECK(same_values(sluice::upcast(dev.slice(0, 1), c, at::Tensor()).cpu(),
                            sluice::upcast(host.slice(0, 1), c, at::Tensor())));
        }
      }
    }
    const at::Tensor m = random_fp8({300, 37}, t, 3);
    const at::Tensor rows = at::rand({300}) + 0.1;
    CHECK(same_values(sluice::upcast(m.cuda(), at::kBFloat16, rows.cuda()).cpu(),
                      sluice::upcast(m, at::kBFloat16, rows)));
  }
}
#endif
