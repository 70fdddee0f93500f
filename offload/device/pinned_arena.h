#pragma once
// PinnedArena: page-locked host memory for the host copies of streamed layers, in large
// exact-size chunks, under one byte limit shared by every engine of a model cache.
//
// Note [pinned arena]
// ~~~~~~~~~~~~~~~~~~~
// Why not ATen's pinned host allocator: it rounds every block up to a power of two (a 33
// MiB layer pins 64 MiB; one frontend measured 1.47x the intended bytes) and keeps freed
// blocks page-locked for reuse, so pinned memory neither matches what is streamed nor goes
// back to the OS when a model leaves RAM.
// What the arena does instead:
//  - place() copies a run of tensors (the host copies of a model's streamed layers, in
//    order) into chunks that DeviceAllocator::allocate_pinned() makes at exactly the size
//    they need: consecutive layers are packed into one chunk until the next would take it
//    past kChunkBytes (64 MiB: few driver calls per model, yet a layer bigger than that
//    gets a chunk of its own size). Nothing is ever rounded up to a power of two.
//  - Each tensor starts at a multiple of kAlignment (64 bytes) inside its chunk, and every
//    chunk starts on a page. 64 bytes is what host_empty() gives the pageable weights
//    (runtime/host_memory.h), so a copy from the arena sees the alignment it saw before;
//    DMA from page-locked memory needs no more. Tensors of a model are multiples of 64
//    bytes in practice, so pinned bytes equal placed bytes plus a few bytes of padding.
//  - The placed tensors are replaced by views of their chunk, whose storage holds the
//    chunk: the page-locked memory lives exactly as long as the host weights and is freed
//    (given back to the driver) with the last view, i.e. when the model leaves RAM. A model
//    taken off the device keeps its views: re-attaching it copies nothing (holds()).
//  - The limit counts page-locked bytes (chunks) of all models together. place() stops at
//    the first layer that would pass it; that layer and the rest stay where they are
//    (pageable) and the caller streams them through the bounce ring (bounce_ring.h).
//    Bytes are reserved under the arena's lock before a chunk is allocated, so two engines
//    placing at once cannot pass the limit together.
// default_pin_memory_limit(): page-locked memory cannot be swapped or reclaimed, and the
// CUDA guide warns that pinning too much degrades the whole system. The default leaves the
// OS at least half of the host memory limit and at least 4 GiB: min(L / 2, L - 4 GiB) (0
// where L is 4 GiB or less: nothing is pinned there unless asked). L is the host memory
// limit (runtime/host_memory_limit.h, Note [host memory limit]): the smallest of physical
// RAM, the cgroup's memory limit (a container's) and what MemAvailable allows, so that a
// container is never pinned past its own limit. The arena keeps where its limit came from
// (limit_source()), and the warning of a model that reaches the limit names it.
// Thread-safe; views may be freed on any thread (the CPU device's copy worker).
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload/device/device_allocator.h"
#include "offload/device/memory_stats.h"
#include "runtime/host_memory_limit.h"

namespace sluice::offload {

// A pinned arena's limit and where it came from (empty: given by the caller).
struct PinLimit {
  uint64_t bytes = 0;
  std::string source;
};

// min(L / 2, L - 4 GiB) for a host memory limit of L bytes, 0 when L is unknown (0) or
// 4 GiB or less. See Note [pinned arena].
uint64_t default_pin_memory_limit(uint64_t host_limit_bytes);
// The default for `host`, with a source naming the rule and the host memory limit's own
// source ("default min(L / 2, L - 4GiB) of the host memory limit L = 6.0GiB from cgroup v2
// memory.max (/sys/fs/cgroup/app)").
PinLimit default_pin_memory_limit(const HostMemoryLimit& host);
// The same of host_memory_limit() now.
PinLimit default_pin_memory_limit();

class PinnedArena {
 public:
  static constexpr uint64_t kAlignment = 64;
  static constexpr uint64_t kChunkBytes = uint64_t{64} << 20;

  explicit PinnedArena(uint64_t limit_bytes, std::string limit_source = {});
  explicit PinnedArena(const PinLimit& limit) : PinnedArena(limit.bytes, limit.source) {}
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // One layer's tensors: placed together or not at all. Undefined entries are skipped.
  using Group = std::vector<at::Tensor>;
  struct Placed {
    size_t groups = 0;         // the first `groups` groups were placed (their tensors are now views)
    bool limited = false;      // stopped because the next group would pass the limit
    bool failed = false;       // stopped because allocate_pinned() failed
  };
  // Copies `groups` (contiguous host tensors), in order, into new chunks from
  // `device.allocate_pinned()` and replaces each tensor by its view. Groups whose tensors
  // are all held() already are skipped (counted as placed). See Note [pinned arena].
  Placed place(DeviceAllocator& device, std::vector<Group>& groups);

  // Whether `t` is a view of a chunk of this arena.
  bool holds(const at::Tensor& t) const;
  // The chunk holding `t` (an id and its bytes), {nullptr, 0} when not held().
  struct ChunkRef {
    const void* id = nullptr;
    uint64_t bytes = 0;
  };
  ChunkRef chunk_of(const at::Tensor& t) const;

  uint64_t limit() const;
  // Where the limit came from (default_pin_memory_limit()'s source); empty when given.
  std::string limit_source() const;
  void set_limit(uint64_t limit_bytes, std::string limit_source = {});
  Stat pinned() const;          // page-locked chunk bytes (current = held now)
  uint64_t used_bytes() const;  // bytes of the tensors placed in live chunks
  uint64_t chunks() const;      // live chunks

  // Bytes `t` takes in a chunk: nbytes rounded up to kAlignment.
  static uint64_t footprint(const at::Tensor& t);

  struct Counters;  // shared with the chunks, which outlive nothing but themselves

 private:
  std::shared_ptr<Counters> counters_;
};

}  // namespace sluice::offload
