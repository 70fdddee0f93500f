// The fused read (runtime/fused_read.h): bytes and scales against cast_to_storage, the
// checked ATen cast, for every dtype pair it takes; chunking and threads; errors.
#include <ATen/ATen.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/fp8.h"
#include "runtime/fused_read.h"
#include "runtime/host_memory.h"
#include "runtime/safetensors.h"

using namespace sluice;
using sluice::testing::TempDir;
namespace st = sluice::safetensors;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

namespace {

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// Every finite bit pattern of a 16-bit float dtype, shaped [rows, n / rows].
at::Tensor all_finite_16(at::ScalarType t) {
  const at::Tensor bits = at::arange(0, 65536, at::kInt).to(at::kShort);  // wraps to int16 patterns
  const at::Tensor v = bits.view(t);
  const at::Tensor keep = at::isfinite(v.to(at::kFloat));
  at::Tensor finite = v.masked_select(keep);
  const int64_t n = finite.numel() / 64 * 64;
  return finite.slice(0, 0, n).reshape({64, n / 64}).contiguous();
}

// Reads `names` of `path` into `dtype` through read_tensors.
std::vector<st::ReadTarget> read(const std::string& path, const std::vector<std::string>& names, at::ScalarType dtype,
                                 ScaleMode mode, const st::FusedReadOptions& o = {}, st::FusedReadStats* stats = nullptr) {
  const auto f = st::File::open(path);
  std::vector<st::ReadTarget> targets;
  for (const auto& n : names) {
    st::ReadTarget t;
    t.source = f->find(n);
    REQUIRE(t.source != nullptr);
    t.name = n;
    t.dst = host_empty(t.source->shape, dtype);
    t.scale_mode = mode;
    targets.push_back(std::move(t));
  }
  const st::FusedReadStats s = st::read_tensors(*f, targets, o);
  if (stats != nullptr) *stats = s;
  return targets;
}

std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("fused read: bf16 and fp16 to fp8 match cast_to_storage for every finite bit pattern") {
  TempDir dir;
  for (const at::ScalarType src : {at::kBFloat16, at::kHalf}) {
    for (const at::ScalarType fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz}) {
      CAPTURE(src, fp8);
      const at::Tensor w = all_finite_16(src);
      const at::Tensor bias = w.select(0, 3).contiguous();
      const std::string path = dir / "all.safetensors";
      st::save(path, {{"w", w}, {"b", bias}});
      for (const ScaleMode mode : {ScaleMode::none, ScaleMode::per_tensor, ScaleMode::per_channel}) {
        CAPTURE(static_cast<int>(mode));
        Fp8Options o;
        o.scale_mode = mode;
        const StorageCast ref = cast_to_storage(w, fp8, "w", o);
        const StorageCast ref_b = cast_to_storage(bias, fp8, "b", o);
        st::FusedReadStats stats;
        const auto got = read(path, {"w", "b"}, fp8, mode, {}, &stats);
        CHECK(same_bytes(got[0].dst, ref.stored));
        CHECK(same_bytes(got[1].dst, ref_b.stored));
        CHECK(got[0].clipped == ref.clipped);
        CHECK(got[1].clipped == ref_b.clipped);
        CHECK(got[0].cast);
        CHECK(stats.cast == 2);
        CHECK(got[0].scale.defined() == ref.scale.defined());
        if (ref.scale.defined()) CHECK(same_bytes(got[0].scale, ref.scale));
        CHECK_FALSE(got[1].scale.defined());  // 1-d: never scaled, as cast_to_storage
      }
      // Values beyond the range exist in every pair here (bf16/fp16 reach far past 448 and
      // 240; e5m2's 57344 is below fp16's 65504), so saturation was exercised.
      CHECK(cast_to_storage(w, fp8, "w").clipped > 0);
    }
  }
}

TEST_CASE("fused read: fp32 to fp8 with zero rows, outliers and tiny values matches cast_to_storage") {
  TempDir dir;
  at::manual_seed(3);
  at::Tensor w = at::randn({37, 129}, at::kFloat) * 50;
  w[4] = 0;                      // an all-zero row: scale 1
  w[5][7] = 1e6;                 // far out of range
  w[6] = at::full({129}, 1e-42);  // denormal rows: the FLT_MIN floor of the scale
  w[7][0] = -700;
  const std::string path = dir / "f32.safetensors";
  st::save(path, {{"w", w}});
  for (const at::ScalarType fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    for (const ScaleMode mode : {ScaleMode::none, ScaleMode::per_tensor, ScaleMode::per_channel}) {
      CAPTURE(fp8, static_cast<int>(mode));
      Fp8Options o;
      o.scale_mode = mode;
      const StorageCast ref = cast_to_storage(w, fp8, "w", o);
      const auto got = read(path, {"w"}, fp8, mode);
      CHECK(same_bytes(got[0].dst, ref.stored));
      CHECK(got[0].clipped == ref.clipped);
      if (ref.scale.defined()) CHECK(same_bytes(got[0].scale, ref.scale));
    }
  }
}

TEST_CASE("fused read: chunking and threads do not change a byte") {
  TempDir dir;
  at::manual_seed(4);
  Tensors tensors;
  for (int i = 0; i < 6; ++i) {
    at::Tensor t = (at::randn({33 + i, 65}, at::kFloat) * (i * 100 + 1)).to(at::kBFloat16);
    tensors.emplace_back("t" + std::to_string(i), t);
  }
  tensors.emplace_back("empty", at::empty({0, 8}, at::kBFloat16));
  tensors.emplace_back("scalar", at::full({}, 3.5, at::kBFloat16));
  const std::string path = dir / "many.safetensors";
  st::save(path, tensors);
  std::vector<std::string> names;
  for (const auto& [n, t] : tensors) names.push_back(n);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat8_e4m3fn}) {
    for (const ScaleMode mode : {ScaleMode::none, ScaleMode::per_tensor, ScaleMode::per_channel}) {
      CAPTURE(dtype, static_cast<int>(mode));
      st::FusedReadOptions whole;
      whole.threads = 1;
      whole.chunk_bytes = uint64_t{1} << 30;
      st::FusedReadStats one;
      const auto ref = read(path, names, dtype, mode, whole, &one);
      // 70 bytes: chunks end mid-row and mid-element pair; a per-channel chunk holds one row.
      st::FusedReadOptions small;
      small.threads = 4;
      small.chunk_bytes = 70;
      std::vector<uint64_t> seen;
      small.progress = [&](uint64_t done) { seen.push_back(done); };
      st::FusedReadStats many;
      const auto got = read(path, names, dtype, mode, small, &many);
      CHECK(many.threads == 4);
      CHECK(many.chunks > one.chunks * 10);
      for (size_t i = 0; i < names.size(); ++i) {
        CAPTURE(names[i]);
        CHECK(same_bytes(got[i].dst, ref[i].dst));
        CHECK(got[i].scale.defined() == ref[i].scale.defined());
        if (ref[i].scale.defined()) CHECK(same_bytes(got[i].scale, ref[i].scale));
      }
      if (dtype == at::kBFloat16) {
        for (size_t i = 0; i < names.size(); ++i) CHECK(same_bytes(got[i].dst, tensors[i].second));
        CHECK_FALSE(got[0].cast);
      }
      REQUIRE_FALSE(seen.empty());
      CHECK(std::is_sorted(seen.begin(), seen.end()));
      CHECK(seen.back() <= many.bytes_read);
      // Per-tensor scaled targets (the non-empty 2-d ones) are read twice: amax first.
      const bool twice = dtype != at::kBFloat16 && mode == ScaleMode::per_tensor;
      uint64_t expected = 0;
      for (const auto& [n, t] : tensors) expected += t.nbytes() * (twice && t.dim() == 2 ? 2 : 1);
      CHECK(many.bytes_read == expected);
    }
  }
}

TEST_CASE("fused read: NaN/Inf values and out-of-range values under refuse name the tensor") {
  TempDir dir;
  at::Tensor good = at::ones({4, 16}, at::kBFloat16);
  at::Tensor bad = at::ones({4, 16}, at::kBFloat16);
  bad[1][2] = std::numeric_limits<float>::quiet_NaN();
  bad[3][0] = std::numeric_limits<float>::infinity();
  at::Tensor big = at::ones({4, 16}, at::kBFloat16);
  big[0][0] = 1000;
  big[2][5] = -470;  // rounds into e4m3fn's NaN pattern without the clamp
  const std::string path = dir / "bad.safetensors";
  st::save(path, {{"good", good}, {"blocks.0.bad", bad}, {"big", big}});
  for (const ScaleMode mode : {ScaleMode::none, ScaleMode::per_tensor, ScaleMode::per_channel}) {
    st::FusedReadOptions o;
    o.threads = 2;
    o.chunk_bytes = 32;
    const std::string msg = error_text([&] { read(path, {"good", "blocks.0.bad"}, at::kFloat8_e4m3fn, mode, o); });
    CHECK_THAT(msg, Catch::Contains("blocks.0.bad") && Catch::Contains("1 NaN and 1 inf"));
  }
  // Saturated by default, counted, and equal to the checked cast.
  const auto sat = read(path, {"big"}, at::kFloat8_e4m3fn, ScaleMode::none);
  CHECK(sat[0].clipped == 2);
  CHECK(same_bytes(sat[0].dst, cast_to_storage(big, at::kFloat8_e4m3fn, "big").stored));
  st::FusedReadOptions refuse;
  refuse.out_of_range = OutOfRangePolicy::refuse;
  const std::string msg = error_text([&] { read(path, {"good", "big"}, at::kFloat8_e4m3fn, ScaleMode::none, refuse); });
  CHECK_THAT(msg, Catch::Contains("'big'") && Catch::Contains("2 of 64 values beyond"));
  // Scaled storage has no out-of-range values.
  CHECK_NOTHROW(read(path, {"big"}, at::kFloat8_e4m3fn, ScaleMode::per_channel, refuse));
}

TEST_CASE("fused read: fp8 bytes are copied as they are and NaN/Inf bytes are refused") {
  TempDir dir;
  at::Tensor w = at::randn({8, 32}, at::kFloat).to(at::kFloat8_e4m3fn);
  at::Tensor e5 = at::randn({8, 32}, at::kFloat).to(at::kFloat8_e5m2);
  const std::string path = dir / "fp8.safetensors";
  st::save(path, {{"w", w}, {"e5", e5}});
  const auto got = read(path, {"w"}, at::kFloat8_e4m3fn, ScaleMode::per_channel);
  CHECK(same_bytes(got[0].dst, w));
  CHECK_FALSE(got[0].cast);
  CHECK_FALSE(got[0].scale.defined());  // a copy is never rescaled
  CHECK(same_bytes(read(path, {"e5"}, at::kFloat8_e5m2, ScaleMode::none)[0].dst, e5));

  w.view(at::kByte).view(-1)[17] = 0xFF;  // e4m3fn -NaN
  e5.view(at::kByte).view(-1)[3] = 0x7C;  // e5m2 +inf
  e5.view(at::kByte).view(-1)[4] = 0x7E;  // e5m2 NaN
  st::save(path, {{"w", w}, {"e5", e5}});
  CHECK_THAT(error_text([&] { read(path, {"w"}, at::kFloat8_e4m3fn, ScaleMode::none); }),
             Catch::Contains("'w'") && Catch::Contains("1 NaN and 0 inf"));
  CHECK_THAT(error_text([&] { read(path, {"e5"}, at::kFloat8_e5m2, ScaleMode::none); }),
             Catch::Contains("'e5'") && Catch::Contains("1 NaN and 1 inf"));

  // The byte check both paths use (count_fp8_non_finite), for every dtype; safetensors
  // has no fnuz dtype, so those are checked on bytes: 0x80 is their only NaN, and 0x7F /
  // 0xFF are their largest finite values.
  const uint8_t bytes[] = {0x7F, 0xFF, 0x80, 0x7C, 0x7E, 0x00, 0xFC};
  const auto e4 = count_fp8_non_finite(at::kFloat8_e4m3fn, bytes, 7);
  CHECK((e4.nans == 2 && e4.infs == 0));
  const auto e5b = count_fp8_non_finite(at::kFloat8_e5m2, bytes, 7);
  CHECK((e5b.nans == 3 && e5b.infs == 2));
  for (const at::ScalarType fnuz : {at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz}) {
    const auto r = count_fp8_non_finite(fnuz, bytes, 7);
    CHECK((r.nans == 1 && r.infs == 0));
  }
}

TEST_CASE("fused read: a file truncated after open and an injected read error are FileErrors") {
  TempDir dir;
  Tensors tensors;
  for (int i = 0; i < 8; ++i) tensors.emplace_back("t" + std::to_string(i), at::randn({64, 64}).to(at::kBFloat16));
  const std::string path = dir / "cut.safetensors";
  st::save(path, tensors);
  std::vector<std::string> names;
  for (const auto& [n, t] : tensors) names.push_back(n);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat8_e4m3fn}) {
    st::save(path, tensors);
    const auto f = st::File::open(path);
    std::vector<st::ReadTarget> targets;
    for (const auto& n : names) {
      st::ReadTarget t;
      t.source = f->find(n);
      t.name = n;
      t.dst = host_empty({64, 64}, dtype);
      targets.push_back(std::move(t));
    }
    struct stat s {};
    REQUIRE(::stat(path.c_str(), &s) == 0);
    REQUIRE(::truncate(path.c_str(), s.st_size / 2) == 0);
    st::FusedReadOptions o;
    o.threads = 3;
    o.chunk_bytes = 1000;
    try {
      st::read_tensors(*f, targets, o);
      FAIL("no error");
    } catch (const FileError& e) {
      CHECK_THAT(e.what(), Catch::Contains(path) && Catch::Contains("truncated"));
    }
  }
  st::save(path, tensors);
  fault::ScopedFault fault("safetensors.read", fault::Trigger{5, 1});
  st::FusedReadOptions o;
  o.threads = 2;
  o.chunk_bytes = 4096;
  try {
    read(path, names, at::kFloat8_e4m3fn, ScaleMode::none, o);
    FAIL("no error");
  } catch (const FileError& e) {
    CHECK_THAT(e.what(), Catch::Contains("injected fault"));
  }
  CHECK(fault.fired() == 1);
}

TEST_CASE("fused read: targets it cannot read are refused before any byte is read") {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  st::save(path, {{"w", at::ones({4, 4}, at::kBFloat16)}, {"q", at::ones({4, 4}, at::kFloat8_e4m3fn)}});
  const auto f = st::File::open(path);
  auto attempt = [&](const std::string& name, at::Tensor dst) {
    std::vector<st::ReadTarget> t(1);
    t[0].source = f->find(name);
    t[0].name = name;
    t[0].dst = std::move(dst);
    return error_text([&] { st::read_tensors(*f, t); });
  };
  CHECK_THAT(attempt("w", at::empty({4, 4}, at::kInt)), Catch::Contains("cannot read bfloat16 into int32"));
  CHECK_THAT(attempt("q", at::empty({4, 4}, at::kFloat8_e5m2)), Catch::Contains("cannot read float8_e4m3fn"));
  CHECK_THAT(attempt("w", at::empty({4, 5}, at::kBFloat16)), Catch::Contains("16 elements"));
  CHECK_THAT(attempt("w", at::empty({4, 8}, at::kBFloat16).slice(1, 0, 4)), Catch::Contains("contiguous"));
  CHECK(st::can_fuse(at::kBFloat16, at::kFloat8_e4m3fn));
  CHECK(st::can_fuse(at::kFloat, at::kFloat8_e5m2));
  CHECK_FALSE(st::can_fuse(at::kFloat8_e5m2, at::kFloat8_e4m3fn));
  CHECK(st::can_fuse(at::kBFloat16, at::kHalf));
  CHECK(st::can_fuse(at::kFloat8_e5m2, at::kFloat));
  CHECK_FALSE(st::can_fuse(at::kChar, at::kBFloat16));
  CHECK_FALSE(st::can_fuse(at::kBFloat16, at::kBool));
  CHECK_FALSE(st::can_fuse(at::kDouble, at::kFloat));
  CHECK(st::resolve_threads(3) == 3);
  CHECK(st::resolve_threads(0) >= 1);
}

TEST_CASE("fused read: every float dtype into bfloat16, float16 and float32 matches the checked cast byte for byte") {
  // Issue 29, item 3: loads into a non-fp8 dtype are converted in the read, with the same
  // checks as fp8 storage (NaN/Inf refused, values beyond the destination's range saturated).
  TempDir dir;
  const std::string path = dir / "src.safetensors";
  at::manual_seed(4);
  const at::Tensor f32 = at::cat({at::randn({60, 64}) * 30, at::tensor({3.39e38f, -3.4e38f, 70000.0f, -65519.0f,
                                                                          65520.0f, 1e-40f, -0.0f, 1.0f})
                                                                   .repeat({64})
                                                                   .reshape({8, 64})})
                         .contiguous();
  const Tensors sources = {{"bf16", all_finite_16(at::kBFloat16)},
                           {"f16", all_finite_16(at::kHalf)},
                           {"f32", f32},
                           {"e4", (at::randn({16, 64}) * 100).clamp(-448, 448).to(at::kFloat8_e4m3fn)},
                           {"e5", (at::randn({16, 64}) * 1000).to(at::kFloat8_e5m2)}};
  st::save(path, sources);
  for (const auto& [name, src] : sources) {
    for (const at::ScalarType dst : {at::kBFloat16, at::kHalf, at::kFloat}) {
      if (src.scalar_type() == dst) continue;
      CAPTURE(name, dst);
      st::FusedReadOptions o;
      o.threads = 3;
      o.chunk_bytes = 1000;  // chunks that split rows
      st::FusedReadStats stats;
      const auto got = read(path, {name}, dst, ScaleMode::none, o, &stats);
      const StorageCast want = cast_to_storage(src, dst, name);
      CHECK(same_bytes(got[0].dst, want.stored));
      CHECK(got[0].clipped == want.clipped);
      CHECK(got[0].cast);
      CHECK(stats.cast == 1);
    }
  }
  // float16 from float32 saturates what is beyond 65504 (5 of the 8 values, 64 times each:
  // 65519 rounds down to it and is counted too, as for fp8), and so does bfloat16 from
  // float32 beyond 3.3895e38 (3.39e38 rounds down to it, -3.4e38 would round to -inf).
  CHECK(read(path, {"f32"}, at::kHalf, ScaleMode::none)[0].clipped == 64 * 5);
  CHECK(read(path, {"f32"}, at::kBFloat16, ScaleMode::none)[0].clipped == 64 * 2);
  st::FusedReadOptions refuse;
  refuse.out_of_range = OutOfRangePolicy::refuse;
  CHECK_THAT(error_text([&] { read(path, {"f32"}, at::kHalf, ScaleMode::none, refuse); }),
             Catch::Contains("'f32'") && Catch::Contains("beyond +-65504"));
}

TEST_CASE("fused read: NaN and Inf are refused naming the file and the tensor whatever the dtype read into") {
  // Issue 29, item 3: a bf16 tensor read as bf16 was copied with no look at its values.
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  Tensors tensors;
  for (const at::ScalarType t : {at::kBFloat16, at::kHalf, at::kFloat}) {
    at::Tensor bad = at::ones({8, 64}, t);
    bad[1][2] = std::numeric_limits<float>::quiet_NaN();
    bad[7][63] = -std::numeric_limits<float>::infinity();
    tensors.emplace_back("blocks.0.bad_" + dtype_name(t), bad);
  }
  at::Tensor e5 = at::ones({8, 64}, at::kFloat8_e5m2);
  e5.view(at::kByte).view(-1)[3] = 0x7C;    // +inf
  e5.view(at::kByte).view(-1)[300] = 0xFE;  // NaN
  tensors.emplace_back("blocks.0.bad_e5", e5);
  st::save(path, tensors);
  for (const auto& [name, src] : tensors) {
    for (const at::ScalarType dst : {src.scalar_type(), at::kBFloat16, at::kHalf, at::kFloat, at::kFloat8_e4m3fn}) {
      if (!st::can_fuse(src.scalar_type(), dst)) continue;
      CAPTURE(name, dst);
      st::FusedReadOptions o;
      o.threads = 2;
      o.chunk_bytes = 128;
      const std::string msg = error_text([&] { read(path, {name}, dst, ScaleMode::none, o); });
      CHECK_THAT(msg, Catch::Contains("file '" + path + "'") && Catch::Contains("'" + name + "'") &&
                          Catch::Contains("1 NaN and 1 inf"));
    }
  }
}

TEST_CASE("fused read: a tensor that is not floating-point is refused naming its dtype") {
  TempDir dir;
  const std::string path = dir / "ints.safetensors";
  st::save(path, {{"w", at::ones({4, 4}, at::kChar)}, {"b", at::ones({4}, at::kBool)}});
  const auto f = st::File::open(path);
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, std::string>>{{"w", "int8"}, {"b", "bool"}}) {
    std::vector<st::ReadTarget> t(1);
    t[0].source = f->find(name);
    t[0].name = name;
    t[0].dst = at::empty(t[0].source->shape, at::kBFloat16);
    CHECK_THAT(error_text([&] { st::read_tensors(*f, t); }),
               Catch::Contains("'" + name + "'") && Catch::Contains("has dtype " + dtype) &&
                   Catch::Contains("expected a floating-point tensor"));
  }
}
