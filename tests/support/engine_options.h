#pragma once
// The streaming engine's options for a model test on the device `dev` (device_env.h): no
// working memory on the CPU device, whose allocator sees only sluice's own allocations (a
// torch device's also holds the forward's activations and rounds every block, so it gets
// 4 MiB); the plan fixed before any forward, so streamed and resident runs are
// deterministic; no attach log line.
#include <memory>

#include "offload/engine/engine_options.h"

namespace sluice::testing {

inline offload::EngineOptions engine_options(std::shared_ptr<offload::DeviceBackend> dev) {
  offload::EngineOptions o;
  o.working_memory_bytes = dev->device().is_cpu() ? 0 : 4ull << 20;
  o.device = std::move(dev);
  o.plan_from_measurements = false;
  o.log_attach = false;
  return o;
}

}  // namespace sluice::testing
