#include "offload/device/pinned_arena.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "runtime/fault_injection.h"

namespace sluice::offload {

struct PinnedArena::Counters {
  mutable std::mutex mutex;
  uint64_t limit = 0;
  std::string limit_source;
  Stat pinned;  // chunk bytes, reservations of place() calls under way included
  uint64_t used = 0;
  uint64_t chunks = 0;
};

namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// One allocate_pinned() block. Freed, and its bytes given back to the arena, with the last
// view of it.
struct Chunk {
  c10::DataPtr memory;
  uint64_t bytes = 0;
  uint64_t used = 0;
  std::shared_ptr<PinnedArena::Counters> counters;

  ~Chunk() {
    memory.clear();  // back to the driver first: the limit then never undercounts
    std::lock_guard<std::mutex> lock(counters->mutex);
    counters->pinned.decrease(static_cast<int64_t>(bytes));
    counters->used -= used;
    counters->chunks -= 1;
  }
};

// The context of every view's DataPtr; its deleter identifies arena memory (holds()).
struct View {
  std::shared_ptr<Chunk> chunk;
};

void delete_view(void* ctx) { delete static_cast<View*>(ctx); }

const View* view_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get_deleter() != &delete_view) return nullptr;
  return static_cast<const View*>(dp.get_context());
}

uint64_t group_footprint(const PinnedArena::Group& g) {
  uint64_t n = 0;
  for (const auto& t : g) n += PinnedArena::footprint(t);
  return n;
}

}  // namespace

uint64_t default_pin_memory_limit(uint64_t host_limit_bytes) {
  const uint64_t l = host_limit_bytes;
  if (l <= 4 * kGiB) return 0;
  return std::min(l / 2, l - 4 * kGiB);
}

PinLimit default_pin_memory_limit(const HostMemoryLimit& host) {
  return {default_pin_memory_limit(host.bytes),
          "default min(L / 2, L - 4GiB) of the host memory limit L = " + host.describe()};
}

PinLimit default_pin_memory_limit() { return default_pin_memory_limit(host_memory_limit()); }

PinnedArena::PinnedArena(uint64_t limit_bytes, std::string limit_source) : counters_(std::make_shared<Counters>()) {
  counters_->limit = limit_bytes;
  counters_->limit_source = std::move(limit_source);
}

PinnedArena::~PinnedArena() = default;

uint64_t PinnedArena::footprint(const at::Tensor& t) {
  if (!t.defined()) return 0;
  const uint64_t n = t.nbytes();
  return (n + kAlignment - 1) / kAlignment * kAlignment;
}

bool PinnedArena::holds(const at::Tensor& t) const {
  const View* v = view_of(t);
  return v && v->chunk->counters == counters_;
}

PinnedArena::ChunkRef PinnedArena::chunk_of(const at::Tensor& t) const {
  if (!holds(t)) return {};
  const Chunk& c = *view_of(t)->chunk;
  return {&c, c.bytes};
}

uint64_t PinnedArena::limit() const {
  std::lock_guard<std::mutex> lock(counters_->mutex);
  return counters_->limit;
}

std::string PinnedArena::limit_source() const {
  std::lock_guard<std::mutex> lock(counters_->mutex);
  return counters_->limit_source;
}

void PinnedArena::set_limit(uint64_t limit_bytes, std::string limit_source) {
  std::lock_guard<std::mutex> lock(counters_->mutex);
  counters_->limit = limit_bytes;
  counters_->limit_source = std::move(limit_source);
}

Stat PinnedArena::pinned() const {
  std::lock_guard<std::mutex> lock(counters_->mutex);
  return counters_->pinned;
}

uint64_t PinnedArena::used_bytes() const {
  std::lock_guard<std::mutex> lock(counters_->mutex);
  return counters_->used;
}

uint64_t PinnedArena::chunks() const {
  std::lock_guard<std::mutex> lock(counters_->mutex);
  return counters_->chunks;
}

PinnedArena::Placed PinnedArena::place(DeviceAllocator& device, std::vector<Group>& groups) {
  Placed out;
  for (const auto& g : groups) {
    for (const auto& t : g) {
      TORCH_CHECK(!t.defined() || (t.device().is_cpu() && t.is_contiguous()),
                  "PinnedArena::place: host tensors must be contiguous and on the CPU");
    }
  }
  // Bytes each group needs (0: already here), and the prefix the limit allows, reserved.
  std::vector<uint64_t> need(groups.size(), 0);
  size_t n = 0;
  uint64_t reserved = 0;
  {
    std::lock_guard<std::mutex> lock(counters_->mutex);
    for (; n < groups.size(); ++n) {
      const bool here = std::all_of(groups[n].begin(), groups[n].end(),
                                    [&](const at::Tensor& t) { return !t.defined() || holds(t); });
      need[n] = here ? 0 : group_footprint(groups[n]);
      if (need[n] > 0 && static_cast<uint64_t>(counters_->pinned.current) + reserved + need[n] > counters_->limit) {
        out.limited = true;
        break;
      }
      reserved += need[n];
    }
    counters_->pinned.increase(static_cast<int64_t>(reserved));
  }
  auto unreserve = [&](uint64_t bytes) {
    std::lock_guard<std::mutex> lock(counters_->mutex);
    counters_->pinned.current -= static_cast<int64_t>(bytes);  // never allocated: not a free
    counters_->pinned.allocated -= static_cast<int64_t>(bytes);
    reserved -= bytes;
  };

  // Consecutive groups share a chunk of exactly their bytes, up to kChunkBytes.
  size_t first = 0;
  while (first < n) {
    size_t last = first;
    uint64_t bytes = 0;
    while (last < n && (bytes == 0 || bytes + need[last] <= kChunkBytes)) bytes += need[last++];
    if (bytes == 0) {  // only groups already here
      first = last;
      continue;
    }
    c10::DataPtr memory = fault::triggered("host.pin") ? c10::DataPtr() : device.allocate_pinned(bytes);
    if (!memory) {
      unreserve(reserved);
      out.failed = true;
      out.limited = false;
      out.groups = first;
      return out;
    }
    auto chunk = std::make_shared<Chunk>();
    auto* base = static_cast<uint8_t*>(memory.get());
    chunk->memory = std::move(memory);
    chunk->bytes = bytes;
    chunk->counters = counters_;
    uint64_t off = 0;
    for (size_t g = first; g < last; ++g) {
      if (need[g] == 0) continue;
      for (auto& t : groups[g]) {
        if (!t.defined()) continue;
        const size_t nbytes = t.nbytes();
        if (nbytes) std::memcpy(base + off, t.data_ptr(), nbytes);
        at::Tensor view = at::for_blob(base + off, t.sizes())
                              .context(new View{chunk}, &delete_view)
                              .options(at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU))
                              .make_tensor();
        t = std::move(view);
        chunk->used += nbytes;
        off += footprint(t);
      }
    }
    TORCH_INTERNAL_ASSERT(off == bytes, "PinnedArena::place: chunk layout mismatch");
    {
      std::lock_guard<std::mutex> lock(counters_->mutex);
      counters_->used += chunk->used;
      counters_->chunks += 1;
    }
    reserved -= bytes;  // now the chunk's own
    first = last;
  }
  TORCH_INTERNAL_ASSERT(reserved == 0, "PinnedArena::place: reservation left over");
  out.groups = n;
  return out;
}

}  // namespace sluice::offload
