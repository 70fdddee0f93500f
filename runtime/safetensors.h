#pragma once
// Safetensors reading (memory-mapped, zero-copy, fully validated) and writing.
//
// Format: 8-byte little-endian header length N, N bytes of JSON header, then the data
// section. The header maps tensor names to {dtype, shape, data_offsets: [begin, end)}
// relative to the data section, plus an optional "__metadata__" string->string map.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sluice::safetensors {

struct TensorInfo {
  std::string name;
  std::string dtype_name;      // as written in the header: "BF16", "F8_E4M3", ...
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;          // byte range in the data section, [begin, end)
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const;
};

// The parsed, validated header. `origin` (a file name) is used in error messages.
struct Header {
  std::vector<TensorInfo> tensors;                 // in data-offset order
  std::map<std::string, std::string> metadata;     // "__metadata__"
  uint64_t data_offset = 0;                        // 8 + header length
};

// Parses and validates a whole file image held in memory (also used by the fuzz target):
// header length, JSON, every entry, and that the tensors' byte ranges tile the data
// section exactly. Reads only the first 8 + header-length bytes of `data`; rejects NUL
// bytes in the header, headers over kMaxHeaderBytes and shapes of more than 64 dims. Throws
// FileError naming `origin` and, where there is one, the tensor.
Header parse_header(const uint8_t* data, uint64_t size, const std::string& origin);

// Maps header dtype names to torch dtypes and back. Throws FileError for unknown names.
at::ScalarType dtype_from_name(const std::string& name, const std::string& origin);
std::string dtype_name(at::ScalarType t);  // throws InvalidArgument for unsupported dtypes

// Largest header parse_header accepts. Real checkpoints with thousands of tensors have
// headers of a few hundred KB; the cap bounds the JSON parser's memory on hostile input.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// A read-only, memory-mapped safetensors file (POSIX mmap, PROT_READ, MAP_PRIVATE).
// tensor() returns zero-copy CPU views that keep the mapping alive for as long as any of
// them lives, so a 4 GB checkpoint costs page cache, not a second 4 GB of RAM.
// See Note [safetensors views] in safetensors.cpp: views are read-only (writing to one
// is undefined; in practice it faults, and it never reaches the file), and a tensor whose
// bytes are not aligned to its element size is returned as a copy instead of a view.
// A file truncated while mapped raises SIGBUS when a view's missing pages are touched;
// read_into()/read() report it as a FileError instead, so loaders use those. The header is
// read the same way. The file stays open (one descriptor) while the File or a view lives.
// A File is immutable once open: its const methods may be called from several threads.
class File {
 public:
  static std::shared_ptr<File> open(const std::string& path);  // throws FileError
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  // Start of the whole mapped file image (size file_size()); tensor bytes start at
  // data() + data_offset() + TensorInfo::begin. For diagnostics and host registration.
  const uint8_t* data() const;
  uint64_t data_offset() const { return header_.data_offset; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // A CPU view of the named tensor (a copy when unaligned or empty). Throws FileError
  // naming the file and tensor when absent.
  at::Tensor tensor(const std::string& name) const;
  // Reads the tensor's bytes with pread into `dst` (info.nbytes() bytes), not through
  // the mapping: a file truncated since open() is a FileError naming the file and tensor,
  // not SIGBUS (Note [reading a changing file]). Loaders use this. Fault point
  // "safetensors.read".
  void read_into(const TensorInfo& info, void* dst) const;
  // As read_into(), for the `n` bytes at byte `offset` of the tensor (offset + n <=
  // info.nbytes(); checked): a chunk of a large tensor. Same errors and fault point.
  void read_range(const TensorInfo& info, uint64_t offset, uint64_t n, void* dst) const;
  // read_into() a new contiguous CPU tensor (owned, never a view of the file).
  at::Tensor read(const std::string& name) const;

 private:
  File() = default;
  struct Mapping;
  std::string path_;
  uint64_t size_ = 0;
  std::shared_ptr<Mapping> mapping_;
  Header header_;
  std::map<std::string, size_t> index_;
};

// Writes tensors (any device; copied to CPU contiguous one at a time) and metadata. Data
// is laid out in the order given, back to back. The file is written to
// `<path>.tmp-<pid>`, fsynced and renamed into place, so a failed write never leaves a
// truncated file behind. Throws InvalidArgument naming the tensor for an undefined
// tensor, a repeated name, the reserved name "__metadata__" or an unsupported dtype, and
// FileError for I/O failures.
void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata = {});

}  // namespace sluice::safetensors
