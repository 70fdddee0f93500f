#pragma once
// "[1, 16, 1, 64, 64]": a tensor shape as error messages and progress lines print it.
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

namespace sluice {

std::string shape_str(c10::IntArrayRef sizes);

}  // namespace sluice
