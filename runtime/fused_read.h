#pragma once
// Reading many tensors of a safetensors file into their final host memory: one pass per
// byte, split across threads. See Note [fused read].
//
// Note [fused read]
// ~~~~~~~~~~~~~~~~~
// A loader hands read_tensors() its targets: for each, a file entry and the tensor it ends
// in (allocated by the caller in its final dtype, at its final address). The work is cut
// into chunks of at most FusedReadOptions::chunk_bytes of file bytes (whole rows for a
// per-channel scale), and `threads` workers take chunks in file order. A chunk is
//  - read with pread straight into the target when the dtypes are equal (bf16 -> bf16,
//    fp8 -> fp8, fp32 -> fp32). The chunk is then checked for NaN/Inf while it is in cache
//    (count_non_finite: fp8 bytes, or a scan of the magnitude bits of bf16/fp16/fp32).
//  - read into the worker's own buffer (one chunk) and cast from it into the target when
//    the target is fp8 and the file holds bf16, fp16 or fp32: the range check (NaN/Inf
//    found, values beyond +-max finite counted and saturated) happens in the same loop.
//    bf16 -> e4m3fn is a vectorized conversion; other 16-bit pairs go through a
//    65536-entry table of fp8 bytes, one per pattern (Note [vectorized fp8 loops]).
//  - read into the worker's buffer and converted into the target when the target is bf16,
//    fp16 or fp32 and the file holds another of those or fp8 (norms into the compute
//    dtype, an fp32 file into bf16 storage): NaN/Inf counted in the same pass, values
//    beyond the target's largest finite value (fp16 from bf16/fp32, bf16 from fp32)
//    counted and saturated, as for fp8.
// Every target is checked, whatever its dtype (issue 29): a NaN in a bf16 file read into
// bf16 storage is refused as one read into fp8 is. A source that is not one of these
// floating-point dtypes (int8, bool, ...) is refused before any byte is read.
// No other copy is made: no full-size temporary in the source dtype, no fp32 tensor. So the
// peak memory of a read is the targets plus one chunk per worker that casts. Each chunk's
// destination pages are faulted in with one madvise(MADV_POPULATE_WRITE) before it is
// written: on a 2-core VM, fresh pages faulted one at a time (inside pread, or by the cast
// loop) dominated a load (docs/BENCHMARKS.md, "Load"; see also Note [host huge pages]).
//
// Results are bit-identical to cast_to_storage (runtime/fp8.h), the checked ATen cast the
// rest of sluice uses: the same clamp, the same rounding, the same scales (per channel:
// amax / max finite per row, computed in fp32; per tensor: in double, then fp32; 1 for an
// all-zero row or tensor, floored at FLT_MIN). A per-tensor scale needs the whole tensor's
// amax before any byte is cast, so those targets are read twice (a first pass finds the
// amax); per-channel rows fit in a chunk, so they are read once.
//
// Errors: a read that fails (a file truncated since it was opened, an I/O error, the
// "safetensors.read" fault point) is the FileError of File::read_range; NaN/Inf values
// ("file 'F': tensor 'T' holds 1 NaN and 0 inf values; refusing to store it as bfloat16")
// and, under OutOfRangePolicy::refuse, values out of range are an InvalidArgument naming
// the tensor and the counts. The first error stops every worker; it is rethrown on the calling
// thread once all have stopped, and the targets then hold unspecified bytes.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/dtype_policy.h"

namespace sluice::safetensors {

class File;
struct TensorInfo;

// One tensor to read.
struct ReadTarget {
  const TensorInfo* source = nullptr;  // the file's entry
  std::string name;                    // for messages (usually source->name)
  // Contiguous CPU tensor with source's number of elements, in source's dtype, in an fp8
  // dtype when source is bf16, fp16 or fp32, or in bf16/fp16/fp32 from any of those or
  // an fp8 dtype (see can_fuse).
  at::Tensor dst;
  // fp8 targets of 2 or more dims from a non-fp8 source: per-tensor or per-channel scale
  // (Fp8Options::scale_mode); ignored otherwise.
  ScaleMode scale_mode = ScaleMode::none;

  // Filled by read_tensors:
  at::Tensor scale;      // fp32 [] or [rows] dequantization scale, when scaled
  int64_t clipped = 0;   // values saturated to +-max finite
  bool cast = false;     // converted into dst's dtype as read (not a plain copy)
};

struct FusedReadOptions {
  int threads = 0;                       // workers; 0: every core this process may use
  uint64_t chunk_bytes = uint64_t{1} << 20;  // file bytes per chunk (at least one row is taken)
  OutOfRangePolicy out_of_range = OutOfRangePolicy::saturate;
  // Called on the calling thread with file bytes done so far, a few hundred times per GB.
  std::function<void(uint64_t done)> progress;
};

struct FusedReadStats {
  int threads = 0;          // workers used
  int64_t chunks = 0;       // chunks read
  uint64_t bytes_read = 0;  // file bytes read (per-tensor scaled targets count twice)
  int64_t cast = 0;         // targets converted as read
  int64_t clipped = 0;      // values saturated over all targets
};

// Whether read_tensors can read `source_dtype` into `dst_dtype`: both among the four fp8
// dtypes, bf16, fp16 and fp32, and not from one fp8 dtype into another.
bool can_fuse(at::ScalarType source_dtype, at::ScalarType dst_dtype);

// Reads every target (Note [fused read]). Throws InvalidArgument for a target it cannot
// read (a source dtype that is not floating-point, see can_fuse, shape or contiguity
// mismatch), FileError and InvalidArgument as described in the Note. Logs one warning per
// tensor with saturated values.
FusedReadStats read_tensors(const File& file, std::vector<ReadTarget>& targets, const FusedReadOptions& options = {});

// The number of workers `threads` means: itself when positive, else the CPUs this process
// may run on (sched_getaffinity), at least 1.
int resolve_threads(int threads);

}  // namespace sluice::safetensors
