#include <catch2/catch.hpp>
#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tests/support/temp_dir.h"

namespace st = sluice::safetensors;
using Bytes = std::vector<uint8_t>;

namespace {

// Note: std::filesystem is avoided on purpose. libtorch.so exports its own copy of the
// std::filesystem functions, which interposes on libstdc++'s and crashes (remove_all
// segfaults), so plain POSIX calls are used here.

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") {
        names.push_back(n);
      }
    }
    ::closedir(d);
  }
  return names;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

using sluice::testing::TempDir;  // tests/support/temp_dir.h

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

uint64_t le64(const Bytes& b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) {
    v = (v << 8) | b[i];
  }
  return v;
}

void set_le64(Bytes& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    b[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

// A file image written by hand: length prefix, header text, `data` bytes (0, 1, 2, ...).
Bytes make_image(const std::string& header, size_t data) {
  Bytes b(8);
  set_le64(b, header.size());
  b.insert(b.end(), header.begin(), header.end());
  for (size_t i = 0; i < data; ++i) {
    b.push_back(static_cast<uint8_t>(i));
  }
  return b;
}

// The dtypes of the format with their names, written out independently of the library.
const std::vector<std::pair<std::string, at::ScalarType>> kDtypes = {
    {"F64", at::kDouble}, {"F32", at::kFloat},  {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},  {"I64", at::kLong},
    {"I32", at::kInt},    {"I16", at::kShort},  {"I8", at::kChar},   {"U8", at::kByte},
    {"BOOL", at::kBool},
};

// Random bit patterns (NaNs and all), so the round trip is checked bit for bit.
at::Tensor random_tensor(at::IntArrayRef shape, at::ScalarType dtype, std::mt19937& rng) {
  at::Tensor t = at::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) {
    p[i] = static_cast<uint8_t>(dtype == at::kBool ? rng() & 1 : rng() & 0xff);
  }
  return t;
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
    return false;
  }
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() &&
         (ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0);
}

template <class F>
std::string file_error_of(F&& f) {
  try {
    f();
  } catch (const sluice::FileError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected sluice::FileError, got another exception: " << e.what());
  }
  FAIL("expected sluice::FileError, nothing was thrown");
  return {};
}

// parse_header must reject the image with a one-line FileError that names the origin and
// contains every needle (the tensor name, the kind of problem).
void check_rejected(const Bytes& image, const std::vector<std::string>& needles) {
  const std::string origin = "bad-input.safetensors";
  const std::string msg = file_error_of([&] { st::parse_header(image.data(), image.size(), origin); });
  INFO("message: " << msg);
  CHECK(msg.find(origin) != std::string::npos);
  CHECK(msg.find('\n') == std::string::npos);
  for (const auto& n : needles) {
    INFO("needle: " << n);
    CHECK(msg.find(n) != std::string::npos);
  }
}

void check_rejected(const std::string& header, size_t data, const std::vector<std::string>& needles) {
  check_rejected(make_image(header, data), needles);
}

// An entry of the header as text.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}

bool mapped_in_process(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  char resolved[PATH_MAX];
  REQUIRE(::realpath(path.c_str(), resolved) != nullptr);
  const std::string canonical = resolved;
  while (std::getline(maps, line)) {
    if (line.find(canonical) != std::string::npos) {
      return true;
    }
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Round trips

TEST_CASE("safetensors: every dtype round-trips bit-exactly, including 0-d and zero-size shapes") {
  TempDir dir;
  std::mt19937 rng(1234);
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {5}, {2, 3, 4}, {3, 0, 2}};
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> expected_name;
  for (const auto& [name, dtype] : kDtypes) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const std::string key = "t." + name + "." + std::to_string(i);
      tensors.emplace_back(key, random_tensor(shapes[i], dtype, rng));
      expected_name[key] = name;
    }
  }
  const std::string path = dir / "all.safetensors";
  st::save(path, tensors);

  auto f = st::File::open(path);
  REQUIRE(f->tensors().size() == tensors.size());
  CHECK(f->metadata().empty());
  for (const auto& [key, t] : tensors) {
    INFO(key);
    const st::TensorInfo* info = f->find(key);
    REQUIRE(info != nullptr);
    CHECK(info->dtype_name == expected_name[key]);
    CHECK(info->dtype == t.scalar_type());
    CHECK(info->shape == t.sizes().vec());
    CHECK(info->numel() == t.numel());
    CHECK(info->nbytes() == t.nbytes());
    const at::Tensor back = f->tensor(key);
    CHECK(back.device().is_cpu());
    CHECK(back.dim() == t.dim());
    CHECK(same_bytes(back, t));
  }
}

TEST_CASE("safetensors: a 64-dimensional tensor is accepted") {
  std::string dims = "[1";
  for (int i = 1; i < 64; ++i) {
    dims += i == 10 ? ",2" : ",1";
  }
  const Bytes img = make_image("{" + entry("w", "U8", dims + "]", "[0,2]") + "}", 2);
  const st::Header h = st::parse_header(img.data(), img.size(), "many-dims");
  REQUIRE(h.tensors.size() == 1);
  CHECK(h.tensors[0].shape.size() == 64);
  CHECK(h.tensors[0].numel() == 2);
}

TEST_CASE("safetensors: dtype names map both ways") {
  for (const auto& [name, dtype] : kDtypes) {
    CHECK(st::dtype_name(dtype) == name);
    CHECK(st::dtype_from_name(name, "x") == dtype);
  }
  CHECK_THROWS_AS(st::dtype_name(at::kComplexFloat), sluice::InvalidArgument);
  CHECK_THROWS_AS(st::dtype_from_name("F128", "x"), sluice::FileError);
}

TEST_CASE("safetensors: metadata round-trips") {
  TempDir dir;
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"empty", ""}, {"quoted", "a \"b\" \\ c\nd"}, {"unicode", "\xc3\xbcnic\xc3\xb8" "de"}};
  const std::string path = dir / "meta.safetensors";
  st::save(path, {{"w", at::arange(6, at::kFloat)}}, meta);
  auto f = st::File::open(path);
  CHECK(f->metadata() == meta);
  CHECK(at::equal(f->tensor("w"), at::arange(6, at::kFloat)));
}

TEST_CASE("safetensors: save writes the layout the format specifies") {
  TempDir dir;
  const std::string path = dir / "layout.safetensors";
  const at::Tensor a = at::ones({3}, at::kByte);     // 3 bytes
  const at::Tensor b = at::zeros({2, 2}, at::kHalf);  // 8 bytes
  const at::Tensor c = at::arange(5, at::kLong);      // 40 bytes
  // Deliberately not in name order: data must follow the order given.
  st::save(path, {{"z", a}, {"b", b}, {"m", c.t()}}, {{"k", "v"}});
  const Bytes img = read_bytes(path);
  const uint64_t n = le64(img);
  CHECK(n % 8 == 0);
  REQUIRE(img.size() == 8 + n + 3 + 8 + 40);
  const std::string text(img.begin() + 8, img.begin() + 8 + n);
  const auto last = text.find_last_not_of(' ');
  CHECK(text[last] == '}');  // only spaces pad the JSON
  const auto j = nlohmann::json::parse(text);
  CHECK(j["z"]["data_offsets"] == nlohmann::json::array({0, 3}));
  CHECK(j["b"]["data_offsets"] == nlohmann::json::array({3, 11}));
  CHECK(j["m"]["data_offsets"] == nlohmann::json::array({11, 51}));
  CHECK(j["b"]["dtype"] == "F16");
  CHECK(j["b"]["shape"] == nlohmann::json::array({2, 2}));
  CHECK(j["__metadata__"]["k"] == "v");
  // The int64 values sit little-endian right after the 11 bytes before them.
  for (int64_t i = 0; i < 5; ++i) {
    int64_t v = 0;
    std::memcpy(&v, img.data() + 8 + n + 11 + 8 * i, 8);
    CHECK(v == i);
  }
  // No temporary file is left beside the result.
  CHECK(list_dir(dir.path).size() == 1);
}

TEST_CASE("safetensors: save replaces an existing file") {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  st::save(path, {{"old", at::ones({4})}});
  st::save(path, {{"new", at::zeros({2})}});
  auto f = st::File::open(path);
  CHECK_FALSE(f->contains("old"));
  CHECK(f->contains("new"));
}

TEST_CASE("safetensors: a hand-written file reads as the format defines it") {
  // I16 [2,2] = [[1, 2], [-1, -32768]] little-endian, and an odd-length header.
  const std::string header = "{\"w\":{\"dtype\":\"I16\",\"shape\":[2,2],\"data_offsets\":[0,8]},"
                             "\"__metadata__\":{\"k\":\"v\"}}";
  Bytes img = make_image(header, 0);
  for (uint8_t b : {0x01, 0x00, 0x02, 0x00, 0xff, 0xff, 0x00, 0x80}) {
    img.push_back(b);
  }
  const st::Header h = st::parse_header(img.data(), img.size(), "hand");
  REQUIRE(h.tensors.size() == 1);
  CHECK(h.data_offset == 8 + header.size());
  CHECK(h.metadata.at("k") == "v");

  TempDir dir;
  write_bytes(dir / "hand.safetensors", img);
  auto f = st::File::open(dir / "hand.safetensors");
  const at::Tensor w = f->tensor("w");
  CHECK(w.scalar_type() == at::kShort);
  CHECK(at::equal(w, at::tensor({1, 2, -1, -32768}, at::kShort).reshape({2, 2})));
}

TEST_CASE("safetensors: files interoperate with the reference safetensors package") {
  TempDir dir;
  std::mt19937 rng(99);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, dtype] : kDtypes) {
    tensors.emplace_back("w." + name, random_tensor({3, 4}, dtype, rng));
    tensors.emplace_back("s." + name, random_tensor({}, dtype, rng));
  }
  tensors.emplace_back("empty", at::empty({0, 7}, at::kBFloat16));
  const std::string ours = dir / "ours.safetensors";
  const std::string theirs = dir / "theirs.safetensors";
  st::save(ours, tensors, {{"format", "pt"}});

  // The reference loads our file and writes it back with its own writer.
  const std::string script = dir / "rt.py";
  {
    std::ofstream py(script);
    py << "import sys\n"
          "from safetensors import safe_open\n"
          "from safetensors.torch import load_file, save_file\n"
          "t = load_file(sys.argv[1])\n"
          "with safe_open(sys.argv[1], 'pt') as f:\n"
          "    meta = f.metadata()\n"
          "assert meta == {'format': 'pt'}, meta\n"
          "assert t['empty'].shape == (0, 7)\n"
          "save_file(t, sys.argv[2], metadata=meta)\n";
  }
  const std::string cmd = std::string(SLUICE_PYTHON) + " " + script + " " + ours + " " + theirs;
  REQUIRE(std::system(cmd.c_str()) == 0);

  auto f = st::File::open(theirs);
  CHECK(f->tensors().size() == tensors.size());
  CHECK(f->metadata().at("format") == "pt");
  for (const auto& [key, t] : tensors) {
    INFO(key);
    REQUIRE(f->contains(key));
    CHECK(same_bytes(f->tensor(key), t));
  }
}

// ---------------------------------------------------------------------------------------
// Zero-copy views

TEST_CASE("safetensors: tensors are zero-copy views that keep the mapping alive") {
  TempDir dir;
  const std::string path = dir / "z.safetensors";
  const at::Tensor a = at::randn({16, 16});
  const at::Tensor b = at::randn({8}).to(at::kBFloat16);
  st::save(path, {{"a", a}, {"b", b}});

  auto f = st::File::open(path);
  at::Tensor v1 = f->tensor("a");
  at::Tensor v2 = f->tensor("a");
  at::Tensor vb = f->tensor("b");
  const st::TensorInfo* info = f->find("a");
  REQUIRE(info != nullptr);
  const auto* p = static_cast<const uint8_t*>(v1.data_ptr());
  // Both views point at the file's bytes in the mapping, not at copies.
  CHECK(p == f->data() + f->data_offset() + info->begin);
  CHECK(v2.data_ptr() == v1.data_ptr());
  CHECK(p >= f->data());
  CHECK(p + v1.nbytes() <= f->data() + f->file_size());
  CHECK(static_cast<const uint8_t*>(vb.data_ptr()) == f->data() + f->data_offset() + f->find("b")->begin);
  CHECK(at::equal(v1, a));

  // The views outlive the File; the mapping goes only with the last view.
  f.reset();
  CHECK(mapped_in_process(path));
  CHECK(at::equal(v1, a));
  CHECK(at::equal(vb, b));
  at::Tensor slice = v1.slice(0, 2, 4);  // a view of a view holds the mapping too
  v1.reset();
  v2.reset();
  vb.reset();
  CHECK(mapped_in_process(path));
  CHECK(at::equal(slice, a.slice(0, 2, 4)));
  slice.reset();
  CHECK_FALSE(mapped_in_process(path));
}

TEST_CASE("safetensors: a tensor whose bytes are not aligned to its element size is copied") {
  TempDir dir;
  const std::string path = dir / "u.safetensors";
  const at::Tensor pad = at::ones({1}, at::kByte);
  const at::Tensor w = at::randn({3, 5});
  st::save(path, {{"pad", pad}, {"w", w}});  // w starts 1 byte into the data section
  auto f = st::File::open(path);
  REQUIRE(f->find("w")->begin == 1);
  const at::Tensor t = f->tensor("w");
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  CHECK(reinterpret_cast<uintptr_t>(p) % 4 == 0);
  CHECK((p < f->data() || p >= f->data() + f->file_size()));
  CHECK(at::equal(t, w));
  // The byte tensor has alignment 1 and stays a view.
  CHECK(static_cast<const uint8_t*>(f->tensor("pad").data_ptr()) == f->data() + f->data_offset());
}

TEST_CASE("safetensors: asking for a missing tensor names the file and the tensor") {
  TempDir dir;
  const std::string path = dir / "m.safetensors";
  st::save(path, {{"a", at::ones({2})}});
  auto f = st::File::open(path);
  CHECK(f->find("nope") == nullptr);
  const std::string msg = file_error_of([&] { f->tensor("blocks.3.nope"); });
  CHECK(msg.find(path) != std::string::npos);
  CHECK(msg.find("blocks.3.nope") != std::string::npos);
}

// ---------------------------------------------------------------------------------------
// Writer rejections

TEST_CASE("safetensors: save rejects bad tensor lists with InvalidArgument naming the tensor") {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  const auto check_invalid = [&](const std::vector<std::pair<std::string, at::Tensor>>& ts, const std::string& name) {
    try {
      st::save(path, ts);
      FAIL("save accepted a bad tensor list");
    } catch (const sluice::InvalidArgument& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("'" + name + "'") != std::string::npos);
    }
    CHECK_FALSE(exists(path));
    CHECK(list_dir(dir.path).empty());  // no temporary left behind either
  };
  SECTION("repeated name") { check_invalid({{"w", at::ones({2})}, {"x", at::ones({1})}, {"w", at::ones({2})}}, "w"); }
  SECTION("reserved name") { check_invalid({{"__metadata__", at::ones({2})}}, "__metadata__"); }
  SECTION("unsupported dtype") { check_invalid({{"ok", at::ones({2})}, {"cplx", at::ones({2}, at::kComplexFloat)}}, "cplx"); }
  SECTION("undefined tensor") { check_invalid({{"undef", at::Tensor()}}, "undef"); }
}

TEST_CASE("safetensors: save into a missing directory is a FileError") {
  TempDir dir;
  CHECK_THROWS_AS(st::save(dir / "no/such/dir/x.safetensors", {{"a", at::ones({1})}}), sluice::FileError);
}

// ---------------------------------------------------------------------------------------
// Invalid headers: one case per class

TEST_CASE("safetensors: invalid: file too short for the header length") {
  SECTION("empty") { check_rejected(Bytes{}, {"too short"}); }
  SECTION("seven bytes") { check_rejected(Bytes(7, 0), {"too short"}); }
  SECTION("through File::open") {
    TempDir dir;
    for (size_t n : {0, 3}) {
      const std::string path = dir / ("short" + std::to_string(n));
      write_bytes(path, Bytes(n, 0));
      const std::string msg = file_error_of([&] { st::File::open(path); });
      CHECK(msg.find(path) != std::string::npos);
      CHECK(msg.find("too short") != std::string::npos);
    }
  }
}

TEST_CASE("safetensors: invalid: header length runs past the file") {
  Bytes img = make_image("{}", 0);
  SECTION("by one byte") {
    set_le64(img, 3);
    check_rejected(img, {"header length 3"});
  }
  SECTION("far") {
    set_le64(img, 1000);
    check_rejected(img, {"header length 1000"});
  }
  SECTION("beyond the cap") {
    set_le64(img, uint64_t{1} << 40);
    check_rejected(img, {"limit"});
  }
  SECTION("maximal") {
    set_le64(img, ~uint64_t{0});
    check_rejected(img, {"header length"});
  }
}

TEST_CASE("safetensors: invalid: header is not JSON") {
  SECTION("garbage") { check_rejected("{\"a\": nope}", 0, {"not valid JSON"}); }
  SECTION("cut off") { check_rejected("{\"a\":{\"dtype\":\"F32\"", 0, {"not valid JSON"}); }
  SECTION("ill-formed UTF-8") { check_rejected("{\"\xff\xfe\":{}}", 0, {"not valid JSON"}); }
  SECTION("empty header") { check_rejected("", 0, {"not valid JSON"}); }
  SECTION("NUL bytes") { check_rejected(std::string("{}\0\0", 4), 0, {"NUL"}); }
  SECTION("NUL hiding garbage") { check_rejected(std::string("{}\0 garbage", 10), 0, {"NUL"}); }
  SECTION("deep nesting") {
    check_rejected("{\"blk.w\":{\"shape\":" + std::string(100000, '[') + std::string(100000, ']') + "}}", 0,
                   {"blk.w", "nests deeper"});
  }
  SECTION("deeply nested root list") { check_rejected(std::string(100000, '['), 0, {"not a JSON object"}); }
}

TEST_CASE("safetensors: invalid: header is not an object") {
  SECTION("array") { check_rejected("[1,2]", 0, {"not a JSON object"}); }
  SECTION("string") { check_rejected("\"x\"", 0, {"not a JSON object"}); }
  SECTION("null") { check_rejected("null", 0, {"not a JSON object"}); }
  SECTION("entry not an object") { check_rejected("{\"blk.w\":[1]}", 0, {"blk.w", "not an object"}); }
  SECTION("entry missing a key") {
    check_rejected("{\"blk.w\":{\"dtype\":\"F32\",\"shape\":[]}}", 4, {"blk.w", "exactly the keys"});
  }
  SECTION("entry with an extra key") {
    check_rejected("{\"blk.w\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4],\"x\":1}}", 4,
                   {"blk.w", "exactly the keys"});
  }
}

TEST_CASE("safetensors: invalid: unknown dtype") {
  SECTION("unknown name") { check_rejected("{" + entry("blk.w", "F128", "[1]", "[0,16]") + "}", 16, {"blk.w", "F128"}); }
  SECTION("wrong case") { check_rejected("{" + entry("blk.w", "f32", "[1]", "[0,4]") + "}", 4, {"blk.w", "unknown dtype"}); }
  SECTION("not a string") {
    check_rejected("{\"blk.w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, {"blk.w", "dtype"});
  }
}

TEST_CASE("safetensors: invalid: bad shape") {
  SECTION("negative dimension") { check_rejected("{" + entry("blk.w", "F32", "[2,-1]", "[0,8]") + "}", 8, {"blk.w", "negative"}); }
  SECTION("fractional dimension") { check_rejected("{" + entry("blk.w", "F32", "[2.0]", "[0,8]") + "}", 8, {"blk.w", "integers"}); }
  SECTION("dimension past int64") {
    check_rejected("{" + entry("blk.w", "U8", "[18446744073709551615]", "[0,1]") + "}", 1, {"blk.w", "integers"});
  }
  SECTION("not a list") { check_rejected("{" + entry("blk.w", "F32", "2", "[0,8]") + "}", 8, {"blk.w", "shape"}); }
  SECTION("too many dimensions") {
    std::string dims = "[1";
    for (int i = 1; i < 65; ++i) {
      dims += ",1";
    }
    check_rejected("{" + entry("blk.w", "U8", dims + "]", "[0,1]") + "}", 1, {"blk.w", "more than 64"});
  }
  SECTION("overflowing product") {
    check_rejected("{" + entry("blk.w", "F32", "[4294967296,4294967296]", "[0,8]") + "}", 8, {"blk.w", "overflow"});
  }
  SECTION("overflowing product hidden by a zero") {
    check_rejected("{" + entry("blk.w", "F32", "[4294967296,4294967296,0]", "[0,0]") + "}", 0, {"blk.w", "overflow"});
  }
}

TEST_CASE("safetensors: invalid: shape and byte range disagree") {
  SECTION("too few bytes") { check_rejected("{" + entry("blk.w", "F32", "[3]", "[0,8]") + "}", 8, {"blk.w", "needs 12 bytes"}); }
  SECTION("too many bytes") { check_rejected("{" + entry("blk.w", "BF16", "[2]", "[0,8]") + "}", 8, {"blk.w", "needs 4 bytes"}); }
  SECTION("zero-size shape with bytes") { check_rejected("{" + entry("blk.w", "F32", "[0,2]", "[0,8]") + "}", 8, {"blk.w", "needs 0 bytes"}); }
}

TEST_CASE("safetensors: invalid: data_offsets malformed or out of range") {
  SECTION("past the data") { check_rejected("{" + entry("blk.w", "F32", "[4]", "[0,16]") + "}", 8, {"blk.w", "past the end"}); }
  SECTION("backwards") { check_rejected("{" + entry("blk.w", "F32", "[0]", "[8,0]") + "}", 8, {"blk.w", "backwards"}); }
  SECTION("negative") { check_rejected("{" + entry("blk.w", "F32", "[2]", "[-8,0]") + "}", 8, {"blk.w", "data_offsets"}); }
  SECTION("three values") { check_rejected("{" + entry("blk.w", "F32", "[2]", "[0,8,8]") + "}", 8, {"blk.w", "data_offsets"}); }
  SECTION("not integers") { check_rejected("{" + entry("blk.w", "F32", "[2]", "[\"0\",8]") + "}", 8, {"blk.w", "data_offsets"}); }
}

TEST_CASE("safetensors: invalid: overlapping ranges") {
  SECTION("partial overlap") {
    check_rejected("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("blk.b", "F32", "[2]", "[4,12]") + "}", 12,
                   {"blk.b", "overlap", "'a'"});
  }
  SECTION("same range twice") {
    check_rejected("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("blk.b", "F32", "[2]", "[0,8]") + "}", 8,
                   {"overlap"});
  }
  SECTION("empty tensor inside another") {
    check_rejected("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("blk.e", "F32", "[0]", "[4,4]") + "}", 8,
                   {"blk.e", "overlap"});
  }
}

TEST_CASE("safetensors: invalid: hole in the data section") {
  SECTION("between tensors") {
    check_rejected("{" + entry("a", "F32", "[1]", "[0,4]") + "," + entry("blk.b", "F32", "[1]", "[8,12]") + "}", 12,
                   {"blk.b", "hole", "[4, 8)"});
  }
  SECTION("before the first tensor") {
    check_rejected("{" + entry("blk.a", "F32", "[1]", "[4,8]") + "}", 8, {"blk.a", "hole"});
  }
}

TEST_CASE("safetensors: invalid: trailing bytes after the last tensor") {
  SECTION("after a tensor") { check_rejected("{" + entry("a", "F32", "[1]", "[0,4]") + "}", 7, {"3 trailing bytes"}); }
  SECTION("no tensors at all") { check_rejected("{}", 5, {"5 trailing bytes"}); }
}

TEST_CASE("safetensors: invalid: duplicate names") {
  SECTION("tensor name twice") {
    check_rejected("{" + entry("blk.w", "F32", "[1]", "[0,4]") + "," + entry("blk.w", "F32", "[1]", "[0,4]") + "}", 4,
                   {"blk.w", "twice"});
  }
  SECTION("key twice inside an entry") {
    check_rejected("{\"blk.w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                   {"blk.w", "'dtype' appears twice"});
  }
  SECTION("metadata key twice") {
    check_rejected("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0, {"twice"});
  }
}

TEST_CASE("safetensors: invalid: bad metadata") {
  SECTION("non-string value") { check_rejected("{\"__metadata__\":{\"step\":1000}}", 0, {"__metadata__", "step", "not a string"}); }
  SECTION("not an object") { check_rejected("{\"__metadata__\":[\"a\"]}", 0, {"__metadata__", "not an object"}); }
  SECTION("null") { check_rejected("{\"__metadata__\":null}", 0, {"__metadata__"}); }
}

TEST_CASE("safetensors: File::open reports unopenable paths with their name") {
  TempDir dir;
  SECTION("missing") {
    const std::string path = dir / "missing.safetensors";
    CHECK(file_error_of([&] { st::File::open(path); }).find(path) != std::string::npos);
  }
  SECTION("directory") {
    CHECK(file_error_of([&] { st::File::open(dir.path); }).find("not a regular file") != std::string::npos);
  }
  SECTION("FIFO does not block") {
    const std::string path = dir / "fifo";
    REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
    CHECK(file_error_of([&] { st::File::open(path); }).find("not a regular file") != std::string::npos);
  }
  SECTION("corrupt header names the path") {
    const std::string path = dir / "corrupt.safetensors";
    write_bytes(path, make_image("{" + entry("blk.w", "F32", "[3]", "[0,8]") + "}", 8));
    const std::string msg = file_error_of([&] { st::File::open(path); });
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find("blk.w") != std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------
// Randomized mutations

namespace {

// Applies one random corruption: bit flips, byte pokes with JSON-significant characters,
// truncation, extension, header-length edits, splices from other files, and edits inside
// the header that keep the length prefix consistent (so the JSON parser sees them).
void mutate(Bytes& img, const std::vector<Bytes>& pool, std::mt19937_64& rng) {
  const auto below = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
  const uint64_t hlen = img.size() >= 8 ? le64(img) : 0;
  const size_t hend = static_cast<size_t>(std::min<uint64_t>(img.size(), 8 + std::min<uint64_t>(hlen, img.size())));
  const bool has_header = img.size() >= 8 && hend > 8;
  // Mostly aim at the header: that is where the parser's decisions are.
  const auto pos = [&]() -> size_t {
    if (has_header && below(10) < 7) {
      return 8 + below(hend - 8);
    }
    return below(img.size());
  };
  static const std::string kSignificant = "{}[]\",:-.0123456789eE \\ntf";
  switch (below(8)) {
    case 0:
      if (!img.empty()) {
        img[pos()] ^= static_cast<uint8_t>(1u << below(8));
      }
      break;
    case 1:
      if (!img.empty()) {
        img[pos()] = below(3) == 0 ? static_cast<uint8_t>(rng()) : static_cast<uint8_t>(kSignificant[below(kSignificant.size())]);
      }
      break;
    case 2:
      img.resize(below(img.size() + 1));
      break;
    case 3:
      for (uint64_t i = 0, n = 1 + below(16); i < n; ++i) {
        img.push_back(static_cast<uint8_t>(rng()));
      }
      break;
    case 4:
      if (img.size() >= 8) {
        const uint64_t options[] = {rng(), img.size() - 8 + below(16), hlen + 1 + below(8), hlen - 1 - below(8), 0,
                                    img.size() - 8, uint64_t{1} << (below(64))};
        set_le64(img, options[below(7)]);
      }
      break;
    case 5: {  // overwrite with a chunk of another (or the same) file
      const Bytes& src = pool[below(pool.size())];
      if (src.empty() || img.empty()) {
        break;
      }
      const size_t from = below(src.size());
      const size_t len = std::min<size_t>(1 + below(32), src.size() - from);
      const size_t to = pos();
      for (size_t i = 0; i < len && to + i < img.size(); ++i) {
        img[to + i] = src[from + i];
      }
      break;
    }
    case 6: {  // insert or delete a chunk inside the header, fixing the length prefix
      if (!has_header) {
        break;
      }
      const size_t at = 8 + below(hend - 8);
      if (below(2) == 0) {
        const Bytes& src = pool[below(pool.size())];
        const size_t from = below(src.size());
        const size_t len = std::min<size_t>(1 + below(24), src.size() - from);
        img.insert(img.begin() + at, src.begin() + from, src.begin() + from + len);
        set_le64(img, hlen + len);
      } else {
        const size_t len = std::min<size_t>(1 + below(8), hend - at);
        img.erase(img.begin() + at, img.begin() + at + len);
        set_le64(img, hlen - len);
      }
      break;
    }
    case 7: {  // change a number in the header
      if (!has_header) {
        break;
      }
      std::vector<size_t> digits;
      for (size_t i = 8; i < hend; ++i) {
        if (img[i] >= '0' && img[i] <= '9') {
          digits.push_back(i);
        }
      }
      if (!digits.empty()) {
        img[digits[below(digits.size())]] = static_cast<uint8_t>('0' + below(10));
      }
      break;
    }
  }
}

// What every accepted header must guarantee to File::tensor.
std::string invariant_violation(const st::Header& h, uint64_t size) {
  if (h.data_offset < 8 || h.data_offset > size) {
    return "data_offset outside the file";
  }
  const uint64_t data = size - h.data_offset;
  uint64_t covered = 0;
  for (const auto& t : h.tensors) {
    if (t.begin > t.end || t.end > data) {
      return "range of '" + t.name + "' outside the data";
    }
    if (static_cast<uint64_t>(t.numel()) * c10::elementSize(t.dtype) != t.nbytes()) {
      return "size of '" + t.name + "' disagrees with its range";
    }
    covered += t.nbytes();
  }
  return covered == data ? "" : "ranges do not tile the data";
}

}  // namespace

TEST_CASE("safetensors: randomly corrupted files are parsed validly or rejected with FileError") {
  TempDir dir;
  std::mt19937 trng(5);
  std::vector<Bytes> pool;
  {
    const std::string p0 = dir / "v0", p1 = dir / "v1", p2 = dir / "v2";
    st::save(p0, {{"blocks.0.attn.q.weight", random_tensor({8, 8}, at::kBFloat16, trng)},
                  {"blocks.0.attn.q.bias", random_tensor({8}, at::kFloat, trng)},
                  {"blocks.0.norm.scale", random_tensor({8}, at::kFloat8_e4m3fn, trng)}},
             {{"format", "pt"}, {"note", "x"}});
    st::save(p1, {{"a", random_tensor({}, at::kLong, trng)},
                  {"b", random_tensor({0, 3}, at::kHalf, trng)},
                  {"c", random_tensor({5}, at::kBool, trng)},
                  {"d", random_tensor({2, 3}, at::kShort, trng)}});
    st::save(p2, {{"pad", random_tensor({3}, at::kByte, trng)},  // makes the rest unaligned
                  {"w", random_tensor({4, 2}, at::kDouble, trng)},
                  {"e5", random_tensor({6}, at::kFloat8_e5m2, trng)}});
    for (const auto& p : {p0, p1, p2}) {
      pool.push_back(read_bytes(p));
      REQUIRE_NOTHROW(st::File::open(p));
    }
  }

  std::mt19937_64 rng(20240601);
  int valid = 0, rejected = 0, valid_files = 0;
  std::string failure;
  const std::string file = dir / "mutant.safetensors";
  constexpr int kBufferCases = 4000;
  constexpr int kFileCases = 300;
  for (int i = 0; i < kBufferCases + kFileCases && failure.empty(); ++i) {
    Bytes img = pool[rng() % pool.size()];
    for (uint64_t m = 0, n = 1 + rng() % 3; m < n; ++m) {
      mutate(img, pool, rng);
    }
    const bool through_file = i >= kBufferCases;
    try {
      if (!through_file) {
        const st::Header h = st::parse_header(img.data(), img.size(), "mutant");
        failure = invariant_violation(h, img.size());
      } else {
        write_bytes(file, img);
        auto f = st::File::open(file);
        st::Header h;
        h.tensors = f->tensors();
        h.data_offset = f->data_offset();
        failure = invariant_violation(h, img.size());
        // Read every byte of every tensor and compare with the image.
        for (const auto& info : f->tensors()) {
          const at::Tensor t = f->tensor(info.name).contiguous();
          if (t.nbytes() != info.nbytes() ||
              (info.nbytes() > 0 &&
               std::memcmp(t.data_ptr(), img.data() + f->data_offset() + info.begin, info.nbytes()) != 0)) {
            failure = "bytes of '" + info.name + "' differ from the file";
          }
        }
      }
      ++valid;
      valid_files += through_file ? 1 : 0;
    } catch (const sluice::FileError& e) {
      ++rejected;
      const std::string msg = e.what();
      if (msg.find(through_file ? file : "mutant") == std::string::npos || msg.find('\n') != std::string::npos) {
        failure = "bad message: " + msg;
      }
    } catch (const std::exception& e) {
      failure = std::string("wrong exception type: ") + e.what();
    }
    if (!failure.empty()) {
      failure = "case " + std::to_string(i) + ": " + failure;
    }
  }
  INFO("valid " << valid << " (" << valid_files << " through File::open), rejected " << rejected);
  REQUIRE(failure == "");
  // Both outcomes must occur, or the mutations are not exercising the parser. Most
  // mutations aim at the header, so about 3% survive (flips in the data, in padding).
  CHECK(valid > 50);
  CHECK(valid_files > 3);
  CHECK(rejected > 3000);
}
