#include "offload/layer/storage.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cmath>

#include "offload/layer/layer.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/progress.h"
#include "runtime/size_parse.h"
#include "runtime/skip_patterns.h"

namespace sluice::offload {

namespace {

// A meta tensor only changes dtype; a CPU result is moved into sluice-owned host memory
// (counted by host_memory_stats(), like the loader's copies); other devices keep ATen's.
at::Tensor owned(const at::Tensor& t) {
  if (t.device().is_cpu()) return to_host_owned(t, t.scalar_type());
  return t;
}

struct Cast {
  at::Tensor weight, bias, scale;
  int64_t clipped = 0;
  bool kept = false;  // the weight was already stored as asked: not cast
};

// Whether an existing scale (read from a file) is one the options ask for: any, when they
// ask for none (the file's scaled layout is more exact than a plain recast), else the same
// layout (per tensor: one value; per channel: one per output row).
bool scale_fits(const at::Tensor& scale, const at::Tensor& w, ScaleMode mode) {
  switch (mode) {
    case ScaleMode::none: return true;
    case ScaleMode::per_tensor: return scale.numel() == 1;
    case ScaleMode::per_channel: return scale.dim() == 1 && w.dim() >= 1 && scale.numel() == w.size(0);
  }
  return false;
}

// A tensor kept as it is (already in its storage dtype, e.g. generated in it): refuses
// NaN/Inf, as every other path does (the only check it needs, its values are in range by
// construction). One vectorized scan on the CPU; on another device one reduction.
void check_finite(const at::Tensor& t, const std::string& name) {
  if (t.is_meta()) return;
  const at::ScalarType d = t.scalar_type();
  if (t.device().is_cpu() && (is_fp8(d) || d == at::kBFloat16 || d == at::kHalf || d == at::kFloat)) {
    const at::Tensor c = t.contiguous();
    const Fp8NonFinite bad = count_non_finite(d, c.data_ptr(), c.numel());
    refuse_non_finite(name, bad.nans, bad.infs, d);
    return;
  }
  const at::Tensor f = is_fp8(d) ? t.to(at::kFloat) : t;
  if (!at::isfinite(f).all().item<bool>()) {
    refuse_non_finite(name, at::isnan(f).sum().item<int64_t>(), at::isinf(f).sum().item<int64_t>(), d);
  }
}

Cast cast_layer(const ManagedLayerImpl& layer, at::ScalarType dtype, const Fp8Options& options, bool checked) {
  Cast c;
  const at::Tensor& w = layer.stored_weight();
  const at::Tensor& b = layer.stored_bias();
  if (w.is_meta()) {
    // Shape only: no values to check. A scaled layout still gets its (meta) scale so the
    // layer looks exactly as it would after a real cast.
    c.weight = w.to(dtype);
    if (b.defined()) c.bias = b.to(dtype);
    if (is_fp8(dtype) && w.dim() >= 2 && options.scale_mode != ScaleMode::none) {
      c.scale = options.scale_mode == ScaleMode::per_tensor ? at::empty({}, w.options().dtype(at::kFloat))
                                                            : at::empty({w.size(0)}, w.options().dtype(at::kFloat));
    }
    return c;
  }
  // A weight that is already in the target dtype with no scale to produce stays as is
  // (no copy), and so does an fp8 weight read with a scale that fits the options (Note
  // [converted checkpoints] in models/anima/checkpoint.h); anything else goes through the
  // checked cast, from the dequantized values.
  const bool want_scale = is_fp8(dtype) && w.dim() >= 2 && options.scale_mode != ScaleMode::none;
  const at::Tensor& scale = layer.weight_scale();
  if (w.scalar_type() == dtype && (scale.defined() ? scale_fits(scale, w, options.scale_mode) : !want_scale)) {
    if (!checked) check_finite(w, layer.qualified_name() + ".weight");
    c.weight = w;
    c.scale = scale;
    c.kept = true;
  } else {
    const at::Tensor src = layer.weight_scale().defined() ? layer.upcast_stored().weight : w;
    StorageCast sc = cast_to_storage(src, dtype, layer.qualified_name() + ".weight", options);
    c.weight = owned(sc.stored);
    c.scale = sc.scale;
    c.clipped += sc.clipped;
  }
  if (b.defined()) {
    if (b.scalar_type() == dtype) {
      if (!checked) check_finite(b, layer.qualified_name() + ".bias");
      c.bias = b;
    } else {
      StorageCast sc = cast_to_storage(b, dtype, layer.qualified_name() + ".bias", options);
      c.bias = owned(sc.stored);
      c.clipped += sc.clipped;
    }
  }
  return c;
}

}  // namespace

int64_t param_bytes(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters(/*recurse=*/true)) n += p.numel() * static_cast<int64_t>(p.element_size());
  return n;
}

StorageReport apply_storage(torch::nn::Module& model, const std::string& model_name, const Fp8Options& options,
                            const std::vector<std::string>& model_declared_skips, const ReadCasts* read) {
  return apply_storage(model, model_name, options, SkipList::from_options(options, model_declared_skips), read);
}

StorageReport apply_storage(torch::nn::Module& model, const std::string& model_name, const Fp8Options& options,
                            const SkipList& skips, const ReadCasts* read) {
  check_storage_dtype(options.storage);
  check_compute_dtype(options.compute);

  StorageReport r;
  r.model_name = model_name;
  r.dtypes.storage = options.storage;
  r.dtypes.compute = options.compute;
  r.patterns = skips.patterns();

  at::NoGradGuard no_grad;
  const auto layers = managed_layers(model);
  uint64_t total = 0;
  for (const auto& [name, layer] : layers) total += layer->stored_weight().nbytes();
  progress::Task task("casting " + model_name + " to " + dtype_name(options.storage), total);
  for (const auto& [name, layer] : layers) {
    const uint64_t source_bytes = layer->stored_weight().nbytes();
    const auto pattern = skips.matches(name);
    const at::ScalarType dtype = pattern ? options.compute : options.storage;
    const int64_t elements = layer->stored_weight().numel() + (layer->has_bias() ? layer->stored_bias().numel() : 0);
    // Cast first, then commit: a throwing cast leaves this layer untouched.
    Cast c = cast_layer(*layer, dtype, options, read != nullptr && read->checked.count(layer) != 0);
    if (read != nullptr && read->cast.count(layer) != 0) c.kept = false;  // cast, by the read
    layer->set_stored(c.weight, c.bias.defined() ? std::optional<at::Tensor>(c.bias) : std::nullopt);
    layer->set_weight_scale(c.scale);
    layer->set_compute_dtype(options.compute);
    r.clipped += c.clipped;
    if (pattern) {
      r.skipped.emplace_back(name, *pattern);
      r.skipped_params += elements;
    } else {
      r.cast_layers += 1;
      r.cast_params += elements;
      if (c.kept) r.kept_layers += 1;
    }
    task.advance(source_bytes);
  }
  r.param_bytes = param_bytes(model);
  if (read != nullptr) r.clipped += read->clipped;

  if (is_fp8(options.storage)) {
    log::info(c10::str("FP8 layerwise casting enabled for ", model_name, " (storage=", dtype_name(options.storage),
                       ", compute=", dtype_name(options.compute),
                       ", param_size=", format_mib(r.param_bytes),
                       r.kept_layers > 0 ? c10::str(", ", r.kept_layers, " of ", r.cast_layers,
                                                    " layers stored as read, no cast")
                                         : std::string(),
                       ")"));
    if (!r.skipped.empty()) {
      std::string list;
      for (const auto& [module, pattern] : r.skipped) list += (list.empty() ? "" : ", ") + module;
      log::debug(c10::str(model_name, ": ", r.skipped.size(), " layers kept in ", dtype_name(options.compute), ": ",
                          list));
    }
  }
  return r;
}

}  // namespace sluice::offload
