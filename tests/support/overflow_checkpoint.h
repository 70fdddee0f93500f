#pragma once
// A checkpoint with one layer's weight scaled so that its output overflows on purpose
// (Note [non-finite values] in runtime/nonfinite.h). Shared by test_run.cpp and test_cli.cpp.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include "runtime/safetensors.h"

namespace sluice::testing {

// Copies the checkpoint `src` (metadata included) to `dst` with the weight whose key ends in
// `weight` ("blocks.1.mlp.layer2.weight") scaled so that its largest magnitude is
// `largest`. 3e38 (just below bf16's and fp32's largest finite 3.39e38, so bf16 storage
// holds it) makes the layer's matrix product overflow in every compute dtype, while every
// layer before it stays finite.
inline void write_overflow_checkpoint(const std::string& src, const std::string& dst, const std::string& weight,
                                      double largest) {
  const auto f = safetensors::File::open(src);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  int scaled = 0;
  for (const auto& t : f->tensors()) {
    at::Tensor v = f->tensor(t.name).clone();
    if (t.name.size() >= weight.size() && t.name.compare(t.name.size() - weight.size(), weight.size(), weight) == 0) {
      const at::Tensor w = v.to(at::kDouble);
      v = (w * (largest / w.abs().max().item<double>())).to(v.scalar_type());
      ++scaled;
    }
    tensors.emplace_back(t.name, v);
  }
  REQUIRE(scaled == 1);
  safetensors::save(dst, tensors, f->metadata());
}

}  // namespace sluice::testing
