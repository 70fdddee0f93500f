#include "runtime/safetensors.h"

#include <ATen/core/grad_mode.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_set>

#include "runtime/error.h"
#include "runtime/progress.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"

static_assert(sizeof(size_t) == 8, "safetensors mapping needs a 64-bit address space");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; views assume the host matches");

namespace sluice::safetensors {
namespace {

using json = nlohmann::json;

// Names and parser messages come from the file: escape control bytes and cap the
// length so an error stays one readable line.
std::string printable(const std::string& s) {
  constexpr size_t kMax = 160;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMax) {
    out += "...";
  }
  return out;
}

[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw FileError("safetensors file '" + origin + "': " + what);
}

[[noreturn]] void fail_tensor(const std::string& origin, const std::string& name, const std::string& what) {
  throw FileError("safetensors file '" + origin + "': tensor '" + printable(name) + "': " + what);
}

struct DtypeEntry {
  const char* name;
  at::ScalarType type;
};

constexpr DtypeEntry kDtypes[] = {
    {"F64", at::kDouble},           {"F32", at::kFloat},          {"F16", at::kHalf},
    {"BF16", at::kBFloat16},        {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
    {"I64", at::kLong},             {"I32", at::kInt},            {"I16", at::kShort},
    {"I8", at::kChar},              {"U8", at::kByte},            {"BOOL", at::kBool},
};

const DtypeEntry* find_dtype(const std::string& name) {
  for (const auto& e : kDtypes) {
    if (name == e.name) {
      return &e;
    }
  }
  return nullptr;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  std::memcpy(&v, p, sizeof v);  // host is little-endian (static_assert above)
  return v;
}

void check_min_size(uint64_t size, const std::string& origin) {
  if (size < 8) {
    fail(origin, c10::str("file is ", size, " bytes, too short to hold the 8-byte header length"));
  }
}

// Most list entries accepted in a shape (and data_offsets has two). Real tensors have a
// handful of dimensions; the cap keeps a hostile header from building huge arrays.
constexpr size_t kMaxListItems = 64;

// Parses the JSON header with a callback that sees every event before the DOM is built.
// It rejects what the DOM cannot show or would cost too much to build:
//  - duplicate keys at any level (nlohmann keeps the last one silently);
//  - structure the format never uses, as soon as it opens: a non-object root, an entry
//    that is a list, nesting below shape/data_offsets, lists longer than kMaxListItems.
// Everything else (types, values, ranges) is checked on the DOM afterwards.
json parse_json(const char* begin, const char* end, const std::string& origin) {
  std::vector<std::unordered_set<std::string>> keys;  // one set per open object
  std::string entry;                                   // current top-level key
  size_t list_items = 0;                               // entries of the open depth-2 list
  const auto reject = [&](const std::string& what) {
    if (entry.empty()) {
      fail(origin, what);
    }
    fail_tensor(origin, entry, what);
  };
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    // depth: 0 = root, 1 = entry or __metadata__, 2 = a field of an entry, 3 = list item
    switch (event) {
      case json::parse_event_t::object_start:
        if (depth > 1) {
          reject("header nests deeper than the format allows");
        }
        keys.emplace_back();
        break;
      case json::parse_event_t::array_start:
        if (depth == 0) {
          fail(origin, "header is not a JSON object");
        }
        if (depth == 1 && entry == "__metadata__") {
          fail(origin, "__metadata__ is not an object");
        }
        if (depth == 1) {
          reject("header entry is not an object");
        }
        if (depth > 2) {
          reject("header nests deeper than the format allows");
        }
        list_items = 0;
        break;
      case json::parse_event_t::value:
        if (depth == 3 && ++list_items > kMaxListItems) {
          reject(c10::str("a list in the header entry has more than ", kMaxListItems, " items"));
        }
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) {
          keys.pop_back();
        }
        break;
      case json::parse_event_t::key: {
        const auto& k = parsed.get_ref<const std::string&>();
        if (keys.empty()) {
          break;  // unreachable: keys only occur inside objects
        }
        if (!keys.back().insert(k).second) {
          if (depth == 1) {
            fail_tensor(origin, k, "name appears twice in the header");
          }
          reject("key '" + printable(k) + "' appears twice");
        }
        if (depth == 1) {
          entry = k;
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    fail(origin, "header is not valid JSON: " + printable(e.what()));
  }
}

// Reads a JSON value that must be a non-negative integer fitting in int64.
bool get_index(const json& v, uint64_t& out) {
  if (!v.is_number_unsigned()) {
    return false;
  }
  out = v.get<uint64_t>();
  return out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

TensorInfo parse_entry(const std::string& name, const json& v, uint64_t data_size, const std::string& origin) {
  if (!v.is_object()) {
    fail_tensor(origin, name, "header entry is not an object");
  }
  if (v.size() != 3 || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
    fail_tensor(origin, name, "header entry must have exactly the keys dtype, shape and data_offsets");
  }
  TensorInfo info;
  info.name = name;

  const json& dtype = v["dtype"];
  if (!dtype.is_string()) {
    fail_tensor(origin, name, "dtype is not a string");
  }
  const DtypeEntry* entry = find_dtype(dtype.get_ref<const std::string&>());
  if (entry == nullptr) {
    fail_tensor(origin, name, "unknown dtype '" + printable(dtype.get_ref<const std::string&>()) + "'");
  }
  info.dtype_name = entry->name;
  info.dtype = entry->type;

  const json& shape = v["shape"];
  if (!shape.is_array()) {
    fail_tensor(origin, name, "shape is not a list");
  }
  // Overflow-safe byte count. Zero dims are skipped in the product so that a shape like
  // [2^40, 2^40, 0] is still rejected rather than handed to torch.
  uint64_t bytes = c10::elementSize(info.dtype);
  bool has_zero = false;
  info.shape.reserve(shape.size());
  for (const json& d : shape) {
    uint64_t dim = 0;
    if (!get_index(d, dim)) {
      if (d.is_number_integer() && !d.is_number_unsigned()) {  // nlohmann: signed means negative
        fail_tensor(origin, name, "shape has a negative dimension");
      }
      fail_tensor(origin, name, "shape entries must be integers in [0, 2^63)");
    }
    if (dim == 0) {
      has_zero = true;
    } else if (__builtin_mul_overflow(bytes, dim, &bytes) ||
               bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail_tensor(origin, name, "shape's byte size overflows");
    }
    info.shape.push_back(static_cast<int64_t>(dim));
  }
  if (has_zero) {
    bytes = 0;
  }

  const json& offsets = v["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !get_index(offsets[0], info.begin) ||
      !get_index(offsets[1], info.end)) {
    fail_tensor(origin, name, "data_offsets must be a list of two non-negative integers");
  }
  if (info.begin > info.end) {
    fail_tensor(origin, name, c10::str("data_offsets [", info.begin, ", ", info.end, "] run backwards"));
  }
  if (info.end > data_size) {
    fail_tensor(origin, name,
                c10::str("data_offsets [", info.begin, ", ", info.end, "] run past the end of the ",
                         data_size, "-byte data section"));
  }
  if (bytes != info.nbytes()) {
    fail_tensor(origin, name,
                c10::str("shape ", c10::IntArrayRef(info.shape), " of ", info.dtype_name, " needs ", bytes,
                         " bytes but data_offsets span ", info.nbytes()));
  }
  return info;
}

std::map<std::string, std::string> parse_metadata(const json& v, const std::string& origin) {
  if (!v.is_object()) {
    fail(origin, "__metadata__ is not an object");
  }
  std::map<std::string, std::string> out;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it.value().is_string()) {
      fail(origin, "__metadata__ value for key '" + printable(it.key()) + "' is not a string");
    }
    out.emplace(it.key(), it.value().get<std::string>());
  }
  return out;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) {
    n *= d;  // cannot overflow: validated against the byte range
  }
  return n;
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& origin) {
  const DtypeEntry* e = find_dtype(name);
  if (e == nullptr) {
    fail(origin, "unknown dtype '" + printable(name) + "'");
  }
  return e->type;
}

std::string dtype_name(at::ScalarType t) {
  for (const auto& e : kDtypes) {
    if (e.type == t) {
      return e.name;
    }
  }
  throw InvalidArgument(c10::str("safetensors: unsupported dtype ", t));
}

Header parse_header(const uint8_t* data, uint64_t size, const std::string& origin) {
  check_min_size(size, origin);
  if (data == nullptr) {
    throw InvalidArgument("safetensors::parse_header: null data for '" + origin + "'");
  }
  const uint64_t n = read_le64(data);
  if (n > kMaxHeaderBytes) {
    fail(origin, c10::str("header length ", n, " exceeds the ", kMaxHeaderBytes, "-byte limit"));
  }
  if (n > size - 8) {
    fail(origin, c10::str("header length ", n, " runs past the end of the ", size, "-byte file"));
  }
  const char* text = reinterpret_cast<const char*>(data + 8);
  // nlohmann's lexer takes a NUL outside a string for the end of input and would
  // silently ignore whatever follows it.
  if (std::memchr(text, 0, n) != nullptr) {
    fail(origin, "header is not valid JSON: it contains a NUL byte");
  }
  const json j = parse_json(text, text + n, origin);
  if (!j.is_object()) {
    fail(origin, "header is not a JSON object");
  }

  Header h;
  h.data_offset = 8 + n;
  const uint64_t data_size = size - h.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      h.metadata = parse_metadata(it.value(), origin);
    } else {
      h.tensors.push_back(parse_entry(it.key(), it.value(), data_size, origin));
    }
  }

  // The ranges must tile the data section exactly: sorted by begin, each starts where
  // the previous ended, and the last ends at the end of the file.
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin > pos) {
      fail_tensor(origin, t.name,
                  c10::str("hole in the data section: bytes [", pos, ", ", t.begin, ") belong to no tensor"));
    }
    if (t.begin < pos) {
      fail_tensor(origin, t.name,
                  c10::str("data_offsets [", t.begin, ", ", t.end, "] overlap tensor '", printable(prev->name),
                           "'"));
    }
    pos = t.end;
    prev = &t;
  }
  if (pos != data_size) {
    fail(origin, c10::str(data_size - pos, " trailing bytes after the last tensor's data"));
  }
  return h;
}

// ---------------------------------------------------------------------------------------
// File

struct File::Mapping {
  const uint8_t* data = nullptr;
  size_t size = 0;
  int fd = -1;  // kept open for read_into()
  Mapping(const uint8_t* d, size_t s, int f) : data(d), size(s), fd(f) {}
  ~Mapping() {
    if (data != nullptr) {
      ::munmap(const_cast<uint8_t*>(data), size);
    }
    if (fd >= 0) {
      ::close(fd);
    }
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

File::~File() = default;

namespace {

// Note [reading a changing file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A mapped page past the end of a file that shrank raises SIGBUS when touched, which no
// error handling can turn into an error message. Loaders therefore read tensor bytes with
// pread (File::read_into), which reports a short read instead: a checkpoint truncated
// between File::open and the load is a FileError naming the file and the tensor. (A file
// rewritten in place with different bytes of the same size cannot be detected.)
void pread_exact(int fd, uint8_t* dst, uint64_t offset, uint64_t n, const std::string& origin,
                 const std::string& what) {
  uint64_t done = 0;
  while (done < n) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n - done, uint64_t{1} << 30));
    const ssize_t r = ::pread(fd, dst + done, chunk, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      fail(origin, "cannot read " + what + ": " + std::strerror(errno));
    }
    if (r == 0) {
      struct stat st {};
      const std::string now = ::fstat(fd, &st) == 0 ? c10::str(" (it is now ", st.st_size, " bytes)") : "";
      fail(origin, c10::str("the file ends at byte ", offset + done, " while reading ", what, " at [", offset, ", ",
                            offset + n, ")", now, ": was it truncated after it was opened?"));
    }
    done += static_cast<uint64_t>(r);
  }
}

}  // namespace

void File::read_into(const TensorInfo& info, void* dst) const { read_range(info, 0, info.nbytes(), dst); }

void File::read_range(const TensorInfo& info, uint64_t offset, uint64_t n, void* dst) const {
  if (offset > info.nbytes() || n > info.nbytes() - offset) {
    throw InvalidArgument(c10::str("safetensors: read_range of ", n, " bytes at ", offset, " is outside tensor '",
                                   printable(info.name), "' (", info.nbytes(), " bytes) of '", path_, "'"));
  }
  if (fault::triggered("safetensors.read")) {
    fail_tensor(path_, info.name, "cannot read: I/O error (injected fault)");
  }
  if (n == 0) {
    return;
  }
  pread_exact(mapping_->fd, static_cast<uint8_t*>(dst), header_.data_offset + info.begin + offset, n, path_,
              "tensor '" + printable(info.name) + "'");
}

at::Tensor File::read(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) {
    fail_tensor(path_, name, "no such tensor in the file");
  }
  at::Tensor out = at::empty(info->shape, at::TensorOptions().dtype(info->dtype).device(at::kCPU));
  read_into(*info, out.data_ptr());
  return out;
}

const uint8_t* File::data() const { return mapping_->data; }

std::shared_ptr<File> File::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  // It has no effect on the regular files we go on to accept.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    fail(path, std::string("cannot open: ") + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(err));
  }
  // A FIFO or device would block or not map; only plain files are checkpoints.
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    check_min_size(size, path);
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  if (p == MAP_FAILED) {
    ::close(fd);
    fail(path, std::string("cannot mmap: ") + std::strerror(map_err));
  }

  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->size_ = size;
  f->mapping_ = std::make_shared<Mapping>(static_cast<const uint8_t*>(p), size, fd);
  // The header is read with pread, not through the mapping: a file truncated under us
  // then gives a FileError instead of SIGBUS (Note [reading a changing file]).
  std::vector<uint8_t> head(8);
  pread_exact(fd, head.data(), 0, 8, path, "the header length");
  const uint64_t n = read_le64(head.data());
  if (n <= kMaxHeaderBytes && n <= size - 8) {
    head.resize(8 + n);
    pread_exact(fd, head.data() + 8, 8, n, path, "the header");
  }
  f->header_ = parse_header(head.data(), size, path);
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) {
    f->index_.emplace(f->header_.tensors[i].name, i);
  }
  if (log::enabled(log::Level::debug)) {
    log::debug(c10::str("mapped ", path, ": ", f->header_.tensors.size(), " tensors, ", size, " bytes"));
  }
  return f;
}

const TensorInfo* File::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

// Note [safetensors views]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// tensor() wraps the mapped bytes with at::from_blob; the deleter owns a shared_ptr to
// the mapping, so the file stays mapped while any view (or any view of a view) lives,
// even after the File is gone. Nothing is copied: a 4 GB checkpoint costs page cache
// only. The mapping is PROT_READ and MAP_PRIVATE: writing through a view is undefined
// (it faults; and MAP_PRIVATE means no write could ever reach the file). Callers that
// need to modify weights copy them first (sluice::to_host_owned).
// The format does not align tensor data, and torch kernels may assume that a pointer is
// aligned to its element size. A tensor whose bytes are not so aligned is therefore
// returned as an owned copy instead of a view. Files written by sluice, PyTorch's
// safetensors or the HF writer pad the header to 8 bytes, so this is rare in practice.
// Empty tensors are fresh at::empty tensors: they have no bytes to point at.
at::Tensor File::tensor(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (info == nullptr) {
    fail_tensor(path_, name, "no such tensor in the file");
  }
  const auto options = at::TensorOptions().dtype(info->dtype).device(at::kCPU);
  if (info->nbytes() == 0) {
    return at::empty(info->shape, options);
  }
  const uint8_t* p = mapping_->data + header_.data_offset + info->begin;
  TORCH_INTERNAL_ASSERT(header_.data_offset + info->end <= size_, "validated range escapes the mapping");
  if (reinterpret_cast<uintptr_t>(p) % c10::elementSize(info->dtype) != 0) {
    at::Tensor copy = at::empty(info->shape, options);
    std::memcpy(copy.data_ptr(), p, info->nbytes());
    return copy;
  }
  std::shared_ptr<Mapping> keep = mapping_;
  return at::from_blob(const_cast<uint8_t*>(p), info->shape, [keep](void*) {}, options);
}

// ---------------------------------------------------------------------------------------
// save

namespace {

void write_all(int fd, const void* buf, size_t n, const std::string& tmp) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw FileError("safetensors save: cannot write '" + tmp + "': " + std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Removes the temporary file unless the save completed.
struct TempFileGuard {
  std::string path;
  int fd = -1;
  bool done = false;
  ~TempFileGuard() {
    if (fd >= 0) {
      ::close(fd);
    }
    if (!done) {
      ::unlink(path.c_str());
    }
  }
};

}  // namespace

void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata) {
  const auto bad = [&](const std::string& name, const std::string& what) {
    throw InvalidArgument("safetensors save '" + path + "': tensor '" + printable(name) + "': " + what);
  };
  json header = json::object();
  std::unordered_set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) {
      bad(name, "undefined tensor");
    }
    if (name == "__metadata__") {
      bad(name, "the name is reserved for metadata");
    }
    if (!seen.insert(name).second) {
      bad(name, "name given twice");
    }
    std::string dn;
    try {
      dn = dtype_name(t.scalar_type());
    } catch (const InvalidArgument&) {
      bad(name, c10::str("unsupported dtype ", t.scalar_type()));
    }
    const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    json entry = json::object();
    entry["dtype"] = dn;
    entry["shape"] = t.sizes().vec();
    entry["data_offsets"] = json::array({offset, offset + nbytes});
    header[name] = std::move(entry);
    offset += nbytes;
  }
  if (!metadata.empty()) {
    header["__metadata__"] = metadata;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {
    throw InvalidArgument("safetensors save '" + path + "': a tensor name or metadata string is not valid UTF-8");
  }
  // Pad with spaces so the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  uint8_t len[8];
  std::memcpy(len, &n, sizeof len);  // little-endian host

  TempFileGuard tmp;
  tmp.path = path + ".tmp-" + std::to_string(::getpid());
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (tmp.fd < 0) {
    throw FileError("safetensors save '" + path + "': cannot create '" + tmp.path + "': " + std::strerror(errno));
  }
  write_all(tmp.fd, len, sizeof len, tmp.path);
  write_all(tmp.fd, text.data(), text.size(), tmp.path);
  {
    at::NoGradGuard no_grad;
    progress::Task task("writing " + path, offset);
    for (const auto& [name, t] : tensors) {
      // One tensor at a time, so saving from a GPU never holds a second full copy.
      const at::Tensor c = t.detach().to(at::kCPU).contiguous();
      write_all(tmp.fd, c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size(), tmp.path);
      task.advance(static_cast<uint64_t>(c.numel()) * c.element_size());
    }
  }
  if (::fsync(tmp.fd) != 0) {
    throw FileError("safetensors save '" + path + "': cannot sync '" + tmp.path + "': " + std::strerror(errno));
  }
  const int fd = tmp.fd;
  tmp.fd = -1;
  if (::close(fd) != 0) {
    throw FileError("safetensors save '" + path + "': cannot close '" + tmp.path + "': " + std::strerror(errno));
  }
  if (::rename(tmp.path.c_str(), path.c_str()) != 0) {
    throw FileError("safetensors save '" + path + "': cannot rename '" + tmp.path + "' into place: " +
                    std::strerror(errno));
  }
  tmp.done = true;
}

}  // namespace sluice::safetensors
