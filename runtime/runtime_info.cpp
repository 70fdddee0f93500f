#include "runtime/runtime_info.h"

#include <torch/version.h>

namespace sluice {

std::string version_string() {
  std::string s = "sluice " SLUICE_VERSION_STRING " (torch " TORCH_VERSION;
#ifdef SLUICE_HAS_CUDA
  s += ", CUDA sources on)";
#else
  s += ", CUDA sources off)";
#endif
  return s;
}

}  // namespace sluice
