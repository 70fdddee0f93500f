// sluice forward: one DiT forward (optionally preceded by the LLM adapter) on tensors read
// from a safetensors file, written to another. The scripting face of the model, used by
// the parity tests and the Python bindings' bit-identity test. It checks the input file
// and goes through the public API (sluice/sluice.hpp) like any other host: the model is
// loaded into a ModelCache on --device (the CPU plays the device for "cpu") and run under
// --vram-budget / --max-resident, with --storage (default float8_e4m3fn, as `sluice run`
// and the API store weights, so that a budget means the same in all three; --storage
// float32 or --storage with the --compute name runs without fp8). --compute is the run
// dtype, as in `sluice run`; --dtype, its older name here, is an alias that says so.
//
// Inputs: x [B,C,T,H,W], timesteps [B], and either context [B,S,D] or qwen_hidden
// [B,S,Dq] + t5_ids [B,S_t] (+ t5_weights [B,S_t]); with --lllite FILE[:WEIGHT], the control
// image lllite_cond [3,H,W] or [1,3,H,W] (RGB in [0,1], any size) and, for an inpaint adapter,
// lllite_mask [H,W] (1 = inpaint); for a semantic connector (Anima-3.8B
// v1.1), qwen35_hidden [layers,B,S',W] or qwen35_hidden_0.. [B,S',W], and qwen35_mask [B,S']
// (optional; the connector's timestep is `timesteps`). Output: velocity (+ context when the
// adapter ran).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#include "cli/adapter_args.h"
#include "cli/commands.h"
#include "cli/lllite_args.h"
#include "cli/nonfinite_output.h"
#include "cli/options.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/nonfinite.h"
#include "runtime/safetensors.h"
#include "sluice/sluice.hpp"

namespace sluice::cli {
namespace {

struct ForwardArgs {
  std::string checkpoint;         // model .safetensors
  std::string inputs;             // input tensors .safetensors
  std::string output;             // output tensors .safetensors
  std::string config;             // optional: preset or JSON (default: inferred from the checkpoint)
  std::string compute = "float32";  // run dtype of weights and activations
  std::string dtype_alias;          // --dtype, the older name of --compute; empty: not given
  std::string device = "cpu";     // cpu | cuda[:N]
  std::string storage = "float8_e4m3fn";  // stored dtype of the Linears
  std::optional<double> max_resident;  // resident fraction of the streamable weights
  std::string vram_budget;        // device budget; empty: all of the device
  std::string vram_headroom;      // --vram-budget auto: memory left free; empty: the default
  std::string prefetch = "auto";  // most streamed layers copied ahead: auto | N
  int load_threads = 0;           // checkpoint read workers; 0: every core
  std::string lllite;             // ControlNet-LLLite FILE[:WEIGHT]; empty: none
  std::string mask_blocks;        // blocks of the input cross_attn_mask: even|odd|all|i,j,k; empty: even
  AdapterFlags adapters;          // --lora FILE[:SCALE] (repeatable), --adapter-blocks
};

// Checks one input's rank and the dims that are fixed (-1: any size, bound by name below).
class InputChecker {
 public:
  explicit InputChecker(std::string file) : file_(std::move(file)) {}

  // `dims` entries: a size, or a symbol ("B", "S", ...) that must agree across inputs.
  void check(const std::string& name, const at::Tensor& t, const std::vector<std::string>& dims) {
    std::string expected = "[";
    for (size_t i = 0; i < dims.size(); ++i) expected += (i ? ", " : "") + dims[i];
    expected += "]";
    auto bad = [&](const std::string& why) {
      throw InvalidArgument("input '" + name + "' in '" + file_ + "' has shape " + shape_str(t.sizes()) +
                            ", expected " + expected + why);
    };
    if (t.dim() != static_cast<int64_t>(dims.size())) bad("");
    for (size_t i = 0; i < dims.size(); ++i) {
      const std::string& d = dims[i];
      const int64_t size = t.size(static_cast<int64_t>(i));
      if (std::isdigit(static_cast<unsigned char>(d[0]))) {
        if (size != std::stoll(d)) bad("");
        continue;
      }
      if (size <= 0) bad(" (empty dimension " + d + ")");
      auto it = bound_.find(d);
      if (it == bound_.end()) {
        bound_[d] = {size, name};
      } else if (it->second.first != size) {
        bad(" (" + d + " = " + std::to_string(it->second.first) + " from '" + it->second.second + "')");
      }
    }
  }

 private:
  std::string file_;
  std::map<std::string, std::pair<int64_t, std::string>> bound_;
};

// Floating point, and no NaN or Inf (Note [non-finite values]): checked as read, before
// any conversion to the run dtype.
void require_floating_finite(const std::string& name, const at::Tensor& t, const std::string& file) {
  if (!at::isFloatingType(t.scalar_type()))
    throw InvalidArgument("input '" + name + "' in '" + file + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
                          ", expected a floating-point dtype");
  require_finite(t, "input '" + name + "' in '" + file + "'");
}

int run_forward(const ForwardArgs& a) {
  const std::string& compute = a.dtype_alias.empty() ? a.compute : a.dtype_alias;
  // Said here, not as the flags are parsed: main applies --log-level in between.
  if (!a.dtype_alias.empty()) {
    log::warn("sluice forward: --dtype is an alias of --compute, the name sluice run uses too; running as --compute " +
              compute);
  }
  const at::ScalarType dtype = parse_dtype(compute);
  const at::Device device = resolve_device(a.device);

  // Read and check the inputs before the (slow) model load.
  const auto in = safetensors::File::open(a.inputs);
  static const std::set<std::string> known = {"cross_attn_mask", "x",      "timesteps",  "context",    "qwen_hidden",
                                              "t5_ids", "t5_weights", "lllite_cond", "lllite_mask"};
  // The semantic connector's Qwen3.5 layers: one stacked tensor or one per layer.
  const auto is_qwen35_layer = [](const std::string& n) {
    return n.rfind("qwen35_hidden_", 0) == 0 && n.size() > 14 &&
           n.find_first_not_of("0123456789", 14) == std::string::npos;
  };
  bool semantic = false;
  for (const auto& t : in->tensors()) semantic |= t.name == "qwen35_hidden" || t.name == "qwen35_mask" || is_qwen35_layer(t.name);
  for (const auto& t : in->tensors())
    if (!known.count(t.name) && t.name != "qwen35_hidden" && t.name != "qwen35_mask" && !is_qwen35_layer(t.name))
      throw InvalidArgument("unexpected input '" + t.name + "' in '" + a.inputs +
                            "' (expected x, timesteps, context or qwen_hidden + t5_ids [+ t5_weights])");
  for (const char* name : {"x", "timesteps"})
    if (!in->contains(name)) throw InvalidArgument("inputs file '" + a.inputs + "' has no '" + name + "' tensor");
  const bool use_adapter = in->contains("qwen_hidden") || in->contains("t5_ids");
  if (use_adapter && in->contains("context"))
    throw InvalidArgument("inputs file '" + a.inputs + "' has both 'context' and adapter inputs (qwen_hidden/t5_ids); give one");
  if (!use_adapter && !in->contains("context"))
    throw InvalidArgument("inputs file '" + a.inputs + "' has neither 'context' nor 'qwen_hidden' + 't5_ids'");
  if (use_adapter && !(in->contains("qwen_hidden") && in->contains("t5_ids")))
    throw InvalidArgument("inputs file '" + a.inputs + "': the adapter needs both 'qwen_hidden' and 't5_ids'");
  if (!use_adapter && semantic)
    throw InvalidArgument("inputs file '" + a.inputs +
                          "' has semantic connector inputs (qwen35_hidden/qwen35_mask) without 'qwen_hidden' + 't5_ids'");
  if (a.lllite.empty() && (in->contains("lllite_cond") || in->contains("lllite_mask")))
    throw InvalidArgument("inputs file '" + a.inputs + "' has LLLite inputs (lllite_cond/lllite_mask) but no --lllite");
  if (!a.lllite.empty() && !in->contains("lllite_cond"))
    throw InvalidArgument("--lllite needs the control image 'lllite_cond' [3,H,W] (RGB in [0,1]) in inputs file '" +
                          a.inputs + "'");
  if (!use_adapter && in->contains("t5_weights"))
    throw InvalidArgument("inputs file '" + a.inputs + "' has 't5_weights' without 'qwen_hidden' + 't5_ids'");

  RuntimeOptions ro;
  ro.device = device.str();
  ro.vram_budget = a.vram_budget;
  ro.vram_headroom = a.vram_headroom;
  ro.prefetch = a.prefetch;
  ro.load_threads = a.load_threads;
  const std::unique_ptr<ModelCache> cache_owner = make_model_cache(ro);
  ModelCache& cache = *cache_owner;
  LoadOptions lo;
  lo.storage = a.storage;
  lo.compute = compute;
  lo.config = a.config;
  lo.max_resident = a.max_resident;
  Model handle = cache.load(a.checkpoint, lo);
  LockedModel model = handle.lock();
  const std::vector<LoraHandle> loras = apply_loras(model, a.adapters, nullptr);  // while the lock lasts
  const ModelInfo& cfg = model.info();

  InputChecker check(a.inputs);
  const at::Tensor x = in->tensor("x");
  const at::Tensor timesteps = in->tensor("timesteps");
  require_floating_finite("x", x, a.inputs);
  require_floating_finite("timesteps", timesteps, a.inputs);
  check.check("x", x, {"B", std::to_string(cfg.in_channels), "T", "H", "W"});
  check.check("timesteps", timesteps, {"B"});

  std::vector<std::pair<std::string, at::Tensor>> outputs;
  at::Tensor context;
  if (use_adapter) {
    if (!cfg.has_adapter)
      throw InvalidArgument("inputs file '" + a.inputs + "' has adapter inputs but model '" + a.checkpoint +
                            "' has no LLM adapter");
    const at::Tensor qwen = in->tensor("qwen_hidden");
    const at::Tensor ids = in->tensor("t5_ids");
    require_floating_finite("qwen_hidden", qwen, a.inputs);
    check.check("qwen_hidden", qwen, {"B", "S", std::to_string(cfg.adapter_source_dim)});
    check.check("t5_ids", ids, {"B", "S_t"});
    if (at::isFloatingType(ids.scalar_type()) || ids.scalar_type() == at::kBool)
      throw InvalidArgument("input 't5_ids' in '" + a.inputs + "' has dtype " +
                            std::string(c10::toString(ids.scalar_type())) + ", expected an integer dtype");
    const at::Tensor ids_long = ids.to(at::kLong);
    if (ids_long.numel() > 0) {
      const int64_t lo = ids_long.min().item<int64_t>(), hi = ids_long.max().item<int64_t>();
      if (lo < 0 || hi >= cfg.adapter_vocab_size)
        throw InvalidArgument("input 't5_ids' in '" + a.inputs + "' has ids in [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "], outside the vocabulary [0, " +
                              std::to_string(cfg.adapter_vocab_size) + ")");
    }
    std::optional<at::Tensor> weights;
    if (in->contains("t5_weights")) {
      const at::Tensor w = in->tensor("t5_weights");
      require_floating_finite("t5_weights", w, a.inputs);
      check.check("t5_weights", w, {"B", "S_t"});
      weights = w.to(device, dtype);
    }
    const at::Tensor qwen_in = qwen.to(device, dtype), ids_in = ids_long.to(device);
    SemanticInputs sem;
    if (semantic) {
      if (!cfg.has_connector)
        throw InvalidArgument("inputs file '" + a.inputs + "' has semantic connector inputs (qwen35_hidden/qwen35_mask) "
                              "but model '" + a.checkpoint + "' has no semantic connector");
      if (in->contains("qwen35_hidden")) {
        sem.qwen35_hidden.push_back(in->tensor("qwen35_hidden"));
      } else {
        for (int64_t i = 0; in->contains("qwen35_hidden_" + std::to_string(i)); ++i)
          sem.qwen35_hidden.push_back(in->tensor("qwen35_hidden_" + std::to_string(i)));
      }
      if (in->contains("qwen35_mask")) sem.qwen35_mask = in->tensor("qwen35_mask");
      sem.timesteps = timesteps;  // the connector embeds the step's sigma too
    }
    context = model.encode_text(qwen_in, ids_in, weights, sem);
    if (!all_finite(context))  // Note [non-finite values]: named by a re-run with a per-layer check
      throw Error("sluice forward: " + nonfinite_output_message("adapter", "context", context,
                                                                model.locate_nonfinite_text(qwen_in, ids_in, weights, sem)));
    outputs.emplace_back("context", context);
  } else {
    context = in->tensor("context");
    require_floating_finite("context", context, a.inputs);
    check.check("context", context, {"B", "S", std::to_string(cfg.context_dim)});
    context = context.to(device, dtype);
  }
  LLLiteHandle lllite;  // Note [LoRA lifetime]: unbound with the lock at the latest
  if (!a.lllite.empty()) {
    const LLLiteSpec spec = parse_lllite_spec(a.lllite, /*with_range=*/false, "--lllite");
    const at::Tensor cond = in->tensor("lllite_cond");
    require_floating_finite("lllite_cond", cond, a.inputs);
    std::optional<at::Tensor> mask;
    if (in->contains("lllite_mask")) {
      mask = in->tensor("lllite_mask");
      require_floating_finite("lllite_mask", *mask, a.inputs);
    }
    lllite = model.apply_lllite(spec.path, cond, spec.weight, mask, a.adapters.layout());
  }
  // Timesteps stay fp32: the sinusoid is computed in fp32 (models/anima/embedders.h), and rounding
  // sigma to bf16 first would change the embedding.
  const at::Tensor x_in = x.to(device, dtype), t_in = timesteps.to(device, at::kFloat);
  // Regional prompting (README, "Regional prompting"): the mask's shape is checked by the forward.
  ForwardOptions fo;
  if (in->contains("cross_attn_mask")) {
    const at::Tensor mask = in->tensor("cross_attn_mask");
    if (mask.scalar_type() != at::kBool && mask.scalar_type() != at::kByte)
      throw InvalidArgument("input 'cross_attn_mask' in '" + a.inputs + "' has dtype " +
                            std::string(c10::toString(mask.scalar_type())) + ", expected bool or uint8");
    fo.cross_attn_mask = mask.scalar_type() == at::kByte ? mask.ne(0) : mask;
  } else if (!a.mask_blocks.empty()) {
    throw InvalidArgument("--mask-blocks needs a 'cross_attn_mask' in inputs file '" + a.inputs + "'");
  }
  fo.mask_blocks = parse_mask_blocks(a.mask_blocks, cfg.num_blocks);
  const at::Tensor velocity = model.forward(x_in, t_in, context, fo);
  if (!all_finite(velocity))
    throw Error("sluice forward: " + nonfinite_output_message("dit", "velocity", velocity,
                                                              model.locate_nonfinite(x_in, t_in, context, fo)));
  outputs.emplace_back("velocity", velocity);
  safetensors::save(a.output, outputs,
                    {{"checkpoint", a.checkpoint}, {"dtype", compute}, {"device", device.str()}, {"model", cfg.name}, {"storage", cfg.storage_dtype}});
  std::cout << "wrote " << a.output << ": velocity " << shape_str(velocity.sizes())
            << (use_adapter ? ", context " + shape_str(context.sizes()) : std::string()) << " (" << compute << ", "
            << device.str() << ")\n";
  return 0;
}

}  // namespace

Subcommand add_forward(CLI::App& root) {
  auto args = std::make_shared<ForwardArgs>();
  CLI::App* sub = root.add_subcommand("forward", "Run one Anima forward on tensors from a safetensors file");
  sub->add_option("--checkpoint", args->checkpoint, "Model checkpoint (.safetensors)")->required();
  sub->add_option("--inputs", args->inputs,
                  "Input tensors: x, timesteps, and context or qwen_hidden + t5_ids [+ t5_weights]")
      ->required();
  sub->add_option("--output", args->output, "Output file: velocity (+ context when the adapter ran)")
      ->required()
      ->check(output_file_validator());
  sub->add_option("--config", args->config, "Model preset or JSON config (default: inferred from the checkpoint)")
      ->check(config_validator());
  CLI::Option* compute =
      sub->add_option("--compute", args->compute, "Compute dtype of weights and activations: float32|bfloat16|float16")
          ->check(dtype_validator({"float32", "bfloat16", "float16"}))
          ->capture_default_str();
  sub->add_option("--dtype", args->dtype_alias, "Alias of --compute (its older name here), which says so when used")
      ->check(dtype_validator({"float32", "bfloat16", "float16"}))
      ->excludes(compute);
  sub->add_option("--device", args->device, "Device: cpu|cuda[:N] (cpu: the CPU plays the device)")
      ->check(device_validator())
      ->capture_default_str();
  sub->add_option("--storage", args->storage,
                  "Stored dtype of Linear/Embedding weights: float8_e4m3fn|float8_e5m2|bfloat16|float16|float32 (as "
                  "`sluice run`; the --compute name for no fp8)")
      ->capture_default_str();
  sub->add_option("--max-resident", args->max_resident, "Resident fraction (0..1) of the streamable weights")
      ->check(number_validator(0.0, 1.0));
  sub->add_option("--mask-blocks", args->mask_blocks,
                  "Blocks the input 'cross_attn_mask' (bool or uint8 [L,S] or [B,L,S]) applies to: even (default), "
                  "odd, all, or i,j,k");
  add_vram_budget_options(sub, args->vram_budget, args->vram_headroom, "all of it");
  sub->add_option("--prefetch", args->prefetch,
                  "Most streamed layers copied ahead of compute: auto (as far as the staging ring's bytes allow) or N")
      ->check(prefetch_validator())
      ->capture_default_str();
  add_load_threads_option(sub, args->load_threads);
  add_adapter_options(sub, args->adapters);
  sub->add_option("--lllite", args->lllite,
                  "ControlNet-LLLite file and weight (-10..10, default 1), its control image 'lllite_cond' (and "
                  "'lllite_mask') in --inputs")
      ->check(lllite_spec_validator(/*with_range=*/false, "--lllite"));
  check_output_paths(sub, {{"--output", &args->output}},  // Note [output paths]
                     {{"--checkpoint", &args->checkpoint}, {"--inputs", &args->inputs}, {"--config", &args->config}});
  return {sub, [args] { return run_forward(*args); }};
}

}  // namespace sluice::cli
