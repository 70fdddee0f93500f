// sluice run: the main job. A flow-matching denoising loop (models/sampling.h) over an
// Anima model held by the public API's ModelCache, under a device budget: the layers that
// fit stay resident, the rest stream every forward. Prints the residency map, one line
// per step and the final stats; writes the final latent, the stats JSON and the trace on
// request.
//
// Note [run defaults]
// ~~~~~~~~~~~~~~~~~~~
// With neither --checkpoint nor --synthetic it runs the embedded default:
//  - on a GPU (--device cuda, or no --device and a CUDA/ROCm device present): the real
//    model's shape, anima-2b with random weights, at a 50% VRAM budget, 1024 px, 30 steps;
//  - on the CPU (CPU-as-device mode): a generated anima-medium, 12 steps, with half its
//    streamable weights resident (--max-resident 0.5) so that streaming is exercised, at
//    512 px where the compute dtype is bf16 (a CPU with native bf16) and 256 px where it
//    is fp32 (Note [compute dtype auto]): fp32 runs at 65 GFLOP/s on a 2-core AVX2-only
//    EPYC, about a quarter of what bf16 or fp32 reach on an AVX-512 one, so 512 px would
//    take ~90 s there. Either way it finishes within a minute on an idle 2-core machine
//    of the CI kind (measured in docs/BENCHMARKS.md, "sluice run (embedded default)").
// Where the budget holds every DiT layer (50% of an H200 holds anima-2b whole) the run
// says that everything fits and names --max-resident 0.5 as the flag that streams.
// Every flag given overrides its default. With a model named (--checkpoint/--synthetic)
// only the device-dependent defaults apply (resolution, steps), not the budget ones.
//
// The output depends only on the model, the seed, the context and the sampling flags: on
// the CPU device it is bit-identical whatever --vram-budget, --max-resident, --prefetch
// or --pin-memory (tests/cli/test_run.cpp).
//
// Note [run storage]
// ~~~~~~~~~~~~~~~~~~
// --storage takes every storage dtype the runtime supports: float8_e4m3fn, float8_e5m2,
// bfloat16, float16, float32. Unset, a checkpoint whose Linear weights are fp8 (a file of
// `sluice convert --storage float8_e5m2`, a community e4m3fn file) keeps its own fp8 dtype,
// so that it runs as stored with no second rounding; anything else (a bf16/fp16/fp32 file, a
// generated model) is stored as float8_e4m3fn. Where the file's weights are in another
// dtype than the storage, the run says so once, under its header: "note: 'F' stores its
// weights as float8_e5m2; cast to float8_e4m3fn storage as they are read".
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "cli/adapter_args.h"
#include "cli/commands.h"
#include "cli/lllite_args.h"
#include "cli/options.h"
#include "cli/nonfinite_output.h"
#include "cli/run_progress.h"
#include <sluice/sluice.hpp>
#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/sampling.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/nonfinite.h"
#include "runtime/hardware.h"
#include "runtime/safetensors.h"
#include "runtime/size_parse.h"
#include "runtime/status_line.h"
#include "runtime/text_file.h"

namespace sluice::cli {
namespace {

struct RunArgs {
  std::string checkpoint;                 // model file (.safetensors)
  std::string synthetic;                  // or: preset / JSON config of a random-weight model
  std::string device;                     // empty: cuda when present, else cpu
  std::string vram_budget;                // empty: embedded default or all device memory
  std::string vram_headroom;              // --vram-budget auto: memory left free; empty: the default
  std::optional<double> max_resident;     // cap on the resident fraction of streamable weights
  std::string working_memory;             // empty: the runtime sizes it for the resolution
  std::string storage;                    // stored dtype of Linear/Embedding weights; empty: Note [run storage]
  std::string compute = "auto";           // compute dtype (Note [compute dtype auto])
  std::optional<int> steps;               // Euler steps
  double cfg = 4.5;                       // classifier-free guidance scale
  std::optional<int64_t> resolution;      // image side in pixels (latent = px / 8)
  std::string prefetch = "auto";          // most streamed layers copied ahead: auto | N
  std::string pin_memory = "auto";        // page-locked host copies of streamed layers
  std::string pin_memory_limit;           // page-locked bytes of all models (size or % of RAM); empty: the default
  std::string policy = "balanced";        // residency plan policy
  int load_threads = 0;                   // checkpoint read workers; 0: every core
  AdapterFlags adapters;                  // --lora FILE[:SCALE] (repeatable), --adapter-blocks
  uint64_t seed = 0;                      // noise and random-context seed
  std::string context;                    // safetensors with `context` [B,S,D] (+ optional `negative_context`)
  std::string cross_attn_mask;            // safetensors with `cross_attn_mask` (regional prompting); empty: none
  std::string mask_blocks;                // the blocks it applies to: even|odd|all|i,j,k; empty: even
  std::string connector_inputs;           // safetensors with a semantic connector's text inputs; empty: none
  std::string output;                     // final latent (.safetensors)
  std::string stats_json;                 // stats JSON file
  std::string trace;                      // Chrome/Perfetto trace file
  std::string timeline;                   // SVG timeline of one steady-state step
  std::string lllite;                     // ControlNet-LLLite FILE[:WEIGHT[:BEGIN:END]]; empty: none
  std::string control_image;              // its control image (PNG)
  std::string control_mask;               // its inpaint mask (PNG), for a 4-channel adapter
};

constexpr const char* kCpuDefaultPreset = "anima-medium";
constexpr int64_t kCpuDefaultResolution = 512;      // compute in bf16
constexpr int64_t kCpuFp32DefaultResolution = 256;  // compute in fp32 or fp16
constexpr int kCpuDefaultSteps = 12;
constexpr double kCpuDefaultMaxResident = 0.5;
constexpr const char* kGpuDefaultPreset = "anima-2b";
constexpr int64_t kGpuDefaultResolution = 1024;
constexpr int kGpuDefaultSteps = 30;
constexpr const char* kGpuDefaultBudget = "50%";
constexpr int64_t kLatentScale = 8;  // pixels per latent cell (the VAE's downsampling)

std::string fmt(const char* format, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, a);
  return buf;
}

std::string mb(uint64_t bytes) { return format_mib(bytes); }

CLI::Validator finite_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && std::isfinite(v)) return {};
        } catch (const std::exception&) {
        }
        return "expected a finite number, got '" + value + "'";
      },
      "FLOAT", "finite");
}

CLI::Validator resolution_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const long long v = std::stoll(value, &used);
          if (used == value.size() && v >= 16 && v <= 16384 && v % 16 == 0) return {};
        } catch (const std::exception&) {
        }
        return "resolution must be a multiple of 16 between 16 and 16384 pixels, got '" + value + "'";
      },
      "PX", "resolution");
}

// The dtype of a checkpoint's Linear weights (its 2-d ".weight" tensors): the fp8 dtype most
// of them have when any is fp8, else the most common one; nullopt when it has none.
std::optional<at::ScalarType> stored_weight_dtype(const std::string& path) {
  const auto f = safetensors::File::open(path);
  const anima::CheckpointProbe probe = anima::probe_checkpoint(*f);
  std::map<at::ScalarType, int64_t> fp8, all;
  const std::string suffix = ".weight";
  for (const auto& t : f->tensors()) {
    if (t.name.rfind(probe.prefix, 0) != 0 || t.shape.size() != 2 || t.name.size() < suffix.size() ||
        t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    all[t.dtype] += 1;
    if (is_fp8(t.dtype)) fp8[t.dtype] += 1;
  }
  const auto& from = fp8.empty() ? all : fp8;
  std::optional<at::ScalarType> best;
  for (const auto& [dtype, n] : from) {
    if (!best || n > from.at(*best)) best = dtype;
  }
  return best;
}

struct Context {
  at::Tensor cond;    // [B, S, D]
  at::Tensor uncond;  // [B, S, D]
  std::string source;         // where both came from, for the sampling line
  std::string uncond_source;  // where the unconditional one came from
};

Context load_context(const RunArgs& a, const ModelInfo& info) {
  Context c;
  if (a.context.empty()) {
    // A random prompt embedding from its own stream (seed + 1), the unconditional one zero.
    const int64_t S = info.has_adapter ? info.adapter_output_tokens : 512;
    at::Generator gen = at::detail::createCPUGenerator(a.seed + 1);
    c.cond = at::randn({1, S, info.context_dim}, gen);
    c.uncond = at::zeros_like(c.cond);
    c.uncond_source = "zeros";
    c.source = "random [1, " + std::to_string(S) + ", " + std::to_string(info.context_dim) + "] (seed " +
               std::to_string(a.seed + 1) + "), unconditional " + c.uncond_source;
    return c;
  }
  const auto f = safetensors::File::open(a.context);
  for (const auto& t : f->tensors())
    if (t.name != "context" && t.name != "negative_context")
      throw InvalidArgument("unexpected tensor '" + t.name + "' in context file '" + a.context +
                            "' (expected context [+ negative_context])");
  if (!f->contains("context")) throw InvalidArgument("context file '" + a.context + "' has no 'context' tensor");
  auto check = [&](const std::string& name, const at::Tensor& t) {
    if (t.dim() != 3 || t.size(0) < 1 || t.size(1) < 1 || t.size(2) != info.context_dim)
      throw InvalidArgument("tensor '" + name + "' in '" + a.context + "' has shape " + shape_str(t.sizes()) +
                            ", expected [B, S, " + std::to_string(info.context_dim) + "]");
    if (!at::isFloatingType(t.scalar_type()))
      throw InvalidArgument("tensor '" + name + "' in '" + a.context + "' has dtype " +
                            std::string(c10::toString(t.scalar_type())) + ", expected a floating-point dtype");
    require_finite(t, "tensor '" + name + "' in '" + a.context + "'");  // Note [non-finite values]
  };
  c.cond = f->tensor("context").to(at::kFloat).contiguous();
  check("context", c.cond);
  if (f->contains("negative_context")) {
    c.uncond = f->tensor("negative_context").to(at::kFloat).contiguous();
    check("negative_context", c.uncond);
    if (c.uncond.sizes() != c.cond.sizes())
      throw InvalidArgument("tensor 'negative_context' in '" + a.context + "' has shape " +
                            shape_str(c.uncond.sizes()) + ", expected the shape of 'context' " +
                            shape_str(c.cond.sizes()));
  } else {
    c.uncond = at::zeros_like(c.cond);
  }
  c.uncond_source = f->contains("negative_context") ? "negative_context of " + a.context : std::string("zeros");
  c.source = a.context + " " + shape_str(c.cond.sizes()) +
             (f->contains("negative_context") ? " with negative_context" : ", unconditional zeros");
  return c;
}

// The text inputs of a model with a semantic connector (README "Anima-3.8B v1.1's semantic
// connector"): the conditional context is encoded from them again at every step, since the
// connector's output depends on the timestep.
struct ConnectorText {
  at::Tensor qwen, ids;                   // the native adapter's inputs
  std::optional<at::Tensor> weights;      // t5_weights
  SemanticInputs semantic;                // the Qwen3.5 layers and mask (timesteps set per step)
  int64_t batch = 0;
};

std::optional<ConnectorText> load_connector_inputs(const RunArgs& a, const ModelInfo& info) {
  if (a.connector_inputs.empty()) return std::nullopt;
  const std::string& path = a.connector_inputs;
  if (!info.has_connector)
    throw InvalidArgument("--connector-inputs '" + path + "': model '" + info.name + "' has no semantic connector");
  const auto f = safetensors::File::open(path);
  const auto is_layer = [](const std::string& n) {
    return n.rfind("qwen35_hidden_", 0) == 0 && n.size() > 14 &&
           n.find_first_not_of("0123456789", 14) == std::string::npos;
  };
  for (const auto& t : f->tensors()) {
    if (t.name != "qwen_hidden" && t.name != "t5_ids" && t.name != "t5_weights" && t.name != "qwen35_hidden" &&
        t.name != "qwen35_mask" && !is_layer(t.name))
      throw InvalidArgument("unexpected tensor '" + t.name + "' in connector inputs '" + path +
                            "' (expected qwen_hidden, t5_ids [+ t5_weights], qwen35_hidden or qwen35_hidden_0.. "
                            "[+ qwen35_mask])");
  }
  for (const char* name : {"qwen_hidden", "t5_ids"})
    if (!f->contains(name)) throw InvalidArgument("connector inputs '" + path + "' have no '" + name + "' tensor");
  ConnectorText c;
  c.qwen = f->tensor("qwen_hidden");
  c.ids = f->tensor("t5_ids");
  if (c.qwen.dim() != 3 || c.qwen.size(2) != info.adapter_source_dim || !at::isFloatingType(c.qwen.scalar_type()))
    throw InvalidArgument("tensor 'qwen_hidden' in '" + path + "' has shape " + shape_str(c.qwen.sizes()) + " (" +
                          c10::toString(c.qwen.scalar_type()) + "), expected floating-point [B, S, " +
                          std::to_string(info.adapter_source_dim) + "]");
  require_finite(c.qwen, "tensor 'qwen_hidden' in '" + path + "'");
  c.batch = c.qwen.size(0);
  if (f->contains("t5_weights")) c.weights = f->tensor("t5_weights");
  if (f->contains("qwen35_hidden")) {
    c.semantic.qwen35_hidden.push_back(f->tensor("qwen35_hidden"));
  } else {
    for (int64_t i = 0; f->contains("qwen35_hidden_" + std::to_string(i)); ++i)
      c.semantic.qwen35_hidden.push_back(f->tensor("qwen35_hidden_" + std::to_string(i)));
  }
  if (c.semantic.qwen35_hidden.empty())
    throw InvalidArgument("connector inputs '" + path + "' have no 'qwen35_hidden' [" +
                          std::to_string(info.connector_layers) + ", B, S', " +
                          std::to_string(info.connector_source_dim) + "] (or qwen35_hidden_0..)");
  if (f->contains("qwen35_mask")) c.semantic.qwen35_mask = f->tensor("qwen35_mask");
  return c;
}

int run(const RunArgs& args) {
  RunArgs a = args;
  const bool embedded = a.checkpoint.empty() && a.synthetic.empty();
  if (a.device.empty()) a.device = at::hasCUDA() ? "cuda" : "cpu";
  const at::Device device = resolve_device(a.device);  // ResourceError when absent
  const bool gpu = !device.is_cpu();
  if (embedded) {  // Note [run defaults]
    a.synthetic = gpu ? kGpuDefaultPreset : kCpuDefaultPreset;
    if (gpu && a.vram_budget.empty()) a.vram_budget = kGpuDefaultBudget;
    if (!gpu && !a.max_resident && a.vram_budget.empty()) a.max_resident = kCpuDefaultMaxResident;
  }
  // The compute dtype `auto` will pick (the cache resolves it again, with the same answer):
  // the CPU default's size depends on it (Note [run defaults]).
  const ComputeChoice compute = choose_compute_dtype(a.compute, device, anima::fp16_verdict());
  const int64_t px = a.resolution.value_or(gpu                                   ? kGpuDefaultResolution
                                           : compute.dtype == at::kBFloat16 ? kCpuDefaultResolution
                                                                            : kCpuFp32DefaultResolution);
  sampling::SamplerOptions so;
  so.steps = a.steps.value_or(gpu ? kGpuDefaultSteps : kCpuDefaultSteps);
  so.cfg = a.cfg;
  sampling::validate(so);

  if (!gpu) {
    // The CPU device's copy stream is a worker thread that needs a core of its own; with
    // intra-op threads on every core it starves (offload/device/cpu_device.h).
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    if (cores > 1 && at::get_num_threads() >= cores) at::set_num_threads(cores - 1);
  }
  c10::InferenceMode guard;
  RuntimeOptions ro;
  ro.device = a.device;
  ro.vram_budget = a.vram_budget;
  ro.vram_headroom = a.vram_headroom;
  ro.working_memory = a.working_memory;
  ro.resolution = px;
  ro.prefetch = a.prefetch;
  ro.pin_memory = a.pin_memory;
  ro.pin_memory_limit = a.pin_memory_limit;
  ro.policy = a.policy;
  ro.load_threads = a.load_threads;
  ro.trace = !a.trace.empty() || !a.timeline.empty();
  const std::unique_ptr<ModelCache> cache_owner = make_model_cache(ro);
  ModelCache& cache = *cache_owner;

  // Note [run storage]: unset, an fp8 checkpoint keeps its own fp8 dtype.
  const std::optional<at::ScalarType> file_dtype =
      a.checkpoint.empty() ? std::nullopt : stored_weight_dtype(a.checkpoint);
  const bool storage_given = !a.storage.empty();
  if (!storage_given) a.storage = file_dtype && is_fp8(*file_dtype) ? dtype_name(*file_dtype) : "float8_e4m3fn";
  LoadOptions lo;
  lo.storage = a.storage;
  lo.compute = a.compute;
  lo.max_resident = a.max_resident;
  const std::string source = a.checkpoint.empty() ? a.synthetic : a.checkpoint;
  const auto t_load = std::chrono::steady_clock::now();
  Model model = cache.load(source, lo);
  LockedModel locked = model.lock();
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  const ModelInfo& info = locked.info();
  const Context ctx = load_context(a, info);  // before any output: errors leave stdout empty
  const std::optional<ConnectorText> connector = load_connector_inputs(a, info);
  if (connector) {
    // Checked once here (shapes, widths, mask), so that a bad file fails before any step.
    ConnectorText probe = *connector;
    if (probe.batch != ctx.cond.size(0))
      throw InvalidArgument("connector inputs '" + a.connector_inputs + "' have batch " + std::to_string(probe.batch) +
                            ", the context has " + std::to_string(ctx.cond.size(0)));
    if (ctx.cond.size(1) != info.adapter_output_tokens)
      throw InvalidArgument("with --connector-inputs the context must have the adapter's " +
                            std::to_string(info.adapter_output_tokens) + " tokens, '" + a.context + "' has " +
                            std::to_string(ctx.cond.size(1)));
    probe.semantic.timesteps = at::ones({probe.batch}, at::kFloat);
    locked.encode_text(probe.qwen, probe.ids, probe.weights, probe.semantic);
  }
  const ModelStats ms0 = model.stats();
  const CacheStats cs0 = cache.stats();

  std::cout << "sluice run: " << info.name << (a.checkpoint.empty() ? " (random weights)" : " from " + a.checkpoint)
            << " on " << cs0.device << ", storage " << info.storage_dtype << ", compute " << info.compute_dtype
            << (embedded ? " [embedded default]" : "") << "\n";
  if (file_dtype && dtype_name(*file_dtype) != info.storage_dtype) {
    std::cout << "note: '" << a.checkpoint << "' stores its weights as " << dtype_name(*file_dtype) << "; cast to "
              << info.storage_dtype << " storage as they are read"
              << (storage_given ? " (--storage " + a.storage + ")"
                                : std::string(" (the default --storage for a checkpoint that is not fp8)"))
              << "\n";
  }
  std::cout << "hardware: " << hardware_summary(device) << "\n";
  if (connector) {
    std::cout << "semantic connector: context encoded at every step from " << a.connector_inputs << " (qwen_hidden "
              << shape_str(connector->qwen.sizes()) << ", " << connector->semantic.qwen35_hidden.size()
              << " Qwen3.5 tensor(s)" << (connector->semantic.qwen35_mask.defined() ? ", with mask" : "") << ")\n";
  }
  // Note [host memory limit] (runtime/host_memory_limit.h): what the host-side defaults
  // came from, a container's cgroup limit included.
  std::cout << "host memory limit: "
            << (cs0.host_memory_limit_bytes ? format_bytes(cs0.host_memory_limit_bytes) + " from " +
                                                  cs0.host_memory_limit_source
                                            : std::string("unknown"))
            << "; model RAM limit "
            << (cs0.ram_limit_bytes ? format_bytes(cs0.ram_limit_bytes) : std::string("unlimited"))
            << ", pinned memory limit " << format_bytes(cs0.pin_limit_bytes)
            << (cs0.pin_limit_source.empty() ? " (--pin-memory-limit)" : "") << "\n";
  std::cout << "compute " << info.compute_dtype << ": " << info.compute_reason << "\n";
  std::cout << "loaded in " << fmt("%.2f", load_s) << " s: total " << mb(ms0.total_bytes) << ", resident "
            << mb(ms0.resident_bytes) << " ("
            << fmt("%.1f", ms0.total_bytes ? 100.0 * static_cast<double>(ms0.resident_bytes) / static_cast<double>(ms0.total_bytes) : 0.0)
            << "%), streamed per forward " << mb(ms0.streamed_dit_bytes) << " (+ " << mb(ms0.streamed_adapter_bytes)
            << (connector ? " of LLM adapter and connector layers, streamed by each step's encode)\n"
                          : " of LLM adapter layers, unused here)\n");
  std::cout << "budget " << mb(cs0.vram_budget_bytes)
            << (cs0.vram_budget_source.empty() ? std::string() : " [" + cs0.vram_budget_source + "]")
            << " (working memory " << mb(cs0.working_memory_bytes)
            << "), max-resident "
            << (a.max_resident ? fmt("%.2f", *a.max_resident) : std::string("none")) << ", prefetch " << a.prefetch
            << ", policy " << a.policy << ", pin-memory " << a.pin_memory << "\n";
  std::cout << "residency: " << ms0.residency << "\n";
  if (ms0.streamed_dit_bytes == 0) {
    // Note [run defaults]: a 50% budget on a large card holds anima-2b whole.
    std::cout << "note: everything fits: the budget of " << mb(cs0.vram_budget_bytes) << " holds all "
              << mb(ms0.total_bytes) << " of " << info.name
              << " resident, so nothing streams. To see streaming, add --max-resident 0.5 (half the streamable "
                 "weights streamed) or give a smaller --vram-budget\n";
  }

  // --lora: applied for the whole run (until the lock ends), one line each.
  const std::vector<LoraHandle> loras = apply_loras(locked, a.adapters, &std::cout);

  // ControlNet-LLLite (README, "ControlNet-LLLite"): bound for the whole run, its weight set
  // per step by InvokeAI's step gate.
  std::optional<LLLiteSpec> lllite_spec;
  LLLiteHandle lllite;
  if (!a.lllite.empty()) {
    lllite_spec = parse_lllite_spec(a.lllite, /*with_range=*/true, "--lllite");
    std::optional<at::Tensor> mask;
    if (!a.control_mask.empty()) mask = read_png(a.control_mask, /*rgb=*/false);
    lllite = locked.apply_lllite(lllite_spec->path, read_png(a.control_image, /*rgb=*/true), lllite_spec->weight, mask,
                                 a.adapters.layout());
    std::cout << "lllite: " << lllite_spec->path << ", weight " << fmt("%g", lllite_spec->weight) << " for steps "
              << fmt("%g", lllite_spec->begin) << ".." << fmt("%g", lllite_spec->end) << " of the run, "
              << lllite.modules() << " modules on " << lllite.bound_layers() << " layers, " << mb(lllite.device_bytes())
              << ", control image " << a.control_image << (mask ? ", mask " + a.control_mask : std::string()) << "\n";
  }

  const int64_t B = ctx.cond.size(0);
  const int64_t lat = px / kLatentScale;
  const at::Tensor noise = sampling::initial_noise({B, info.in_channels, 1, lat, lat}, a.seed);
  const at::Tensor ctx_both = at::cat({ctx.uncond, ctx.cond}, 0);
  // Regional prompting (README, "Regional prompting"): the mask restricts the conditional
  // forwards' cross-attention; the unconditional half of a batched forward gets an all-True
  // mask (InvokeAI leaves the negative prompt unmasked). Its shape is checked by the forward.
  std::optional<at::Tensor> cond_mask, both_mask;
  std::vector<int64_t> mask_blocks;
  if (!a.cross_attn_mask.empty()) {
    const auto mf = safetensors::File::open(a.cross_attn_mask);
    if (!mf->contains("cross_attn_mask"))
      throw InvalidArgument("mask file '" + a.cross_attn_mask + "' has no 'cross_attn_mask' tensor");
    at::Tensor m = mf->tensor("cross_attn_mask");
    if (m.scalar_type() != at::kBool && m.scalar_type() != at::kByte)
      throw InvalidArgument("tensor 'cross_attn_mask' in '" + a.cross_attn_mask + "' has dtype " +
                            std::string(c10::toString(m.scalar_type())) + ", expected bool or uint8");
    m = m.ne(0);
    // The forward sees [uncond, cond] batches: name the shape this file must have here.
    const int64_t side = (lat + info.patch_spatial - 1) / info.patch_spatial, L = side * side, S = ctx.cond.size(1);
    const bool fits = (m.dim() == 2 && m.size(0) == L && m.size(1) == S) ||
                      (m.dim() == 3 && m.size(0) == B && m.size(1) == L && m.size(2) == S);
    if (!fits)
      throw InvalidArgument("tensor 'cross_attn_mask' in '" + a.cross_attn_mask + "' has shape " + shape_str(m.sizes()) +
                            ", expected [L, S] = [" + std::to_string(L) + ", " + std::to_string(S) + "] or [" +
                            std::to_string(B) + ", " + std::to_string(L) + ", " + std::to_string(S) +
                            "] (L = image tokens " + std::to_string(side) + "*" + std::to_string(side) + " of the " +
                            std::to_string(lat) + "x" + std::to_string(lat) + " latent, S = context tokens)");
    if (m.dim() == 2) m = m.unsqueeze(0).expand({B, m.size(0), m.size(1)});
    cond_mask = m.contiguous();
    both_mask = at::cat({at::ones_like(m), m}, 0);
    mask_blocks = parse_mask_blocks(a.mask_blocks, info.num_blocks);
    std::cout << "regional prompting: cross_attn_mask " << shape_str(cond_mask->sizes()) << " from "
              << a.cross_attn_mask << ", blocks " << (a.mask_blocks.empty() ? "even" : a.mask_blocks) << "\n";
  } else if (!a.mask_blocks.empty()) {
    throw InvalidArgument("--mask-blocks needs --cross-attn-mask");
  }
  std::cout << "sampling: " << so.steps << " steps, cfg " << fmt("%g", so.cfg) << ", shift " << fmt("%g", so.shift)
            << ", " << px << "x" << px << " px (latent " << shape_str(noise.sizes()) << "), seed " << a.seed
            << ", context "
            << (connector ? "encoded at every step from " + a.connector_inputs + ", unconditional " + ctx.uncond_source
                          : ctx.source)
            << "\n";
  std::cout.flush();

  RunProgress progress(so.steps);  // the live line, on a terminal only
  progress.redraw();
  const LockedModel::LayerProgress on_layer = [&](int64_t done, int64_t expected) { progress.on_layer(done, expected); };
  // Note [non-finite values]: each velocity is checked on the host copy the sampler makes
  // of it anyway, and the latent after each step; the first non-finite one ends the run
  // with one error line (the stats JSON is still written). Only then is a forward re-run,
  // with a per-layer check, to name the first layer whose output went non-finite.
  int step = 0;  // the step being computed, 0-based
  auto fail = [&](const std::string& what) {
    status_line::clear();
    if (!a.stats_json.empty()) {
      write_text_file(a.stats_json, model.stats_json() + "\n", "stats");
      std::cout << "wrote " << a.stats_json << "\n" << std::flush;
    }
    throw Error("sluice run: step " + std::to_string(step + 1) + "/" + std::to_string(so.steps) + ": " + what);
  };
  auto connector_context = [&](sampling::Guidance which, double sigma) {
    ConnectorText in = *connector;
    in.semantic.timesteps = at::full({in.batch}, sigma, at::kFloat);
    const at::Tensor cond = locked.encode_text(in.qwen, in.ids, in.weights, in.semantic).to(at::kCPU, at::kFloat);
    // Note [non-finite values]: a connector layer that overflows is named here, not as the
    // DiT layer that first reads its context.
    if (!all_finite(cond))
      fail(nonfinite_output_message("adapter", "context", cond,
                                    locked.locate_nonfinite_text(in.qwen, in.ids, in.weights, in.semantic)));
    if (which == sampling::Guidance::cond) return cond;
    if (which == sampling::Guidance::uncond) return ctx.uncond;
    return at::cat({ctx.uncond, cond}, 0);
  };
  auto velocity = [&](const at::Tensor& x, double sigma, sampling::Guidance which) {
    const at::Tensor& c_fixed = which == sampling::Guidance::cond     ? ctx.cond
                          : which == sampling::Guidance::uncond ? ctx.uncond
                                                                : ctx_both;
    const at::Tensor t = at::full({x.size(0)}, sigma, at::kFloat);
    // A semantic connector's context follows sigma: the conditional part is encoded at every step.
    const at::Tensor c = connector ? connector_context(which, sigma) : c_fixed;
    if (lllite_spec) lllite.set_weight(lllite_step_weight(*lllite_spec, step, so.steps));
    // The sampler's own cast to the latent (a no-op there now), so that the check reads the host copy.
    ForwardOptions fo;
    fo.progress = on_layer;
    if (cond_mask && which != sampling::Guidance::uncond) {
      fo.cross_attn_mask = which == sampling::Guidance::cond ? *cond_mask : *both_mask;
      fo.mask_blocks = mask_blocks;
    }
    const at::Tensor v = locked.forward(x, t, c, fo).to(x.device(), x.scalar_type());
    if (!all_finite(v)) fail(nonfinite_output_message("dit", "velocity", v, locked.locate_nonfinite(x, t, c, fo)));
    return v;
  };
  uint64_t seen = ms0.forwards;
  double total_ms = 0;
  auto on_step = [&](const sampling::StepInfo& s) {
    if (const auto bad = find_nonfinite(s.latent)) {
      fail("the latent is non-finite (" + std::to_string(bad->count) + " of " + std::to_string(bad->numel) +
           " values) after a finite velocity: the guidance (cfg " + fmt("%g", so.cfg) + ") or the Euler update overflowed");
    }
    step = s.step + 1;
    total_ms += s.ms;
    const ModelStats st = model.stats();
    uint64_t bytes = 0;
    double stall = 0, upcast = 0, gbps = 0;
    const uint64_t n = st.forwards - seen;  // forwards of this step
    for (uint64_t i = 0; i < n && i < st.forward_records.size(); ++i) {
      const ForwardStats& f = st.forward_records[st.forward_records.size() - 1 - i];
      bytes += f.bytes_streamed;
      stall += f.stall_ms;
      upcast += f.upcast_ms;
      gbps = f.h2d_gbps;
    }
    seen = st.forwards;
    progress.on_step(s.ms);
    char line[256];
    std::snprintf(line, sizeof line,
                  "step %*d/%d  sigma %.3f -> %.3f  %8.1f ms  streamed %s at %.2f GB/s  stall %.1f ms  upcast %.1f ms\n",
                  static_cast<int>(std::to_string(s.steps).size()), s.step + 1, s.steps, s.sigma, s.sigma_next, s.ms,
                  mb(bytes).c_str(), gbps, stall, upcast);
    status_line::clear();
    std::cout << line << std::flush;
    progress.redraw();
  };
  const at::Tensor latent = sampling::sample_euler(noise, velocity, so, on_step);
  status_line::clear();

  const ModelStats st = model.stats();
  const CacheStats cs = cache.stats();
  double stall = 0, upcast = 0, gbps = 0;
  uint64_t bytes = 0;
  for (const auto& f : st.forward_records) {
    stall += f.stall_ms;
    upcast += f.upcast_ms;
    gbps += f.h2d_gbps;
    bytes += f.bytes_streamed;
  }
  const double nf = st.forward_records.empty() ? 1.0 : static_cast<double>(st.forward_records.size());
  std::cout << "done: " << so.steps << " steps in " << fmt("%.2f", total_ms / 1000.0) << " s ("
            << fmt("%.1f", total_ms / so.steps) << " ms/step), " << st.forwards << " forwards; per forward "
            << mb(static_cast<uint64_t>(static_cast<double>(bytes) / nf)) << " streamed at " << fmt("%.2f", gbps / nf)
            << " GB/s, stall " << fmt("%.1f", stall / nf) << " ms, upcast " << fmt("%.1f", upcast / nf) << " ms\n";
  {
    // The plan's prediction beside the measured step (Note [calibration]).
    const nlohmann::json plan = nlohmann::json::parse(model.stats_json()).at("plan");
    std::cout << "plan: " << plan.at("policy").get<std::string>();
    if (plan.at("predicted_step_ms").is_number() && plan.at("measured_step_ms").is_number()) {
      const double pred = plan.at("predicted_step_ms").get<double>();
      const double meas = plan.at("measured_step_ms").get<double>();
      std::cout << " from measurements" << (plan.at("recomputed").get<bool>() ? " (recomputed once)" : "")
                << ", predicted " << fmt("%.1f", pred) << " ms/forward (floor "
                << fmt("%.1f", plan.at("floor_ms").get<double>()) << "), measured " << fmt("%.1f", meas)
                << " ms (median after the plan), predicted/measured " << fmt("%.3f", pred / meas);
    } else if (plan.at("predicted_step_ms").is_number()) {
      std::cout << " from measurements, predicted " << fmt("%.1f", plan.at("predicted_step_ms").get<double>())
                << " ms/forward (floor " << fmt("%.1f", plan.at("floor_ms").get<double>())
                << "); too few forwards under it to measure";
    } else {
      std::cout << " (no measurements yet: it is made from the second forward of each kind)";
    }
    std::cout << ", ring " << mb(plan.at("ring_bytes").get<uint64_t>()) << "\n";
  }
  {
    // Which layers the plan the run ended with keeps resident (it may differ from the map
    // at load: the balanced plan is made again from measurements).
    std::cout << "residency by layer at the end (R resident, S streamed; a column per block):\n";
    std::istringstream grid(st.residency_grid);
    for (std::string row; std::getline(grid, row);) std::cout << "  " << row << "\n";
  }
  std::cout << "device: peak " << mb(st.device_peak_bytes) << " (model), " << mb(static_cast<uint64_t>(cs.vram.peak))
            << " (cache) of limit " << mb(cs.vram_limit_bytes) << "; cache hits " << cs.hits << ", misses "
            << cs.misses << ", evictions " << cs.evictions << "\n";
  std::cout << "pinned host memory: " << mb(static_cast<uint64_t>(cs.pinned.current)) << " page-locked for "
            << mb(cs.pinned_used_bytes) << " of weights (limit " << mb(cs.pin_limit_bytes) << ")\n";

  if (!a.output.empty()) {
    safetensors::save(a.output, {{"latent", latent.contiguous()}},
                      {{"model", info.name},
                       {"source", info.source},
                       {"seed", std::to_string(a.seed)},
                       {"steps", std::to_string(so.steps)},
                       {"cfg", fmt("%g", so.cfg)},
                       {"shift", fmt("%g", so.shift)},
                       {"resolution", std::to_string(px)},
                       {"storage", info.storage_dtype},
                       {"compute", info.compute_dtype}});
    std::cout << "wrote " << a.output << ": latent " << shape_str(latent.sizes()) << " float32\n";
  }
  if (!a.stats_json.empty()) {
    write_text_file(a.stats_json, model.stats_json() + "\n", "stats");
    std::cout << "wrote " << a.stats_json << "\n";
  }
  if (!a.trace.empty()) {
    model.write_trace(a.trace);
    std::cout << "wrote " << a.trace << "\n";
  }
  if (!a.timeline.empty()) {
    model.write_timeline_svg(a.timeline);
    std::cout << "wrote " << a.timeline << "\n";
  }
  return 0;
}

}  // namespace

Subcommand add_run(CLI::App& root) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* sub = root.add_subcommand(
      "run", "Denoise a latent with an Anima model under a VRAM budget (no arguments: the embedded default)");
  auto* ckpt = sub->add_option("--checkpoint", a->checkpoint, "Model checkpoint (.safetensors)");
  auto* synth = sub->add_option("--synthetic", a->synthetic, "Random-weight model: preset name or JSON config")
                    ->check(config_validator());
  ckpt->excludes(synth);
  synth->excludes(ckpt);
  sub->add_option("--device", a->device, "cpu|cuda[:N] (default: cuda when present, else cpu)")
      ->check(device_validator());
  add_vram_budget_options(sub, a->vram_budget, a->vram_headroom,
                          std::string(kGpuDefaultBudget) + " on a GPU for the embedded default, else all of it");
  sub->add_option("--max-resident", a->max_resident, "Cap on the resident fraction of streamable weights (0..1)")
      ->check(number_validator(0.0, 1.0));
  sub->add_option("--working-memory", a->working_memory, "Budget part kept for activations (bytes)")
      ->check(size_validator("--working-memory", false));
  sub->add_option("--storage", a->storage,
                  "Stored weight dtype: float8_e4m3fn, float8_e5m2, bfloat16, float16 or float32 (default: an fp8 "
                  "checkpoint's own fp8 dtype, else float8_e4m3fn); a checkpoint stored in another dtype is cast as "
                  "it is read, which the run says once")
      ->check(CLI::IsMember({"float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"}));
  sub->add_option("--compute", a->compute,
                  "Compute dtype: auto (bfloat16 where the device computes it natively, else float32), bfloat16, "
                  "float16 or float32")
      ->check(CLI::IsMember({"auto", "bfloat16", "float16", "float32"}))
      ->capture_default_str();
  sub->add_option("--steps", a->steps, "Euler steps (default: 12 on cpu, 30 on a GPU)")->check(integer_validator(1, 100000));
  sub->add_option("--cfg", a->cfg, "Classifier-free guidance scale (1: conditional only)")
      ->check(finite_validator())
      ->capture_default_str();
  sub->add_option("--resolution", a->resolution,
                  "Image side in pixels, a multiple of 16 (default: 1024 on a GPU; on the CPU 512 computing in "
                  "bfloat16, 256 in float32)")
      ->check(resolution_validator());
  sub->add_option("--prefetch", a->prefetch,
                  "Most streamed layers copied ahead of compute: auto (as far as the staging ring's bytes allow) or N")
      ->check(prefetch_validator())
      ->capture_default_str();
  sub->add_option("--policy", a->policy,
                  "Residency plan: balanced (minimises the step predicted from measured compute and copy rate), "
                  "spread (streamed layers spread evenly by bytes) or front_first (whole blocks resident from the "
                  "front, the rest streamed)")
      ->check(policy_validator())
      ->capture_default_str();
  sub->add_option("--pin-memory", a->pin_memory, "Page-locked host memory for streamed layers (off on ROCm if it stalls)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  sub->add_option("--pin-memory-limit", a->pin_memory_limit,
                  "Page-locked host bytes for all models (size or percent of RAM); streamed layers past it stay "
                  "pageable (default: min(50% of RAM, RAM - 4GiB))")
      ->check(size_validator("--pin-memory-limit", true));
  add_load_threads_option(sub, a->load_threads);
  add_adapter_options(sub, a->adapters);
  sub->add_option("--seed", a->seed, "Seed of the initial noise and of the random context (0 to 2^64 - 1)")
      ->check(seed_validator())
      ->capture_default_str();
  sub->add_option("--lllite", a->lllite,
                  "ControlNet-LLLite file, weight (-10..10, default 1) and the fractions of the steps it runs for "
                  "(default 0:1), with --control-image")
      ->check(lllite_spec_validator(/*with_range=*/true, "--lllite"));
  CLI::Option* control_image =
      sub->add_option("--control-image", a->control_image, "The LLLite's control image (PNG, 8-bit; any size)");
  CLI::Option* control_mask = sub->add_option("--control-mask", a->control_mask,
                                              "An inpaint LLLite's mask (PNG, 8-bit; white = inpaint)");
  control_mask->needs(control_image);
  sub->get_option("--lllite")->needs(control_image);
  control_image->needs(sub->get_option("--lllite"));
  sub->add_option("--context", a->context, "safetensors file with 'context' [B,S,D] (+ 'negative_context'); default random");
  sub->add_option("--cross-attn-mask", a->cross_attn_mask,
                  "Regional prompting: safetensors file with 'cross_attn_mask' (bool or uint8 [L,S] or [B,L,S], "
                  "L = (px/16)^2 image tokens, S = context tokens), applied to the conditional forwards")
      ->check(CLI::ExistingFile);
  sub->add_option("--mask-blocks", a->mask_blocks, "Blocks --cross-attn-mask applies to: even (default), odd, all, or i,j,k");
  sub->add_option("--connector-inputs", a->connector_inputs,
                  "For a model with a semantic connector (Anima-3.8B v1.1): safetensors with qwen_hidden, t5_ids "
                  "[+ t5_weights], qwen35_hidden [layers,B,S',W] [+ qwen35_mask]; the context is encoded from them "
                  "at every step")
      ->check(CLI::ExistingFile);
  // Note [output paths]: each checked, and against the others and the inputs, before any work.
  sub->add_option("--output", a->output, "Write the final latent here (.safetensors, tensor 'latent')")
      ->check(output_file_validator());
  sub->add_option("--stats-json", a->stats_json, "Write the model/budget/device/forward/cache stats here (JSON)")
      ->check(output_file_validator());
  sub->add_option("--trace", a->trace, "Write a Chrome/Perfetto trace (copy, upcast and compute tracks) here")
      ->check(output_file_validator());
  sub->add_option("--timeline", a->timeline,
                  "Write an SVG timeline of one steady-state step here (copy, upcast and compute lanes; implies tracing)")
      ->check(output_file_validator());
  check_output_paths(sub,
                     {{"--output", &a->output}, {"--stats-json", &a->stats_json}, {"--trace", &a->trace},
                      {"--timeline", &a->timeline}},
                     {{"--checkpoint", &a->checkpoint}, {"--synthetic", &a->synthetic}, {"--context", &a->context},
                      {"--cross-attn-mask", &a->cross_attn_mask}});
  return {sub, [a] { return run(*a); }};
}

}  // namespace sluice::cli
