#include "models/anima/lllite.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <regex>
#include <set>

#include "models/anima/anima.h"
#include "models/anima/block_layout.h"
#include "offload/layer/layer.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "runtime/shape_str.h"

namespace sluice::anima {

namespace {

const char* const kTrunkPrefix = "lllite_conditioning1.";
const char* const kLegacyPrefix = "lllite_modules.";
const char* const kModulePrefix = "lllite_dit_blocks_";

// The saved target suffixes, in InvokeAI's order, and the Linear each one names under blocks.<i>.
const std::vector<std::pair<std::string, std::string>>& targets() {
  static const std::vector<std::pair<std::string, std::string>> t = {
      {"self_attn_q_proj", "self_attn.q_proj"}, {"self_attn_k_proj", "self_attn.k_proj"},
      {"self_attn_v_proj", "self_attn.v_proj"}, {"cross_attn_q_proj", "cross_attn.q_proj"},
      {"mlp_layer1", "mlp.layer1"}};
  return t;
}

int64_t gn_groups(int64_t channels) {
  int64_t g = 8;
  while (g > 1 && channels % g != 0) g /= 2;
  return g;
}

std::string list_some(const std::vector<std::string>& items) {
  std::string s;
  const size_t n = std::min<size_t>(items.size(), 5);
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + items[i];
  if (items.size() > n) s += c10::str(", ... (", items.size(), " in all)");
  return s;
}

int64_t meta_int(const std::map<std::string, std::string>& meta, const std::string& key, int64_t fallback,
                 const std::string& source) {
  const auto it = meta.find(key);
  if (it == meta.end()) return fallback;
  try {
    size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used == it->second.size() && v > 0) return v;
  } catch (const std::exception&) {
  }
  throw CheckpointError("LLLite '" + source + "': metadata " + key + " is '" + it->second + "' (want a positive integer)");
}

bool meta_bool(const std::map<std::string, std::string>& meta, const std::string& key, bool fallback) {
  const auto it = meta.find(key);
  if (it == meta.end()) return fallback;
  std::string v = it->second;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  return v == "true";  // as InvokeAI reads it
}

// Expected shapes of the trunk's tensors (names without the prefix).
std::map<std::string, std::vector<int64_t>> trunk_shapes(const LLLiteConfig& c) {
  std::map<std::string, std::vector<int64_t>> s;
  const int64_t half = c.cond_dim / 2, cd = c.cond_dim;
  auto conv = [&](const std::string& n, int64_t out, int64_t in, int64_t k) {
    s[n + ".weight"] = {out, in, k, k};
    s[n + ".bias"] = {out};
  };
  auto norm = [&](const std::string& n, int64_t ch) {
    s[n + ".weight"] = {ch};
    s[n + ".bias"] = {ch};
  };
  conv("conv1", half, c.cond_in_channels, 4);
  norm("norm1", half);
  conv("conv2", half, half, 3);
  norm("norm2", half);
  conv("conv3", cd, half, 4);
  norm("norm3", cd);
  for (int64_t i = 0; i < c.cond_resblocks; ++i) {
    const std::string r = c10::str("resblocks.", i, ".");
    norm(r + "norm1", cd);
    conv(r + "conv1", cd, cd, 3);
    norm(r + "norm2", cd);
    conv(r + "conv2", cd, cd, 3);
  }
  if (c.use_aspp) {
    for (size_t j = 0; j < c.aspp_dilations.size(); ++j) {
      const std::string b = c10::str("aspp.branches.", j, ".");
      conv(b + "0", cd, cd, c.aspp_dilations[j] == 1 ? 1 : 3);
      norm(b + "1", cd);
    }
    conv("aspp.global_conv.0", cd, cd, 1);
    norm("aspp.global_conv.1", cd);
    conv("aspp.proj.0", cd, cd * static_cast<int64_t>(c.aspp_dilations.size() + 1), 1);
    norm("aspp.proj.1", cd);
  }
  conv("proj", c.cond_emb_dim, cd, 1);
  norm("out_norm", c.cond_emb_dim);
  return s;
}

std::map<std::string, std::vector<int64_t>> module_shapes(const LLLiteConfig& c, int64_t in) {
  const int64_t m = c.mlp_dim, e = c.cond_emb_dim;
  return {{"down.weight", {m, in}},         {"down.bias", {m}},
          {"mid.weight", {m, m + e}},       {"mid.bias", {m}},
          {"cond_to_film.weight", {2 * m, e}}, {"cond_to_film.bias", {2 * m}},
          {"up.weight", {in, m}},           {"up.bias", {in}},
          {"depth_embed", {e}}};
}

}  // namespace

int64_t LLLiteAdapter::max_block() const {
  int64_t b = -1;
  for (const auto& m : modules) b = std::max(b, m.block);
  return b;
}

uint64_t LLLiteAdapter::host_bytes() const {
  uint64_t n = 0;
  for (const auto& [k, t] : trunk) n += t.nbytes();
  for (const auto& m : modules) {
    for (const at::Tensor* t : {&m.down_w, &m.down_b, &m.mid_w, &m.mid_b, &m.film_w, &m.film_b, &m.up_w, &m.up_b,
                                &m.depth_embed}) {
      n += t->nbytes();
    }
  }
  return n;
}

LLLiteAdapter lllite_from_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                  const std::map<std::string, std::string>& metadata, const std::string& source) {
  const std::string what = "LLLite '" + source + "'";
  static const std::regex module_re(
      "^lllite_dit_blocks_(\\d+)_(self_attn_q_proj|self_attn_k_proj|self_attn_v_proj|cross_attn_q_proj|mlp_layer1)$");
  std::map<std::string, at::Tensor> trunk;
  std::map<std::string, std::map<std::string, at::Tensor>> by_module;
  std::vector<std::string> unknown_modules, stray, non_float;
  std::set<std::string> unknown_seen;
  for (const auto& [key, t] : tensors) {
    if (key.rfind(kLegacyPrefix, 0) == 0) {
      throw CheckpointError(what + " is in the legacy LLLite format (key '" + key +
                            "'); only the v2 named-key format (lllite_conditioning1.*, lllite_dit_blocks_*) is supported");
    }
    if (!t.is_floating_point()) {
      non_float.push_back(c10::str(key, " (", t.scalar_type(), ")"));
      continue;
    }
    if (key.rfind(kTrunkPrefix, 0) == 0) {
      trunk[key.substr(std::string(kTrunkPrefix).size())] = t;
      continue;
    }
    const size_t dot = key.find('.');
    const std::string head = key.substr(0, dot);
    if (dot != std::string::npos && std::regex_match(head, module_re)) {
      by_module[head][key.substr(dot + 1)] = t;
    } else if (key.rfind(kModulePrefix, 0) == 0) {
      if (unknown_seen.insert(head).second) unknown_modules.push_back(head);
    } else {
      stray.push_back(key);
    }
  }
  if (!unknown_modules.empty()) {
    throw CheckpointError(c10::str(what, ": unknown LLLite module name", unknown_modules.size() > 1 ? "s" : "", " ",
                                   list_some(unknown_modules),
                                   " (known: lllite_dit_blocks_<i>_{self_attn_q_proj, self_attn_k_proj, "
                                   "self_attn_v_proj, cross_attn_q_proj, mlp_layer1})"));
  }
  if (!stray.empty()) {
    throw CheckpointError(c10::str(what, ": ", stray.size(), " keys that are no LLLite key: ", list_some(stray)));
  }
  if (!non_float.empty()) {
    throw CheckpointError(c10::str(what, ": non-float tensors: ", list_some(non_float)));
  }
  if (by_module.empty()) throw CheckpointError(what + " holds no LLLite module (no 'lllite_dit_blocks_*' keys)");

  // Modules by block, then target (InvokeAI's order).
  std::vector<LLLiteModule> modules;
  for (const auto& [name, parts] : by_module) {
    std::smatch m;
    std::regex_match(name, m, module_re);
    LLLiteModule mod;
    mod.name = name;
    mod.block = std::stoll(m[1].str());
    for (const auto& [saved, attr] : targets())
      if (saved == m[2].str()) mod.target = attr;
    const auto down = parts.find("down.weight");
    if (down == parts.end()) throw CheckpointError(what + ": module " + name + " is missing '" + name + ".down.weight'");
    if (down->second.dim() != 2) {
      throw CheckpointError(what + ": " + name + ".down.weight has shape " + shape_str(down->second.sizes()) +
                            " (want [mlp_dim, in_features])");
    }
    mod.in_dim = down->second.size(1);
    modules.push_back(std::move(mod));
  }
  auto order = [](const std::string& target) {
    const auto& t = targets();
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i].second == target) return i;
    return t.size();
  };
  std::sort(modules.begin(), modules.end(), [&](const LLLiteModule& a, const LLLiteModule& b) {
    return a.block != b.block ? a.block < b.block : order(a.target) < order(b.target);
  });

  auto need_trunk = [&](const std::string& k) -> const at::Tensor& {
    const auto it = trunk.find(k);
    if (it == trunk.end()) throw CheckpointError(what + " is missing key '" + kTrunkPrefix + k + "'");
    if (it->second.dim() < 2) {
      throw CheckpointError(what + ": " + kTrunkPrefix + k + " has shape " + shape_str(it->second.sizes()));
    }
    return it->second;
  };
  std::set<int64_t> resblocks;
  bool has_aspp = false;
  static const std::regex res_re("^resblocks\\.(\\d+)\\..*");
  for (const auto& [k, t] : trunk) {
    std::smatch m;
    if (std::regex_match(k, m, res_re)) resblocks.insert(std::stoll(m[1].str()));
    if (k.rfind("aspp.", 0) == 0) has_aspp = true;
  }
  LLLiteConfig c;
  c.cond_emb_dim = meta_int(metadata, "lllite.cond_emb_dim", need_trunk("proj.weight").size(0), source);
  c.mlp_dim = meta_int(metadata, "lllite.mlp_dim", by_module.at(modules.front().name).at("down.weight").size(0), source);
  c.cond_dim = meta_int(metadata, "lllite.cond_dim", need_trunk("conv3.weight").size(0), source);
  c.cond_resblocks = static_cast<int64_t>(resblocks.size());
  if (metadata.count("lllite.cond_resblocks")) {
    c.cond_resblocks = metadata.at("lllite.cond_resblocks") == "0" ? 0 : meta_int(metadata, "lllite.cond_resblocks", 0, source);
  }
  c.use_aspp = meta_bool(metadata, "lllite.use_aspp", has_aspp);
  if (c.use_aspp && metadata.count("lllite.aspp_dilations") && !metadata.at("lllite.aspp_dilations").empty()) {
    c.aspp_dilations.clear();
    const std::string& s = metadata.at("lllite.aspp_dilations");
    size_t pos = 0;
    while (pos <= s.size()) {
      const size_t comma = std::min(s.find(',', pos), s.size());
      std::string part = s.substr(pos, comma - pos);
      part.erase(std::remove_if(part.begin(), part.end(), [](unsigned char ch) { return std::isspace(ch); }), part.end());
      if (!part.empty()) {
        std::map<std::string, std::string> one{{"lllite.aspp_dilations", part}};
        c.aspp_dilations.push_back(meta_int(one, "lllite.aspp_dilations", 1, source));
      }
      pos = comma + 1;
    }
    if (c.aspp_dilations.empty()) throw CheckpointError(what + ": metadata lllite.aspp_dilations is '" + s + "' (no dilation)");
  }
  c.cond_in_channels = meta_int(metadata, "lllite.cond_in_channels", need_trunk("conv1.weight").size(1), source);
  c.inpaint_masked_input = meta_bool(metadata, "lllite.inpaint_masked_input", false);
  if (c.cond_dim % 2 != 0) throw CheckpointError(c10::str(what, ": cond_dim ", c.cond_dim, " is odd (want even)"));
  if (c.cond_in_channels != 3 && c.cond_in_channels != 4) {
    throw CheckpointError(c10::str(what, ": cond_in_channels ", c.cond_in_channels,
                                   " (want 3, RGB, or 4, RGB + inpaint mask)"));
  }

  // Every tensor against the shapes the hyperparameters give: missing, unexpected, mismatched.
  std::vector<std::string> missing, unexpected, mismatched;
  auto check = [&](const std::string& prefix, const std::map<std::string, at::Tensor>& have,
                   const std::map<std::string, std::vector<int64_t>>& want) {
    for (const auto& [k, shape] : want) {
      const auto it = have.find(k);
      if (it == have.end()) {
        missing.push_back(prefix + k);
      } else if (it->second.sizes() != at::IntArrayRef(shape)) {
        mismatched.push_back(c10::str(prefix, k, " is ", shape_str(it->second.sizes()), ", want ",
                                      shape_str(at::IntArrayRef(shape))));
      }
    }
    for (const auto& [k, t] : have)
      if (!want.count(k)) unexpected.push_back(prefix + k);
  };
  check(kTrunkPrefix, trunk, trunk_shapes(c));
  for (const auto& mod : modules) check(mod.name + ".", by_module.at(mod.name), module_shapes(c, mod.in_dim));
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = what + " does not fit its hyperparameters";
    msg += c10::str(" (cond_dim ", c.cond_dim, ", cond_emb_dim ", c.cond_emb_dim, ", mlp_dim ", c.mlp_dim,
                    ", cond_resblocks ", c.cond_resblocks, ", use_aspp ", c.use_aspp ? "true" : "false",
                    ", cond_in_channels ", c.cond_in_channels, "):");
    std::string sep = " ";
    auto add = [&](const std::vector<std::string>& v, const char* label) {
      if (v.empty()) return;
      msg += c10::str(sep, v.size(), " ", label, ": ", list_some(v));
      sep = "; ";
    };
    add(missing, "missing keys");
    add(mismatched, "shape mismatches");
    add(unexpected, "unexpected keys");
    throw CheckpointError(msg);
  }

  at::NoGradGuard no_grad;
  auto own = [&](const std::string& key, const at::Tensor& t) {
    at::Tensor o = t.to(at::kCPU).contiguous().clone();  // the inputs may be views on a file mapping
    if (!at::isfinite(o.to(at::kFloat)).all().item<bool>()) {
      throw CheckpointError(what + ": tensor '" + key + "' holds NaN or inf values");
    }
    return o;
  };
  LLLiteAdapter a;
  a.source = source;
  a.config = c;
  for (const auto& [k, shape] : trunk_shapes(c)) a.trunk.emplace_back(k, own(kTrunkPrefix + k, trunk.at(k)));
  for (auto& mod : modules) {
    const auto& p = by_module.at(mod.name);
    auto get = [&](const char* k) { return own(mod.name + "." + k, p.at(k)); };
    mod.down_w = get("down.weight");
    mod.down_b = get("down.bias");
    mod.mid_w = get("mid.weight");
    mod.mid_b = get("mid.bias");
    mod.film_w = get("cond_to_film.weight");
    mod.film_b = get("cond_to_film.bias");
    mod.up_w = get("up.weight");
    mod.up_b = get("up.bias");
    mod.depth_embed = get("depth_embed");
  }
  a.modules = std::move(modules);
  return a;
}

LLLiteAdapter load_lllite(const std::string& path) {
  const auto file = safetensors::File::open(path);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  tensors.reserve(file->tensors().size());
  for (const auto& info : file->tensors()) tensors.emplace_back(info.name, file->read(info.name));
  return lllite_from_tensors(tensors, file->metadata(), path);
}

// ---------------------------------------------------------------------------------------
// Conditioning image

namespace {

at::Tensor image_4d(const at::Tensor& image) { return image.dim() == 3 ? image.unsqueeze(0) : image; }

at::Tensor mask_4d(const at::Tensor& mask) {
  if (mask.dim() == 2) return mask.unsqueeze(0).unsqueeze(0);
  if (mask.dim() == 3) return mask.unsqueeze(1);
  return mask;
}

}  // namespace

void check_lllite_inputs(const LLLiteAdapter& adapter, const at::Tensor& image, const std::optional<at::Tensor>& mask) {
  const std::string what = "LLLite '" + adapter.source + "'";
  if (!image.defined()) return;  // no image: the adapter passes through
  const bool shape_ok = (image.dim() == 3 && image.size(0) == 3) || (image.dim() == 4 && image.size(0) == 1 && image.size(1) == 3);
  if (!shape_ok || image.numel() == 0) {
    throw InvalidArgument(what + ": the conditioning image has shape " + shape_str(image.sizes()) +
                          " (want [3, H, W] or [1, 3, H, W], RGB in [0, 1])");
  }
  if (!image.is_floating_point()) {
    throw InvalidArgument(what + ": the conditioning image has dtype " + std::string(c10::toString(image.scalar_type())) +
                          " (want a floating-point RGB in [0, 1])");
  }
  const bool inpaint = adapter.config.cond_in_channels == 4;
  if (inpaint && !mask) {
    throw InvalidArgument(what + " is an inpaint adapter (4 input channels): it needs a mask (1 = inpaint, 0 = keep)");
  }
  if (!inpaint && mask) {
    throw InvalidArgument(what + " takes an RGB image only (3 input channels): it takes no mask");
  }
  if (mask) {
    const at::Tensor& m = *mask;
    const bool ok = m.defined() && m.numel() > 0 &&
                    (m.dim() == 2 || (m.dim() == 3 && m.size(0) == 1) || (m.dim() == 4 && m.size(0) == 1 && m.size(1) == 1));
    if (!ok) {
      throw InvalidArgument(what + ": the mask has shape " + (m.defined() ? shape_str(m.sizes()) : std::string("undefined")) +
                            " (want [H, W], [1, H, W] or [1, 1, H, W] in [0, 1])");
    }
    if (!m.is_floating_point() && m.scalar_type() != at::kBool) {
      throw InvalidArgument(what + ": the mask has dtype " + std::string(c10::toString(m.scalar_type())) +
                            " (want floating point or bool)");
    }
  }
}

at::Tensor lllite_cond_input(const LLLiteConfig& config, const at::Tensor& image, const std::optional<at::Tensor>& mask,
                             int64_t latent_h, int64_t latent_w) {
  at::NoGradGuard no_grad;
  const int64_t th = latent_h * 8, tw = latent_w * 8;
  at::Tensor img = image_4d(image).to(at::kFloat);
  if (img.size(2) != th || img.size(3) != tw) {
    img = at::upsample_bicubic2d(img, {th, tw}, /*align_corners=*/false).clamp(0.0, 1.0);
  }
  at::Tensor rgb = img * 2.0 - 1.0;
  if (config.cond_in_channels != 4) return rgb;
  TORCH_INTERNAL_ASSERT(mask.has_value(), "an inpaint LLLite needs a mask (check_lllite_inputs)");
  at::Tensor m = mask_4d(*mask).to(rgb.device(), at::kFloat);
  if (m.size(2) != th || m.size(3) != tw) m = at::upsample_nearest2d(m, {th, tw});
  m = (m >= 0.5).to(at::kFloat);
  if (config.inpaint_masked_input) rgb = rgb * (m < 0.5).to(rgb.scalar_type());
  return at::cat({rgb, m * 2.0 - 1.0}, 1);
}

// ---------------------------------------------------------------------------------------
// Binding

namespace detail {

// What the modules of one scope share: the trunk, the image, the weight, the embedding.
struct LLLiteShared : ForwardListener {
  std::string source;
  LLLiteConfig config;
  std::map<std::string, at::Tensor> trunk;  // placed, compute dtype
  at::Tensor image;                         // [1,3,H,W] fp32, host
  std::optional<at::Tensor> mask;
  std::atomic<double> requested_weight{1.0};
  double weight = 1.0;  // of the running forward (begin_forward reads requested_weight)
  // The embedding for the last grid: [1, S, cond_emb_dim].
  int64_t H = -1, W = -1;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  at::Tensor embedding;
  uint64_t generation = 0;  // bumped with each new embedding

  const at::Tensor& w(const std::string& k) const { return trunk.at(k); }

  at::Tensor conv(const at::Tensor& x, const std::string& n, int64_t stride, int64_t pad, int64_t dil = 1) const {
    return at::conv2d(x, w(n + ".weight"), w(n + ".bias"), {stride, stride}, {pad, pad}, {dil, dil});
  }
  at::Tensor gn(const at::Tensor& x, const std::string& n) const {
    return at::group_norm(x, gn_groups(x.size(1)), w(n + ".weight"), w(n + ".bias"), 1e-5);
  }

  at::Tensor run_trunk(const at::Tensor& x) const {
    at::Tensor h = at::silu(gn(conv(x, "conv1", 4, 0), "norm1"));
    h = at::silu(gn(conv(h, "conv2", 1, 1), "norm2"));
    h = at::silu(gn(conv(h, "conv3", 4, 0), "norm3"));
    for (int64_t i = 0; i < config.cond_resblocks; ++i) {
      const std::string r = c10::str("resblocks.", i, ".");
      at::Tensor t = conv(at::silu(gn(h, r + "norm1")), r + "conv1", 1, 1);
      t = conv(at::silu(gn(t, r + "norm2")), r + "conv2", 1, 1);
      h = h + t;
    }
    if (config.use_aspp) {
      std::vector<at::Tensor> outs;
      for (size_t j = 0; j < config.aspp_dilations.size(); ++j) {
        const int64_t d = config.aspp_dilations[j];
        const std::string b = c10::str("aspp.branches.", j, ".");
        outs.push_back(at::silu(gn(d == 1 ? conv(h, b + "0", 1, 0) : conv(h, b + "0", 1, d, d), b + "1")));
      }
      at::Tensor g = at::adaptive_avg_pool2d(h, {1, 1});
      g = at::silu(gn(conv(g, "aspp.global_conv.0", 1, 0), "aspp.global_conv.1"));
      g = at::upsample_bilinear2d(g, {h.size(2), h.size(3)}, /*align_corners=*/false);
      outs.push_back(g);
      h = at::silu(gn(conv(at::cat(outs, 1), "aspp.proj.0", 1, 0), "aspp.proj.1"));
    }
    h = conv(h, "proj", 1, 0);
    const int64_t b = h.size(0), c = h.size(1);
    h = h.view({b, c, h.size(2) * h.size(3)}).permute({0, 2, 1}).contiguous();
    return at::layer_norm(h, {c}, w("out_norm.weight"), w("out_norm.bias"), 1e-5);
  }

  void begin_forward(int64_t /*T*/, int64_t Hp, int64_t Wp, at::Device dev, at::ScalarType dt) override {
    weight = requested_weight.load();
    if (weight == 0.0 || !image.defined()) return;
    if (embedding.defined() && Hp == H && Wp == W && dev == device && dt == dtype) return;
    at::NoGradGuard no_grad;
    const at::Tensor in = lllite_cond_input(config, image, mask, Hp, Wp).to(dev, dt);
    // The trunk's weights are where the placer put them; a forward elsewhere (a model moved
    // since) computes with copies.
    if (!trunk.empty() && (trunk.begin()->second.device() != dev || trunk.begin()->second.scalar_type() != dt)) {
      for (auto& [k, t] : trunk) t = t.to(dev, dt);
    }
    embedding = run_trunk(in);
    H = Hp;
    W = Wp;
    device = dev;
    dtype = dt;
    ++generation;
  }
};

// One module bound to one Linear (Note [LLLite]).
struct LLLiteModuleFn : offload::InputPerturbation {
  std::shared_ptr<LLLiteShared> shared;
  at::Tensor down_w, down_b, mid_w, mid_b, film_w, film_b, up_w, up_b, depth_embed;
  // The FiLM terms for the shared embedding of `generation`.
  uint64_t generation = 0;
  at::Tensor cond_local, gamma1, beta;

  at::Tensor operator()(const at::Tensor& x) override {
    const LLLiteShared& s = *shared;
    if (s.weight == 0.0 || !s.embedding.defined()) return x;
    if (x.dim() != 3 || x.size(1) != s.embedding.size(1)) return x;  // another token grid (T > 1)
    at::NoGradGuard no_grad;
    const at::ScalarType dt = down_w.scalar_type();
    if (generation != s.generation || !cond_local.defined()) {
      cond_local = s.embedding.to(x.device(), dt) + depth_embed.to(x.device());
      const auto gb = at::linear(cond_local, film_w, film_b).chunk(2, -1);
      gamma1 = 1 + gb[0];
      beta = gb[1];
      generation = s.generation;
    }
    const at::Tensor xp = x.scalar_type() == dt ? x : x.to(dt);
    const int64_t B = x.size(0);
    const at::Tensor c = B == 1 ? cond_local : cond_local.expand({B, cond_local.size(1), cond_local.size(2)});
    const at::Tensor h = at::silu(at::linear(xp, down_w, down_b));
    at::Tensor m = at::linear(at::cat({c, h}, -1), mid_w, mid_b);
    m = at::silu(m * gamma1 + beta);
    at::Tensor out = at::linear(m, up_w, up_b) * s.weight;
    if (out.scalar_type() != x.scalar_type()) out = out.to(x.scalar_type());
    return x + out;
  }
};

}  // namespace detail

namespace {
std::atomic<int64_t> next_lllite_id{1};
}

LLLiteScope::LLLiteScope(AnimaModelImpl& model, const LLLiteAdapter& adapter, const at::Tensor& image, double weight,
                         const std::optional<at::Tensor>& mask, bool measured_blocks, std::optional<at::Device> device,
                         offload::SidecarPlacer* placer)
    : id_(next_lllite_id.fetch_add(1)), model_(model) {
  const std::string what = "LLLite '" + adapter.source + "'";
  if (!std::isfinite(weight)) throw InvalidArgument(c10::str(what, ": weight ", weight, " is not finite"));
  check_lllite_inputs(adapter, image, mask);

  const AdapterBlockMap blocks = map_adapter_blocks(adapter.max_block(), model.num_blocks(), measured_blocks, what);
  if (blocks.remapped()) remap_line_ = blocks.describe(what);

  std::map<std::string, std::shared_ptr<offload::ManagedLayerImpl>> layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto l = std::dynamic_pointer_cast<offload::ManagedLayerImpl>(item.value())) layers.emplace(item.key(), l);
  }
  if (!placer && !device) {  // attached: the engine that streams the model places them
    for (const auto& [name, layer] : layers) {
      if ((placer = dynamic_cast<offload::SidecarPlacer*>(layer->provider()))) break;
    }
  }
  // Validate every target first, so that a failure binds nothing.
  std::vector<std::shared_ptr<offload::ManagedLayerImpl>> bound;
  std::vector<std::string> missing, mismatched;
  for (const auto& mod : adapter.modules) {
    const std::string name = c10::str("blocks.", blocks(mod.block), ".", mod.target);
    const auto it = layers.find(name);
    if (it == layers.end() || it->second->kind() != offload::LayerKind::linear) {
      missing.push_back(mod.name + " -> " + name);
      continue;
    }
    const int64_t in = it->second->stored_weight().size(1);
    if (in != mod.in_dim) {
      mismatched.push_back(c10::str(mod.name, " has in_features ", mod.in_dim, ", ", name, " has ", in));
      continue;
    }
    bound.push_back(it->second);
  }
  if (!missing.empty() || !mismatched.empty()) {
    std::string msg = what + " does not fit this model:";
    if (!missing.empty()) msg += c10::str(" ", missing.size(), " targets missing from the model: ", list_some(missing));
    if (!mismatched.empty()) {
      msg += c10::str(missing.empty() ? " " : "; ", mismatched.size(), " shape mismatches: ", list_some(mismatched));
    }
    throw CheckpointError(msg);
  }

  at::NoGradGuard no_grad;
  const at::ScalarType dt = model.compute_dtype();
  std::vector<at::Tensor> host;
  for (const auto& [k, t] : adapter.trunk) host.push_back(t);
  for (const auto& mod : adapter.modules) {
    for (const at::Tensor* t : {&mod.down_w, &mod.down_b, &mod.mid_w, &mod.mid_b, &mod.film_w, &mod.film_b, &mod.up_w,
                                &mod.up_b, &mod.depth_embed}) {
      host.push_back(*t);
    }
  }
  std::vector<at::Tensor> placed;
  if (placer) {
    placed = placer->place_sidecars(host, std::vector<at::ScalarType>(host.size(), dt), what);
    placer_ = placer;
  } else {
    const at::Device dev = device.value_or(bound.front()->stored_weight().device());
    for (const auto& t : host) placed.push_back(t.to(dev, dt));
  }
  for (const auto& t : placed) bytes_ += t.nbytes();

  shared_ = std::make_shared<detail::LLLiteShared>();
  shared_->source = adapter.source;
  shared_->config = adapter.config;
  size_t i = 0;
  for (const auto& [k, t] : adapter.trunk) shared_->trunk[k] = placed[i++];
  if (image.defined()) shared_->image = image_4d(image).to(at::kCPU, at::kFloat).contiguous().clone();
  if (image.defined() && mask) shared_->mask = mask_4d(*mask).to(at::kCPU, at::kFloat).contiguous().clone();
  shared_->requested_weight = weight;
  shared_->weight = weight;
  std::vector<std::shared_ptr<detail::LLLiteModuleFn>> fns;
  for (size_t m = 0; m < adapter.modules.size(); ++m) {
    auto fn = std::make_shared<detail::LLLiteModuleFn>();
    fn->shared = shared_;
    for (at::Tensor* t : {&fn->down_w, &fn->down_b, &fn->mid_w, &fn->mid_b, &fn->film_w, &fn->film_b, &fn->up_w,
                          &fn->up_b, &fn->depth_embed}) {
      *t = placed[i++];
    }
    fns.push_back(std::move(fn));
  }
  modules_ = static_cast<int64_t>(fns.size());
  model.add_forward_listener(shared_);
  for (size_t m = 0; m < fns.size(); ++m) bound[m]->input_adapters().push_back({fns[m], id_});
  layers_ = std::move(bound);
  if (!remap_line_.empty()) log::info(remap_line_);
}

LLLiteScope::~LLLiteScope() {
  for (const auto& layer : layers_) {
    auto& v = layer->input_adapters();
    v.erase(std::remove_if(v.begin(), v.end(), [&](const offload::InputAdapter& a) { return a.id == id_; }), v.end());
  }
  model_.remove_forward_listener(shared_.get());
  shared_.reset();
  if (placer_) placer_->sidecars_released(bytes_);  // after the weights are gone
}

void LLLiteScope::set_weight(double weight) {
  if (!std::isfinite(weight)) {
    throw InvalidArgument(c10::str("LLLite '", shared_->source, "': weight ", weight, " is not finite"));
  }
  shared_->requested_weight = weight;
}

double LLLiteScope::weight() const { return shared_->requested_weight.load(); }

}  // namespace sluice::anima
