// libFuzzer target: safetensors::parse_header on arbitrary file images.
// A FileError (or InvalidArgument) is the expected answer to bad input; any other
// exception, a crash, a sanitizer report or a broken postcondition is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "runtime/error.h"
#include "runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sluice::safetensors;
  Header h;
  try {
    h = parse_header(data, size, "fuzz.safetensors");
  } catch (const sluice::Error&) {
    return 0;
  }
  // Postconditions of an accepted header: entries tile [0, data size) in order, each
  // range matches its dtype and shape, and the header fits in the file.
  if (size < 8 || h.data_offset < 8 || h.data_offset > size) std::abort();
  const uint64_t data_size = size - h.data_offset;
  uint64_t pos = 0;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin != pos || t.end < t.begin || t.end > data_size) std::abort();
    uint64_t bytes = c10::elementSize(t.dtype);
    bool zero = false;
    for (int64_t d : t.shape) {
      if (d < 0) std::abort();
      if (d == 0) zero = true;
      else if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) std::abort();
    }
    if ((zero ? 0 : bytes) != t.nbytes()) std::abort();
    if (t.numel() < 0) std::abort();
    if (dtype_from_name(t.dtype_name, "fuzz") != t.dtype) std::abort();
    pos = t.end;
  }
  if (pos != data_size) std::abort();
  return 0;
}
