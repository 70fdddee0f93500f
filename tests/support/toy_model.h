#pragma once
// A small model made of offload::Linear layers, for engine tests and benchmarks:
// an unconverted "x_embedder" (always resident), N blocks of three fp8 layers
// (blocks.N.{up,mid,down}; "mid" has per-channel scales), plain parameters and a buffer
// outside the managed layers, and "final_layer" (always resident by name).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "offload/layer/layer.h"

namespace sluice::testing {

struct ToyOptions {
  int blocks = 8;                                  // number of blocks
  int64_t dim = 64;                                // model width
  int64_t hidden = 128;                            // block MLP width
  at::ScalarType storage = at::kFloat8_e4m3fn;     // stored dtype of block and final layers
  at::ScalarType compute = at::kFloat;             // compute dtype
  uint64_t seed = 0;                               // weight init
};

// Casts `w` to the storage dtype (with a per-row scale when `scaled`) into `layer`.
inline void store(offload::ManagedLayerImpl& layer, const at::Tensor& w, const at::Tensor& b, at::ScalarType storage,
                  at::ScalarType compute, bool scaled) {
  at::Tensor stored_w, scale;
  if (scaled) {
    scale = (w.abs().amax({1}) / 448.0).clamp_min(1e-12).to(at::kFloat);
    stored_w = (w / scale.unsqueeze(1)).to(storage);
  } else {
    stored_w = w.to(storage);
  }
  layer.set_stored(stored_w, b.defined() ? std::optional<at::Tensor>(b.to(storage)) : std::nullopt);
  layer.set_weight_scale(scale);
  layer.set_compute_dtype(compute);
}

class ToyBlockImpl : public torch::nn::Module {
 public:
  ToyBlockImpl(const ToyOptions& o, at::Generator& gen) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    up = register_module("up", offload::Linear(o.dim, o.hidden, true, f32));
    mid = register_module("mid", offload::Linear(o.hidden, o.hidden, false, f32));
    down = register_module("down", offload::Linear(o.hidden, o.dim, true, f32));
    auto init = [&](offload::LinearImpl& l, int64_t in, int64_t out, bool bias, bool scaled) {
      at::Tensor w = at::randn({out, in}, gen, f32) / std::sqrt(static_cast<double>(in));
      at::Tensor b = bias ? at::randn({out}, gen, f32) * 0.1 : at::Tensor();
      store(l, w, b, o.storage, o.compute, scaled);
    };
    init(*up, o.dim, o.hidden, true, false);
    init(*mid, o.hidden, o.hidden, false, true);
    init(*down, o.hidden, o.dim, true, false);
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(up(x));
    if (fail_in_mid) {
      offload::WeightLease lease(*mid);  // the failure happens while mid's weights are leased
      throw std::runtime_error("injected failure in " + mid->qualified_name());
    }
    h = at::gelu(mid(h));
    return x + down(h);
  }

  offload::Linear up{nullptr}, mid{nullptr}, down{nullptr};
  bool fail_in_mid = false;
};
TORCH_MODULE(ToyBlock);

class ToyModelImpl : public torch::nn::Module {
 public:
  explicit ToyModelImpl(const ToyOptions& o = {}) {
    at::Generator gen = at::detail::createCPUGenerator(o.seed + 1);
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    x_embedder = register_module("x_embedder", offload::Linear(o.dim, o.dim, true, f32));
    store(*x_embedder, at::randn({o.dim, o.dim}, gen, f32) / std::sqrt(static_cast<double>(o.dim)),
          at::randn({o.dim}, gen, f32) * 0.1, o.compute, o.compute, false);  // unconverted: streams without an upcast
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < o.blocks; ++i) {
      ToyBlock b(o, gen);
      blocks->push_back(b);
      block_list.push_back(b);
    }
    norm_weight = register_parameter("norm_weight", 1.0 + 0.1 * at::randn({o.dim}, gen, f32), false);
    shift = register_buffer("shift", 0.01 * at::randn({o.dim}, gen, f32));
    final_layer = register_module("final_layer", offload::Linear(o.dim, o.dim, false, f32));
    store(*final_layer, at::randn({o.dim, o.dim}, gen, f32) / std::sqrt(static_cast<double>(o.dim)), at::Tensor(),
          o.storage, o.compute, false);
    for (auto& [name, layer] : offload::managed_layers(*this)) layer->set_qualified_name(name);
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x_embedder(x.to(norm_weight.device()));
    for (size_t i = 0; i < block_list.size(); ++i) {
      if (static_cast<int>(i) == skip_block) continue;
      if (swap_blocks && (i == 1 || i == 2)) {
        h = block_list[3 - i](h);  // runs 2 then 1
        continue;
      }
      h = block_list[i](h);
    }
    h = h * norm_weight + shift;
    return final_layer(h);
  }

  offload::Linear x_embedder{nullptr}, final_layer{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<ToyBlock> block_list;
  at::Tensor norm_weight, shift;
  int skip_block = -1;       // a block to leave out (a forward that differs from the recorded one)
  bool swap_blocks = false;  // run block 2 before block 1
};
TORCH_MODULE(ToyModel);

}  // namespace sluice::testing
