#include "offload/engine/vram_budget.h"

#include <algorithm>
#include <cctype>
#include <optional>

#include "runtime/error.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

}  // namespace

bool is_auto_vram_budget(std::string_view spec) {
  const std::string_view s = trim(spec);
  if (s.size() != 4) return false;
  for (size_t i = 0; i < 4; ++i) {
    if (std::tolower(static_cast<unsigned char>(s[i])) != "auto"[i]) return false;
  }
  return true;
}

ResolvedVramBudget resolve_vram_budget(std::string_view spec, std::string_view headroom_spec,
                                       const DeviceBackend::DeviceMemoryInfo& memory, const std::string& flag,
                                       const std::string& headroom_flag) {
  const uint64_t total = static_cast<uint64_t>(std::max<int64_t>(memory.total_bytes, 0));
  const std::optional<uint64_t> percent_of = total ? std::optional<uint64_t>(total) : std::nullopt;
  const bool headroom_given = !trim(headroom_spec).empty();
  ResolvedVramBudget r;
  if (!is_auto_vram_budget(spec)) {
    if (headroom_given) {
      throw InvalidArgument(headroom_flag + ": only applies to " + flag + " auto, not to " + flag + " " +
                            quoted(spec));
    }
    r.bytes = parse_size(spec, percent_of, flag);
    if (r.bytes == 0) throw InvalidArgument(flag + ": must be positive, got " + quoted(spec));
    const bool percent = trim(spec).back() == '%';
    if (percent) r.how = std::string(trim(spec)) + " of total " + format_bytes(total) + " = " + format_bytes(r.bytes);
    return r;
  }
  if (total == 0) {
    throw InvalidArgument(flag + " auto: the memory of the device is unknown, give the budget in bytes");
  }
  const uint64_t free = std::min(static_cast<uint64_t>(std::max<int64_t>(memory.free_bytes, 0)), total);
  uint64_t headroom = 0;
  std::string headroom_how;
  if (headroom_given) {
    headroom = parse_size(headroom_spec, total, headroom_flag);
    if (trim(headroom_spec).back() == '%') headroom_how = " (" + std::string(trim(headroom_spec)) + " of total)";
  } else {
    headroom = std::max<uint64_t>(kDefaultVramHeadroomMin,
                                  static_cast<uint64_t>(static_cast<double>(total) * kDefaultVramHeadroomFraction));
    headroom_how = " (default: max(512MiB, 5% of total " + format_bytes(total) + "))";
  }
  if (headroom >= free) {
    throw InvalidArgument(flag + " auto: headroom " + format_bytes(headroom) +
                          (headroom_given ? " (" + headroom_flag + " " + quoted(trim(headroom_spec)) + ")"
                                          : " (the default; set " + headroom_flag + ")") +
                          " leaves nothing of the " + format_bytes(free) + " free on the device");
  }
  r.bytes = free - headroom;
  r.how = "auto: free " + format_bytes(free) + " - headroom " + format_bytes(headroom) + headroom_how + " = " +
          format_bytes(r.bytes);
  return r;
}

ResolvedVramBudget resolve_vram_budget(DeviceAllocator& device, std::string_view spec, std::string_view headroom_spec,
                                       const std::string& flag, const std::string& headroom_flag) {
  if (trim(spec).empty()) {
    if (!trim(headroom_spec).empty()) throw InvalidArgument(headroom_flag + ": only applies to " + flag + " auto");
    return {};
  }
  if (!is_auto_vram_budget(spec)) {
    const DeviceBackend::DeviceMemoryInfo memory = device.memory_info();
    ResolvedVramBudget r = resolve_vram_budget(spec, headroom_spec, memory, flag, headroom_flag);
    const uint64_t total = static_cast<uint64_t>(std::max<int64_t>(memory.total_bytes, 0));
    if (total > 0 && r.bytes > total) {
      // A size above the device's memory is a mistake (10TB for 10GB), not a wish for all of it
      // (that is 100% or auto). The memory as printed reads back as a little more than it
      // (Note [size suffixes]): that, typed back, is the whole device.
      if (r.bytes > parse_size(format_bytes(total), std::nullopt, flag)) {
        throw InvalidArgument(flag + " " + std::string(trim(spec)) + " (" + format_bytes(r.bytes) +
                              ") is more than the " + format_bytes(total) + " of memory of " + device.name() +
                              ": give at most " + format_bytes(total) + ", a percentage of it or auto");
      }
      r.bytes = total;
      r.how = std::string(trim(spec)) + " = all " + format_bytes(total) + " of " + device.name();
    }
    if (!r.how.empty() && trim(spec).back() == '%') {
      // A percent of the total is clamped to what this process can have: the free memory
      // plus what sluice already holds there (other processes keep theirs).
      const int64_t held = std::max<int64_t>(device.memory_stats().total.current, 0);
      if (memory.total_bytes > 0) {
        const uint64_t can = static_cast<uint64_t>(
            std::min(memory.total_bytes, std::max<int64_t>(memory.free_bytes, 0) + held));
        if (r.bytes > can) {
          r.how += ", clamped to the free " + format_bytes(static_cast<uint64_t>(std::max<int64_t>(memory.free_bytes, 0))) +
                   (held > 0 ? " plus the " + format_bytes(static_cast<uint64_t>(held)) + " sluice holds" : std::string()) +
                   " = " + format_bytes(can);
          r.bytes = can;
          if (r.bytes == 0) throw InvalidArgument(flag + " " + quoted(spec) + ": nothing of the device is free");
        }
      }
      r.how += " on " + device.name();
    }
    return r;
  }
  device.release_cached_memory();
  DeviceBackend::DeviceMemoryInfo memory = device.memory_info();
  const int64_t held = device.memory_stats().total.current;
  if (memory.total_bytes > 0 && held > 0) {
    memory.free_bytes = std::min(memory.total_bytes, std::max<int64_t>(memory.free_bytes, 0) + held);
  }
  ResolvedVramBudget r = resolve_vram_budget(spec, headroom_spec, memory, flag, headroom_flag);
  r.how += " on " + device.name();
  if (held > 0) r.how += " (free counts the " + format_bytes(static_cast<uint64_t>(held)) + " sluice holds there)";
  return r;
}

}  // namespace sluice::offload
