#include "cli/nonfinite_output.h"

#include "runtime/nonfinite.h"

namespace sluice::cli {

std::string nonfinite_output_message(const std::string& kind, const std::string& output, const at::Tensor& value,
                                     const std::optional<NonFiniteReport>& where) {
  const auto bad = find_nonfinite(value);
  std::string m = "the " + kind + " forward's " + output + " is non-finite (" + std::to_string(bad ? bad->count : 0) +
                  " of " + std::to_string(value.numel()) + " values); ";
  if (where && !where->module.empty()) return m + "first non-finite output: " + where->module + " (re-run with a per-layer check)";
  if (where) return m + "a re-run with a per-layer check found every module's output finite but the forward's";
  return m + "a re-run with a per-layer check found no non-finite value (the forward is not deterministic)";
}

}  // namespace sluice::cli
