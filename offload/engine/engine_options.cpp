#include "offload/engine/engine_options.h"

#include "runtime/error.h"

namespace sluice::offload {

PinMode parse_pin_mode(std::string_view text, const std::string& flag) {
  if (text == "auto") return PinMode::auto_;
  if (text == "on") return PinMode::on;
  if (text == "off") return PinMode::off;
  throw InvalidArgument(flag + ": unknown pin mode '" + std::string(text) + "' (use auto, on or off)");
}

void check_max_resident(std::optional<double> max_resident) {
  if (max_resident && !(*max_resident >= 0.0 && *max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*max_resident));
  }
}

EngineOptions resolve_engine_options(EngineOptions options) {
  check_max_resident(options.max_resident);
  if (options.ring_slots == 0) {
    options.ring_slots = options.prefetch_depth == kPrefetchAuto ? 3 : options.prefetch_depth + 1;
  }
  return options;
}

}  // namespace sluice::offload
