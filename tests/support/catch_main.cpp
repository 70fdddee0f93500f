// The test programs' main: Catch2's, after SLUICE_CPU_ONEDNN is applied, so that
// `SLUICE_CPU_ONEDNN=off ctest` runs the whole suite on the slow-bf16 path of a CPU without
// AVX-512 (Note [native bf16] in runtime/hardware.h).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "runtime/hardware.h"

int main(int argc, char* argv[]) {
  sluice::apply_cpu_onednn_env();
  return Catch::Session().run(argc, argv);
}
