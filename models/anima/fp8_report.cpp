#include "models/anima/fp8_report.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace sluice::anima {

namespace {

bool has_component_prefix(const std::string& name, const std::string& prefix) {
  // True when some dotted component of `name` starts with `prefix`.
  size_t start = 0;
  while (start <= name.size()) {
    if (name.compare(start, prefix.size(), prefix) == 0) return true;
    const size_t dot = name.find('.', start);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return false;
}

bool has_component(const std::string& name, const std::string& component) {
  return ("." + name + ".").find("." + component + ".") != std::string::npos;
}

// Running sums of one group.
struct Accum {
  int64_t tensors = 0, elements = 0, flushed = 0, scaled_flushed = 0;
  double sq_norm = 0, sq_err = 0, scaled_sq_err = 0;
};

// Measures one tensor's values `w` (any float dtype, any device-CPU layout) in row chunks.
void measure(const at::Tensor& w, at::ScalarType storage, int64_t chunk_elements, Accum& a) {
  const double max_finite = fp8_max_finite(storage);
  a.tensors += 1;
  a.elements += w.numel();
  if (w.numel() == 0) return;
  const at::Tensor rows = w.dim() == 0 ? w.reshape({1, 1}) : w.reshape({w.size(0), -1});
  const bool per_channel = w.dim() >= 2;  // 1-d tensors (biases) are stored unscaled
  const int64_t row_elems = std::max<int64_t>(rows.size(1), 1);
  const int64_t step = std::max<int64_t>(1, chunk_elements / row_elems);
  for (int64_t r0 = 0; r0 < rows.size(0); r0 += step) {
    const at::Tensor c = rows.narrow(0, r0, std::min(step, rows.size(0) - r0)).to(at::kFloat);
    const at::Tensor nonzero = c.ne(0);
    const at::Tensor q = c.clamp(-max_finite, max_finite).to(storage).to(at::kFloat);
    a.flushed += at::logical_and(nonzero, q.eq(0)).sum().item<int64_t>();
    a.sq_norm += c.square().sum(at::kDouble).item<double>();
    const double err = (c - q).square().sum(at::kDouble).item<double>();
    a.sq_err += err;
    if (!per_channel) {
      a.scaled_flushed += at::logical_and(nonzero, q.eq(0)).sum().item<int64_t>();
      a.scaled_sq_err += err;
      continue;
    }
    const at::Tensor amax = c.abs().amax({1}, /*keepdim=*/true);
    const at::Tensor scale = at::where(amax.eq(0), at::ones_like(amax), (amax / max_finite).clamp_min(FLT_MIN));
    const at::Tensor qs = (c / scale).clamp(-max_finite, max_finite).to(storage).to(at::kFloat) * scale;
    a.scaled_flushed += at::logical_and(nonzero, qs.eq(0)).sum().item<int64_t>();
    a.scaled_sq_err += (c - qs).square().sum(at::kDouble).item<double>();
  }
}

std::vector<Fp8Candidate> candidate_lists() {
  std::vector<Fp8Candidate> c(4);
  c[0].name = "none";
  c[1].name = "t_embedder";
  c[1].patterns = {"t_embedder"};
  c[2].name = "declared";
  c[2].patterns = declared_fp8_skips();
  c[3].name = "declared+adaln_modulation";
  c[3].patterns = declared_fp8_skips();
  c[3].patterns.push_back("adaln_modulation\\w*");
  return c;
}

Fp8Options candidate_options(const Fp8Candidate& c, at::ScalarType storage) {
  Fp8Options o;
  o.storage = storage;
  o.compute = at::kBFloat16;
  o.use_default_skips = false;
  o.use_model_skips = false;
  o.extra_skip_patterns = c.patterns;
  return o;
}

double rel_l2(const at::Tensor& a, const at::Tensor& ref) {
  const double den = ref.to(at::kDouble).norm().item<double>();
  const double num = (a.to(at::kDouble) - ref.to(at::kDouble)).norm().item<double>();
  return den > 0 ? num / den : num;
}

}  // namespace

const std::vector<std::string>& fp8_report_groups() {
  static const std::vector<std::string> g = {"t_embedder", "x_embedder", "final_layer", "adaln_modulation",
                                             "self_attn",  "cross_attn", "mlp",         "llm_adapter",
                                             "other"};
  return g;
}

std::string fp8_report_group(const std::string& m) {
  for (const char* top : {"llm_adapter", "t_embedder", "x_embedder", "final_layer"}) {
    if (m == top || m.rfind(std::string(top) + ".", 0) == 0) return top;
  }
  if (has_component_prefix(m, "adaln_modulation")) return "adaln_modulation";
  for (const char* part : {"self_attn", "cross_attn", "mlp"}) {
    if (has_component(m, part)) return part;
  }
  return "other";
}

Fp8Report fp8_report(const std::string& path, const Fp8ReportOptions& options) {
  if (!is_fp8(options.storage)) {
    throw InvalidArgument("fp8-report: storage must be a float8 dtype, got " + dtype_name(options.storage));
  }
  if (options.chunk_elements <= 0) throw InvalidArgument("fp8-report: chunk_elements must be positive");
  if (options.forward && (options.latent_size <= 0 || options.context_tokens <= 0)) {
    throw InvalidArgument("fp8-report: latent_size and context_tokens must be positive");
  }
  at::NoGradGuard no_grad;
  const auto file = safetensors::File::open(path);
  const CheckpointProbe probe = probe_checkpoint(*file);
  if (!probe.has_dit) throw CheckpointError("'" + path + "' is not an Anima checkpoint: " + probe.reason);

  Fp8Report report;
  report.checkpoint = path;
  report.config_name = probe.inferred.name;
  report.storage = options.storage;
  report.options = options;

  // Which tensors are measured: the Linear/Embedding parameters of the model the file
  // builds (shape-only).
  const auto sources = model_tensor_sources(*file, probe.prefix);
  std::map<std::string, Accum> acc;
  {
    AnimaModel shape_only(probe.inferred, BuildOptions{at::kBFloat16, at::kMeta});
    for (const auto& [name, layer] : offload::managed_layers(*shape_only)) {
      Accum& a = acc[fp8_report_group(name)];
      for (const char* p : {".weight", ".bias"}) {
        if (std::string(p) == ".bias" && !layer->has_bias()) continue;
        const std::string key = name + p;
        const auto it = sources.find(key);
        if (it == sources.end()) throw CheckpointError("checkpoint '" + path + "' has no tensor for " + key);
        const at::Tensor w = source_tensor(*file, it->second, key, layer->stored_weight().size(0));
        measure(w, options.storage, options.chunk_elements, a);
      }
    }
  }
  for (const auto& g : fp8_report_groups()) {
    auto it = acc.find(g);
    if (it == acc.end() || it->second.tensors == 0) continue;
    const Accum& a = it->second;
    Fp8GroupStats s;
    s.group = g;
    s.tensors = a.tensors;
    s.parameters = a.elements;
    const double n = static_cast<double>(std::max<int64_t>(a.elements, 1));
    const double norm = std::sqrt(a.sq_norm);
    s.flush_fraction = static_cast<double>(a.flushed) / n;
    s.scaled_flush_fraction = static_cast<double>(a.scaled_flushed) / n;
    s.roundtrip_rel_error = norm > 0 ? std::sqrt(a.sq_err) / norm : 0.0;
    s.scaled_roundtrip_rel_error = norm > 0 ? std::sqrt(a.scaled_sq_err) / norm : 0.0;
    report.groups.push_back(s);
  }

  report.candidates = candidate_lists();
  for (auto& c : report.candidates) {
    AnimaModel shape_only(probe.inferred, BuildOptions{at::kBFloat16, at::kMeta});
    const auto r = offload::apply_storage(*shape_only, probe.inferred.name, candidate_options(c, options.storage),
                                          std::vector<std::string>{});
    c.skipped_modules = static_cast<int64_t>(r.skipped.size());
    c.param_size_mib = r.param_mib();
  }

  if (options.forward) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
    const AnimaConfig& cfg = probe.inferred;
    const at::Tensor x =
        at::randn({1, cfg.in_channels, 1, options.latent_size, options.latent_size}, gen, at::kFloat).to(at::kBFloat16);
    const at::Tensor ctx =
        at::randn({1, options.context_tokens, cfg.crossattn_emb_channels}, gen, at::kFloat).to(at::kBFloat16);
    const at::Tensor t = at::full({1}, options.sigma, at::kFloat);
    at::Tensor reference;
    {
      LoadOptions plain;
      plain.dtype = at::kBFloat16;
      AnimaModel m = load_anima(path, plain);
      reference = m->forward(x, t, ctx).to(at::kFloat);
    }  // freed before the fp8 copies load
    for (auto& c : report.candidates) {
      LoadOptions o;
      o.storage = candidate_options(c, options.storage);
      AnimaModel m = load_anima(path, o);
      c.velocity_rel_l2 = rel_l2(m->forward(x, t, ctx).to(at::kFloat), reference);
    }
    report.forward = true;
  }
  return report;
}

nlohmann::json fp8_report_to_json(const Fp8Report& r) {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : r.groups) {
    groups.push_back({{"group", g.group},
                      {"tensors", g.tensors},
                      {"parameters", g.parameters},
                      {"flush_fraction", g.flush_fraction},
                      {"roundtrip_rel_error", g.roundtrip_rel_error},
                      {"scaled_flush_fraction", g.scaled_flush_fraction},
                      {"scaled_roundtrip_rel_error", g.scaled_roundtrip_rel_error}});
  }
  nlohmann::json cands = nlohmann::json::array();
  for (const auto& c : r.candidates) {
    nlohmann::json j = {{"name", c.name},
                        {"patterns", c.patterns},
                        {"skipped_modules", c.skipped_modules},
                        {"param_size_mib", std::round(c.param_size_mib * 10.0) / 10.0}};
    j["velocity_rel_l2"] = c.velocity_rel_l2 ? nlohmann::json(*c.velocity_rel_l2) : nlohmann::json(nullptr);
    cands.push_back(j);
  }
  nlohmann::json j = {{"checkpoint", r.checkpoint},
                      {"config", r.config_name},
                      {"storage", dtype_name(r.storage)},
                      {"compute", "bfloat16"},
                      {"groups", groups},
                      {"candidates", cands}};
  if (r.forward) {
    j["forward"] = {{"seed", r.options.seed},
                    {"latent_size", r.options.latent_size},
                    {"context_tokens", r.options.context_tokens},
                    {"sigma", r.options.sigma}};
  } else {
    j["forward"] = nullptr;
  }
  return j;
}

std::string fp8_report_to_text(const Fp8Report& r) {
  std::ostringstream s;
  char line[256];
  s << "fp8 report for " << r.checkpoint << " (storage " << dtype_name(r.storage) << ", compute bfloat16)\n\n";
  std::snprintf(line, sizeof line, "%-18s %14s %10s %10s %12s %12s\n", "group", "parameters", "flush", "rel_err",
                "scaled_flush", "scaled_err");
  s << line;
  for (const auto& g : r.groups) {
    std::snprintf(line, sizeof line, "%-18s %14lld %9.4f%% %10.4f %11.4f%% %12.4f\n", g.group.c_str(),
                  static_cast<long long>(g.parameters), 100.0 * g.flush_fraction, g.roundtrip_rel_error,
                  100.0 * g.scaled_flush_fraction, g.scaled_roundtrip_rel_error);
    s << line;
  }
  s << "\n";
  std::snprintf(line, sizeof line, "%-26s %8s %16s %16s\n", "skip list", "skipped", "param_size_mib",
                r.forward ? "velocity_rel_l2" : "");
  s << line;
  for (const auto& c : r.candidates) {
    char vel[32] = "";
    if (c.velocity_rel_l2) std::snprintf(vel, sizeof vel, "%.4f", *c.velocity_rel_l2);
    std::snprintf(line, sizeof line, "%-26s %8lld %16.1f %16s\n", c.name.c_str(),
                  static_cast<long long>(c.skipped_modules), c.param_size_mib, vel);
    s << line;
  }
  if (r.forward) {
    s << "\nforward: seed " << r.options.seed << ", latent " << r.options.latent_size << "x" << r.options.latent_size
      << ", context " << r.options.context_tokens << " tokens, sigma " << r.options.sigma << "\n";
  }
  return s.str();
}

}  // namespace sluice::anima
