#include "offload/device/memory_stats.h"

namespace sluice::offload {

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::resident: return "resident";
    case MemoryKind::params: return "params";
    case MemoryKind::ring: return "ring";
    case MemoryKind::scratch: return "scratch";
    case MemoryKind::lora: return "lora";
  }
  return "?";
}

void DeviceMemoryStats::reset_peak() {
  total.reset_peak();
  for (auto& s : by_kind) s.reset_peak();
}

void DeviceMemoryStats::reset_accumulated() {
  total.reset_accumulated();
  for (auto& s : by_kind) s.reset_accumulated();
}

}  // namespace sluice::offload
