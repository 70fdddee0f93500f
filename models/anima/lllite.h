#pragma once
// ControlNet-LLLite for Anima, v2 named-key format (as InvokeAI 6.14.2 loads it; kohya's
// sd-scripts train it): read and validate the file, prepare the conditioning image, and bind
// the adapter to a model for the lifetime of an LLLiteScope. See Note [LLLite].
//
// Note [LLLite]
// ~~~~~~~~~~~~~
// A file holds a shared conditioning trunk under "lllite_conditioning1." (strided convs,
// GroupNorms, residual blocks, optional ASPP, a 1x1 projection and a LayerNorm) and one small
// module per targeted Linear under "lllite_dit_blocks_{i}_{target}." (down, mid,
// cond_to_film, up, depth_embed); targets are self_attn_{q,k,v}_proj, cross_attn_q_proj and
// mlp_layer1. Hyperparameters come from the "lllite.*" metadata, else from tensor shapes.
// Each module perturbs its Linear's input (an offload::InputAdapter, Note [input adapters]):
//   x' = x + up(silu(FiLM(mid([c, silu(down(x))])))) * weight,  c = cond + depth_embed,
// FiLM(m) = m * (1 + gamma) + beta with (gamma, beta) = cond_to_film(c). The trunk runs
// once per conditioning image and token grid (the model tells it the grid before its blocks
// run, anima::ForwardListener): the image is resized bicubically to the padded latent size
// x 8 and mapped [0,1] -> [-1,1]; an inpaint adapter (4 input channels) appends the mask
// (nearest, thresholded at 0.5, mapped to [-1,1]) and zeroes the masked RGB when its
// metadata says lllite.inpaint_masked_input. The embedding and each module's FiLM terms are
// kept until the grid, device or dtype changes. A token count that differs from the
// embedding's (T > 1) passes through, as it does in InvokeAI; weight 0 or no image is an
// exact passthrough (the layer gets its input tensor itself).
// The module and trunk weights are placed in the compute dtype like LoRA sidecars (Note
// [LoRA sidecars] in models/lora.h: charged to the model's share through an
// offload::SidecarPlacer) and released when the scope ends; the stored weights are never
// touched, so removal restores the plain output bit for bit.
//
// Tested by: tests/models/anima/test_lllite.cpp, tests/api/test_lllite_api.cpp (the C++ and C API),
// tests/python/test_lllite_parity.py (against InvokeAI's AnimaControlNetLLLite),
// tests/cli/test_lllite_cli.cpp (sluice forward/run --lllite).
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sluice::offload {
class ManagedLayerImpl;
class SidecarPlacer;
}  // namespace sluice::offload

namespace sluice::anima {

class AnimaModelImpl;

// Hyperparameters of an LLLite file (metadata "lllite.*", else read off the shapes).
struct LLLiteConfig {
  int64_t cond_emb_dim = 0;    // lllite.cond_emb_dim: width of the per-token embedding
  int64_t mlp_dim = 0;         // lllite.mlp_dim: width of each module's MLP
  int64_t cond_dim = 0;        // lllite.cond_dim: channels of the trunk (even)
  int64_t cond_resblocks = 0;  // lllite.cond_resblocks
  bool use_aspp = false;       // lllite.use_aspp
  std::vector<int64_t> aspp_dilations = {1, 2, 4, 8};  // lllite.aspp_dilations ("1,2,4,8")
  int64_t cond_in_channels = 3;       // lllite.cond_in_channels: 3 (RGB) or 4 (RGB + inpaint mask)
  bool inpaint_masked_input = false;  // lllite.inpaint_masked_input: zero the RGB under the mask
};

// One module: the Linear it perturbs and its weights (as read, CPU).
struct LLLiteModule {
  std::string name;    // "lllite_dit_blocks_3_self_attn_q_proj"
  int64_t block = 0;   // the block index in the file
  std::string target;  // "self_attn.q_proj", under blocks.<block>.
  int64_t in_dim = 0;
  // down, mid, cond_to_film, up: weight and bias each; depth_embed.
  at::Tensor down_w, down_b, mid_w, mid_b, film_w, film_b, up_w, up_b, depth_embed;
};

// An LLLite file, validated.
struct LLLiteAdapter {
  std::string source;  // the file (or a name given by the caller), for messages
  LLLiteConfig config;
  std::vector<std::pair<std::string, at::Tensor>> trunk;  // "conv1.weight", ... (prefix dropped)
  std::vector<LLLiteModule> modules;                      // by block, then target
  int64_t max_block() const;
  uint64_t host_bytes() const;  // as read
};

// Validates named tensors and metadata of an LLLite file. Throws CheckpointError naming
// `source` and what is wrong (one line): the legacy format ("lllite_modules." keys), no
// module, an unknown module name, a key that belongs nowhere, a missing key, a shape that
// does not match the hyperparameters, a non-float tensor, a bad metadata value.
LLLiteAdapter lllite_from_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                  const std::map<std::string, std::string>& metadata, const std::string& source);
// Reads an LLLite safetensors file (FileError when unreadable) and validates it as above.
LLLiteAdapter load_lllite(const std::string& path);

// The trunk's input for a token grid: image [3,H,W] or [1,3,H,W] (RGB in [0,1], any size)
// resized to (latent_h * 8, latent_w * 8) and mapped to [-1,1]; with 4 input channels the
// mask [H,W], [1,H,W] or [1,1,H,W] appended (Note [LLLite]). fp32 on the image's device.
at::Tensor lllite_cond_input(const LLLiteConfig& config, const at::Tensor& image, const std::optional<at::Tensor>& mask,
                             int64_t latent_h, int64_t latent_w);

// Checks a conditioning image (and mask) for `adapter`: InvalidArgument naming it for a bad
// shape or dtype, a mask given to an RGB adapter, or an inpaint adapter without one. An
// undefined image is no image (the adapter then passes through).
void check_lllite_inputs(const LLLiteAdapter& adapter, const at::Tensor& image, const std::optional<at::Tensor>& mask);

namespace detail {
struct LLLiteShared;
}

// Binds `adapter` to `model` while alive (Note [LLLite]). `measured_blocks`: an adapter
// trained on a shallower Anima goes to its blocks' measured positions (Note [Anima block
// layout] in block_layout.h), else indices as they are. Placement as LoraScope's (placer,
// else the engine the model is attached to, else `device` or the layer's). Throws, before
// binding anything: CheckpointError when a target is missing from the model or its
// in_features differ (naming the module and the layer), also for a deeper adapter;
// InvalidArgument for a bad image/mask or a non-finite weight; what placing throws.
class LLLiteScope {
 public:
  LLLiteScope(AnimaModelImpl& model, const LLLiteAdapter& adapter, const at::Tensor& image, double weight = 1.0,
              const std::optional<at::Tensor>& mask = std::nullopt, bool measured_blocks = true,
              std::optional<at::Device> device = std::nullopt, offload::SidecarPlacer* placer = nullptr);
  ~LLLiteScope();
  LLLiteScope(const LLLiteScope&) = delete;
  LLLiteScope& operator=(const LLLiteScope&) = delete;

  // The weight of later forwards (InvalidArgument when not finite); 0 passes through.
  void set_weight(double weight);
  double weight() const;
  int64_t id() const { return id_; }
  int64_t modules() const { return modules_; }
  int64_t bound_layers() const { return static_cast<int64_t>(layers_.size()); }
  uint64_t device_bytes() const { return bytes_; }  // placed weights, compute dtype
  // How the adapter's blocks were mapped onto the model (empty when as is).
  const std::string& remap_line() const { return remap_line_; }

 private:
  int64_t id_;
  AnimaModelImpl& model_;
  offload::SidecarPlacer* placer_ = nullptr;
  uint64_t bytes_ = 0;
  int64_t modules_ = 0;
  std::string remap_line_;
  std::shared_ptr<detail::LLLiteShared> shared_;
  std::vector<std::shared_ptr<offload::ManagedLayerImpl>> layers_;
};

}  // namespace sluice::anima
