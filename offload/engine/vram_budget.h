#pragma once
// Turning a --vram-budget value into bytes.
//
// Note [vram budget]
// ~~~~~~~~~~~~~~~~~~
// A budget is one of
//  - a size ("6GiB", "512MiB", "8G", bytes; Note [size suffixes] in runtime/size_parse.h);
//  - "N%": N percent of the device's TOTAL memory (not of its free memory), clamped on a
//    device to what this process can have: its free memory plus what sluice already holds
//    there (the "how" says so when it clamps);
//  - "auto": the device's free memory at the time it is resolved (when the cache is
//    created, i.e. before the first load, or when the budget is set again), minus a
//    headroom, so that memory other processes hold is respected. The headroom
//    (--vram-headroom) is a size or "N%" of the TOTAL memory; the default is
//    max(512 MiB, 5% of total). Memory this runtime already holds on the device counts as
//    free (it is what the budget would be spent on), and the allocator's unused cache is
//    released before free memory is read.
// A size above the device's total memory is refused (InvalidArgument naming the flag, the
// budget and the memory: "--vram-budget 10TB (9.1TiB) is more than the 23.5GiB of memory of
// cpu: ..."), except up to the total as format_bytes prints it, which is the whole device.
// A headroom only means something with "auto" and is refused with any other budget.
#include <cstdint>
#include <string>
#include <string_view>

#include "offload/device/device.h"

namespace sluice::offload {

constexpr uint64_t kDefaultVramHeadroomMin = 512ull << 20;  // default headroom: max(this, ...
constexpr double kDefaultVramHeadroomFraction = 0.05;       // ... this fraction of total memory)

struct ResolvedVramBudget {
  uint64_t bytes = 0;
  std::string how;  // how it was computed ("auto: free 20.0GiB - headroom 1.0GiB = 19.0GiB"); empty for a size
};

// True for "auto" (case-insensitive, spaces around allowed).
bool is_auto_vram_budget(std::string_view spec);

// The pure resolution of Note [vram budget] against `memory`. `headroom_spec` empty: the
// default headroom. Throws InvalidArgument naming `flag` or `headroom_flag` with the value
// for a malformed value, a zero budget, a percentage or "auto" on a device whose memory is
// unknown (total 0), a headroom that leaves nothing of the free memory, or a headroom
// given with a budget other than "auto".
ResolvedVramBudget resolve_vram_budget(std::string_view spec, std::string_view headroom_spec,
                                       const DeviceBackend::DeviceMemoryInfo& memory,
                                       const std::string& flag = "--vram-budget",
                                       const std::string& headroom_flag = "--vram-headroom");

// The same on `device` now; an empty `spec` gives 0 bytes (all device memory, no headroom
// allowed). For "auto" it first releases the allocator's cached memory and
// adds what the device's ledger holds back to the free memory (see the note).
ResolvedVramBudget resolve_vram_budget(DeviceAllocator& device, std::string_view spec, std::string_view headroom_spec,
                                       const std::string& flag = "--vram-budget",
                                       const std::string& headroom_flag = "--vram-headroom");

}  // namespace sluice::offload
