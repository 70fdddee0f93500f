#pragma once
// Device-memory counters, modelled on c10's DeviceStats (c10/core/CachingDeviceAllocator.h):
// every Stat has current and peak values plus accumulated allocated/freed totals, with
// reset_peak() and reset_accumulated(). The device layer keeps them (device.h's ledger,
// pinned_arena.h); the engine's reports (offload/report/stats.h) carry and serialise them.
#include <array>
#include <cstddef>
#include <cstdint>

#include "sluice/stats.hpp"

namespace sluice::offload {

// One counter: what is held now, the most ever held, and the totals added and removed; the
// public record (sluice::Counter, sluice/stats.hpp) with the ledger's operations.
struct Stat : Counter {
  void increase(int64_t amount) {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() {
    allocated = 0;
    freed = 0;
  }
};

// What a device allocation is for. The budget covers all of them.
enum class MemoryKind : uint8_t {
  resident,  // stored tensors of resident managed layers
  params,    // parameters and buffers outside managed layers (norms, RoPE tables)
  ring,      // staging slots for streamed layers
  scratch,   // upcast outputs (compute-dtype weights of the layer being run)
  lora,      // LoRA sidecars placed through StreamingEngine::place_sidecars
};
constexpr size_t kMemoryKinds = 5;
const char* memory_kind_name(MemoryKind kind);

// Device bytes, in total and by kind.
struct DeviceMemoryStats {
  Stat total;
  std::array<Stat, kMemoryKinds> by_kind{};

  const Stat& kind(MemoryKind k) const { return by_kind[static_cast<size_t>(k)]; }
  void reset_peak();
  void reset_accumulated();
};

}  // namespace sluice::offload
