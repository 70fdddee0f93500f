#pragma once
// One intra-op thread for every test executable that includes this header: the CPU
// device's copy worker (offload/device/cpu_device.h) needs a core of its own, and on a 2-core CI
// machine OpenMP's spinning workers would otherwise compete with it (the toy layers are
// tiny: more threads buy nothing). Set as the executable starts, before any test case.
#include <ATen/Parallel.h>

namespace sluice::testing {

static const bool kSingleThread = [] {
  at::set_num_threads(1);
  return true;
}();

}  // namespace sluice::testing
