#pragma once
// Build and version facts about this copy of sluice and the libtorch it runs on.
#include <string>

namespace sluice {

// "sluice 0.1.0 (torch 2.11.0, CUDA sources on|off)".
std::string version_string();

}  // namespace sluice
