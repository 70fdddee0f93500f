#pragma once
// The one-line error of a subcommand whose forward gave a non-finite output (sluice run,
// sluice forward); Note [non-finite values] in runtime/nonfinite.h.
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include <sluice/sluice.hpp>

namespace sluice::cli {

// "the dit forward's velocity is non-finite (12288 of 65536 values); first non-finite
// output: blocks.5.mlp.layer2 (re-run with a per-layer check)". `kind` is the forward's
// ("dit", "adapter"), `output` what it gave ("velocity"), `value` that output (or its host
// copy), `where` what LockedModel::locate_nonfinite found.
std::string nonfinite_output_message(const std::string& kind, const std::string& output, const at::Tensor& value,
                                     const std::optional<NonFiniteReport>& where);

}  // namespace sluice::cli
