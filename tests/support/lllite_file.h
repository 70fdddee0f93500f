#pragma once
// A random ControlNet-LLLite file (v2 named-key format, models/anima/lllite.h) for tests and
// benchmarks: every target of every block, with non-zero up and FiLM weights so that it
// moves the output.
#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace sluice::testing {

struct LLLiteFileSpec {
  int64_t dim = 64;           // the model's width (in_features of every target)
  int64_t blocks = 2;
  int64_t cond_dim = 16, emb = 24, mlp = 8, resblocks = 1;
  bool aspp = false;
  int64_t in_channels = 3;
  uint64_t seed = 11;
};

// A random v2 LLLite file, non-zero up/film so that it matters.
inline std::vector<std::pair<std::string, at::Tensor>> lllite_file(const LLLiteFileSpec& s) {
  at::manual_seed(static_cast<int64_t>(s.seed));
  std::vector<std::pair<std::string, at::Tensor>> t;
  const std::string p = "lllite_conditioning1.";
  const int64_t half = s.cond_dim / 2, cd = s.cond_dim;
  auto conv = [&](const std::string& n, int64_t out, int64_t in, int64_t k) {
    t.emplace_back(p + n + ".weight", at::randn({out, in, k, k}) * (1.0 / std::sqrt(double(in * k * k))));
    t.emplace_back(p + n + ".bias", at::randn({out}) * 0.1);
  };
  auto norm = [&](const std::string& n, int64_t ch) {
    t.emplace_back(p + n + ".weight", 1 + at::randn({ch}) * 0.1);
    t.emplace_back(p + n + ".bias", at::randn({ch}) * 0.1);
  };
  conv("conv1", half, s.in_channels, 4);
  norm("norm1", half);
  conv("conv2", half, half, 3);
  norm("norm2", half);
  conv("conv3", cd, half, 4);
  norm("norm3", cd);
  for (int64_t i = 0; i < s.resblocks; ++i) {
    const std::string r = "resblocks." + std::to_string(i) + ".";
    norm(r + "norm1", cd);
    conv(r + "conv1", cd, cd, 3);
    norm(r + "norm2", cd);
    conv(r + "conv2", cd, cd, 3);
  }
  if (s.aspp) {
    const int64_t d[] = {1, 2, 4, 8};
    for (int j = 0; j < 4; ++j) {
      conv("aspp.branches." + std::to_string(j) + ".0", cd, cd, d[j] == 1 ? 1 : 3);
      norm("aspp.branches." + std::to_string(j) + ".1", cd);
    }
    conv("aspp.global_conv.0", cd, cd, 1);
    norm("aspp.global_conv.1", cd);
    conv("aspp.proj.0", cd, cd * 5, 1);
    norm("aspp.proj.1", cd);
  }
  conv("proj", s.emb, cd, 1);
  norm("out_norm", s.emb);
  for (int64_t b = 0; b < s.blocks; ++b) {
    for (const char* target : {"self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "cross_attn_q_proj",
                               "mlp_layer1"}) {
      const std::string m = "lllite_dit_blocks_" + std::to_string(b) + "_" + target + ".";
      t.emplace_back(m + "down.weight", at::randn({s.mlp, s.dim}) * 0.1);
      t.emplace_back(m + "down.bias", at::randn({s.mlp}) * 0.1);
      t.emplace_back(m + "mid.weight", at::randn({s.mlp, s.mlp + s.emb}) * 0.2);
      t.emplace_back(m + "mid.bias", at::randn({s.mlp}) * 0.1);
      t.emplace_back(m + "cond_to_film.weight", at::randn({2 * s.mlp, s.emb}) * 0.1);
      t.emplace_back(m + "cond_to_film.bias", at::randn({2 * s.mlp}) * 0.1);
      t.emplace_back(m + "up.weight", at::randn({s.dim, s.mlp}) * 0.2);
      t.emplace_back(m + "up.bias", at::randn({s.dim}) * 0.05);
      t.emplace_back(m + "depth_embed", at::randn({s.emb}) * 0.1);
    }
  }
  return t;
}

}  // namespace sluice::testing
