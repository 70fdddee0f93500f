#pragma once
// sluice's public C++ API: the one header an embedder includes.
//
//   sluice::RuntimeOptions ro;
//   ro.device = "cuda";
//   ro.vram_budget = "50%";
//   sluice::ModelCache cache(ro);
//   sluice::Model model = cache.load("anima.safetensors");   // or a preset: "anima-small"
//   {
//     sluice::LockedModel m = model.lock();                   // RAII: in use, never evicted
//     at::Tensor v = m(x, timesteps, context);                 // DiT velocity
//   }
//   std::string json = model.stats_json();
//
// The cache keeps models in RAM (weights in their storage dtype, fp8 by default) and, under
// a device-memory budget shared by all of them, keeps as many layers of each on the device
// as fit; the others are streamed host->device for every forward. See README.md.
//
// Errors are sluice exceptions (std::runtime_error subclasses) whose one-line what() names
// the file, flag, tensor or model at fault.
//
// Thread-safety: every class here may be used from several threads. Different models run
// concurrently; forwards (and encode_text) on one model serialize on that model. Stats,
// residency_map() and write_trace() never wait for a running forward: during one they
// report the state from before it.
//
// Stability: fields may be added to the option and stats structs (always defaulted); the
// existing ones keep their meaning. The reported records are in sluice/stats.hpp, each
// declared by one list of its fields (Note [field lists] there).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sluice/stats.hpp"  // the reported records: Counter, CacheStats, ForwardStats, NonFiniteReport

namespace sluice {

namespace detail {
class CacheImpl;
struct ModelEntry;
struct LockToken;
struct LoraState;
struct LLLiteState;
}  // namespace detail

// The library version, "MAJOR.MINOR.PATCH".
std::string version();

// sluice's log lines (the "sluice" logger: stderr by default, its level from
// SLUICE_LOG_LEVEL, else info).
enum class LogLevel { trace, debug, info, warn, error, off };
void set_log_level(LogLevel level);
LogLevel log_level();
// Sends every line the level lets through to `sink` instead of stderr (an embedder's own
// logging); an empty function: stderr again. `sink` runs on the thread that logs (a copy
// worker's too), must not block (queue the line if the embedder's logging may) and must
// not throw.
using LogSink = std::function<void(LogLevel level, const std::string& message)>;
void set_log_sink(LogSink sink);

// Options for a ModelCache (one per device). Sizes are strings parsed with sluice's size
// rules: plain bytes ("123456"), binary units ("6GiB", "512MiB", "8G"), decimal units
// ("6GB"), or a percentage ("50%") where the field says of what.
// Like the records of sluice/stats.hpp, each option struct is one list of its fields
// (Note [field lists] there), here with each field's default: the struct, and the keyword
// arguments of the Python binding, come from it.
#define SLUICE_RUNTIME_OPTIONS_FIELDS(F)                                                                           \
  F(std::string, device, "cpu")        /* "cpu" (the CPU plays the device, for tests and CI), "cuda", "cuda:N" */     \
  F(std::string, vram_budget, "")      /* device bytes for all models, working memory included ("50%" of TOTAL   */ \
                                       /* device memory; "auto": free memory minus vram_headroom); empty: all   */ \
  F(std::string, vram_headroom, "")    /* "auto" only: device memory left free ("10%" of TOTAL memory); empty:  */ \
                                       /* max(512MiB, 5% of total) */                                             \
  F(std::string, working_memory, "")   /* part of the budget kept free for activations ("10%" of the budget);   */ \
                                       /* empty: 1GiB x (resolution/1024)^2, at least 256MiB, at most 25% of    */ \
                                       /* the budget */                                                           \
  F(int64_t, resolution, 1024)         /* image side (pixels) the default working memory is sized for */         \
  F(std::string, ram_limit, "")        /* host bytes for cached models ("50%" of RAM), LRU eviction; "0":       */ \
                                       /* unlimited; empty: min(L, max(4GiB, 50% of L - 2GiB)), L the host      */ \
                                       /* memory limit (CacheStats::host_memory_limit_bytes) */                   \
  F(std::string, prefetch, "auto")     /* most streamed layers copied ahead of compute: "auto" (as far as the   */ \
                                       /* staging ring's bytes allow) or "0".."65536" */                          \
  F(std::string, pin_memory, "auto")   /* page-locked host copies of streamed layers: "auto" (on for CUDA and   */ \
                                       /* ROCm), "on", "off" (turn off on ROCm if it stalls) */                   \
  F(std::string, pin_memory_limit, "") /* page-locked host bytes for all models together ("25%" of RAM);        */ \
                                       /* streamed layers past it stay pageable; empty: min(50% of L, L - 4GiB), */ \
                                       /* L the host memory limit */                                              \
  F(std::string, policy, "balanced")   /* residency plan: "balanced" (minimises the predicted step from         */ \
                                       /* measured costs), "spread" or "front-first" */                           \
  F(bool, timing, true)                /* device-timed stall/upcast/copy numbers per forward (a few events per  */ \
                                       /* layer) */                                                               \
  F(bool, trace, false)                /* record per-layer spans for Model::write_trace (implies timing) */       \
  F(uint64_t, device_memory, 0)        /* device memory to assume (the 100% of "50%"); 0: ask the device (CPU:  */ \
                                       /* min(physical RAM, cgroup limit)) */                                     \
  F(double, cpu_copy_gbps, 0)          /* CPU device only: modelled host->device bandwidth in GB/s (1e9 B/s);   */ \
                                       /* 0: memcpy speed */                                                      \
  F(double, cpu_copy_latency_us, 0)    /* CPU device only: modelled fixed cost of each host->device copy */       \
  F(int, load_threads, 0)              /* threads that read (and cast) a checkpoint; 0: every core */
struct RuntimeOptions {
  SLUICE_RUNTIME_OPTIONS_FIELDS(SLUICE_DECLARE_OPTION)
};

// How a model is loaded. Changing a field marked [reload] for a model already in the cache
// replaces it: the old copy is dropped and the model is read again.
#define SLUICE_LOAD_OPTIONS_FIELDS(F)                                                                                 \
  F(std::string, storage, "float8_e4m3fn")      /* [reload] stored dtype of Linear/Embedding weights; "bfloat16"   */ \
                                                /* (or any non-fp8 dtype): no fp8 */                                \
  F(std::string, compute, "auto")               /* [reload] dtype forwards compute in: "auto" (bf16 where the      */ \
                                                /* device computes it natively, else fp16 where native and fit for */ \
                                                /* the model, else fp32), "bfloat16", "float16", "float32" */       \
  F(std::vector<std::string>, extra_skips, {})  /* [reload] more skip patterns: layers kept in the compute dtype */ \
  F(bool, use_default_skips, true)              /* [reload] include the default skip patterns (pos_embed, ...) */  \
  F(bool, use_model_skips, true)                /* [reload] include the model's declared patterns (Anima:          */ \
                                                /* t_embedder, x_embedder, final_layer) */                          \
  F(std::optional<double>, max_resident, {})    /* cap on the resident fraction (0..1) of the streamable weights;  */ \
                                                /* none: the budget decides */                                      \
  F(std::string, config, "")                    /* [reload] preset name or JSON file: overrides the config         */ \
                                                /* inferred from a file / the preset's */                           \
  F(uint64_t, seed, 0)                          /* [reload] seed of a generated model's weights (presets and .json */ \
                                                /* configs) */                                                      \
  F(std::string, name, "")                      /* name in logs and stats; empty: the preset name or the file's    */ \
                                                /* stem */
struct LoadOptions {
  SLUICE_LOAD_OPTIONS_FIELDS(SLUICE_DECLARE_OPTION)
};

// One model. See Model::stats().
struct ModelStats {
  uint64_t id = 0;                     // unique in its cache (two models may share a name)
  std::string name;
  std::string source;                  // the path or preset it was loaded from
  std::string device;
  bool in_ram = false;                 // loaded (false after eviction; the next lock() reloads)
  bool on_device = false;              // attached to the device (some layers resident)
  uint64_t locks = 0;                  // open LockedModel/active LoraHandle
  uint64_t total_bytes = 0;            // stored bytes of every weight
  uint64_t resident_bytes = 0;         // of which resident on the device
  uint64_t streamed_bytes = 0;         // of which streamed (not resident)
  uint64_t streamed_dit_bytes = 0;     // of which DiT layers: what each forward streams
  uint64_t streamed_adapter_bytes = 0; // of which LLM adapter layers: what each encode_text streams
  std::string residency;               // residency map: "blocks: RRSRRS...; other: ..."
  std::string residency_grid;          // per layer: a row per layer of a block, a column per block (multi-line)
  uint64_t share_bytes = 0;            // device bytes reserved for this model (weights, ring, scratch)
  uint64_t device_bytes = 0;           // device bytes it holds now (its staging ring at its capacity, a reservation)
  uint64_t allocated_bytes = 0;        // of which allocated on the device now (the ring's slots made so far)
  uint64_t device_peak_bytes = 0;      // most it held since the last residency change
  uint64_t minimum_bytes = 0;          // smallest share it runs with
  uint64_t layers = 0, resident_layers = 0, streamed_layers = 0;
  uint64_t forwards = 0;               // forwards run since load
  std::vector<ForwardStats> forward_records;  // the most recent, oldest first
  uint64_t nonfinite_reruns = 0;               // forwards re-run by locate_nonfinite (each also counts in forwards)
  std::optional<NonFiniteReport> nonfinite;    // the latest re-run's finding
};

// What a model takes and gives (from its config).
struct ModelInfo {
  std::string name;
  std::string source;                 // the path or preset it was loaded from
  std::string storage_dtype;          // effective (fp8 may fall back on devices without it)
  std::string compute_dtype;
  std::string compute_reason;         // "requested", or why "auto" chose compute_dtype
  int64_t in_channels = 0;            // x is [B, in_channels, T, H, W]
  int64_t out_channels = 0;
  int64_t context_dim = 0;            // context is [B, S, context_dim]
  int64_t patch_spatial = 0;          // H and W are padded to multiples of it
  int64_t patch_temporal = 0;
  int64_t num_blocks = 0;
  bool has_adapter = false;           // encode_text available
  int64_t adapter_source_dim = 0;     // qwen_hidden is [B, S, adapter_source_dim]
  int64_t adapter_vocab_size = 0;     // t5_ids in [0, adapter_vocab_size)
  int64_t adapter_output_tokens = 0;  // encode_text returns [B, adapter_output_tokens, context_dim]
  bool has_connector = false;         // a semantic connector (Anima-3.8B v1.1): SemanticInputs accepted
  int64_t connector_layers = 0;       // SemanticInputs::qwen35_hidden holds this many layers
  int64_t connector_source_dim = 0;   // each [B, S', connector_source_dim]
  std::string config_json;            // the full config
};

class LockedModel;
class LoraHandle;

// The semantic connector's inputs for one encode_text (Anima-3.8B v1.1; README "Anima-3.8B
// v1.1's semantic connector"). Its output depends on the timestep: encode again every step.
struct SemanticInputs {
  // Qwen3.5 hidden states: ModelInfo::connector_layers tensors [B, S', connector_source_dim]
  // (layers 7, 15, 23, 31 of Qwen3.5-4B, in that order), or one stacked [layers, B, S', width].
  std::vector<at::Tensor> qwen35_hidden;
  at::Tensor qwen35_mask;  // [B, S'], true (non-zero) for a valid token; undefined: all valid
  at::Tensor timesteps;    // [B]: the sigma the DiT gets at this step
};

// Where an adapter's block indices go (a LoRA's, an LLLite's) when it was trained on a shallower
// Anima than the model: Anima-2.9B (40 blocks) and Anima-3.8B (52) insert new blocks between
// the base model's 28 (README, "The depth-expanded Anima-2.9B and Anima-3.8B, and adapters
// trained on a shallower model"). The adapter's own depth is the smallest of 28, 40, 52 above
// its highest block index.
enum class BlockLayout {
  measured,  // to the blocks it was trained on, by the positions measured from the released models (one INFO line)
  as_is,     // by index, as the file says
};
// "measured" or "as-is" (the C, Python and CLI spelling); InvalidArgument naming `what` and the
// value otherwise.
BlockLayout parse_block_layout(const std::string& value, const std::string& what = "block_layout");

// Options of one DiT forward (LockedModel::forward). Regional prompting (README, "Regional
// prompting"): a boolean cross-attention mask restricts which context tokens each image token
// reads, True = attend, on the listed blocks (as InvokeAI's Anima regional prompting). Its
// shape is [L, S] (one for the batch) or [B, L, S]: S the context's tokens, L the image
// tokens T' * ceil(H / 2) * ceil(W / 2) for x [B, C, T, H, W] (patch_spatial 2; T' =
// ceil(T / patch_temporal)), in (t, h, w) row-major order. A row with no True gives that
// token no cross-attention (zero), not NaN. InvalidArgument, one line naming it: a mask that
// is not Bool, of another shape (the line says the expected L and S), a block out of range.
struct ForwardOptions {
  std::optional<at::Tensor> cross_attn_mask;  // bool [L, S] or [B, L, S], on any device; none: no mask
  std::vector<int64_t> mask_blocks;           // blocks the mask applies to; empty: the even ones (0, 2, ...)
  std::function<void(int64_t layers_done, int64_t layers_expected)> progress;  // as LockedModel::LayerProgress
};

// A shared handle on a cached model. Copies refer to the same model. Valid while any copy
// lives, even after the cache is destroyed; after drop() (or a [reload] load of the same
// source) lock() throws.
class Model {
 public:
  Model() = default;
  explicit operator bool() const { return entry_ != nullptr; }

  const std::string& name() const;
  ModelInfo info() const;

  // Marks the model in use until the LockedModel is destroyed: it is loaded if it was
  // evicted, gets its device share (other unlocked models give up residency first), and
  // is neither evicted nor unloaded by the cache meanwhile. Several locks may be held.
  // Throws ResourceError when the budget cannot hold it, InvalidArgument after drop().
  LockedModel lock();

  // Residency changes, applied now (they wait for a running forward of this model) and
  // kept as the model's target for later locks. Each returns the change in device bytes.
  int64_t partial_load(uint64_t bytes);    // up to `bytes` more (others unloaded if needed)
  int64_t partial_unload(uint64_t bytes);  // at least `bytes` less, down to the minimum
  int64_t full_load();                     // every layer resident; ResourceError if it cannot fit
  int64_t full_unload();                   // the minimum: always-resident layers, ring, scratch
  // Caps the resident fraction (0..1) of streamable weights; nullopt lifts the cap.
  void set_max_resident(std::optional<double> fraction);

  ModelStats stats() const;
  // JSON with model.{id,name,source,dropped,total_bytes,resident_bytes,residency,
  // streamed_bytes_by_forward{dit,adapter}}, budget.{budget_bytes,working_memory_bytes,
  // share_bytes}, device.{peak_bytes,current_bytes,allocated_bytes,allocator_current_bytes,
  // other_models_bytes,unattributed_bytes,...} (allocator_current_bytes, the whole device's,
  // = allocated_bytes + other_models_bytes + unattributed_bytes: what the allocator holds
  // that no model does, such as a GPU forward's activations and outputs; null where the
  // allocator has no counters), forwards[] {kind,
  // bytes_streamed, planned_bytes, h2d_gbps, stall_ms, upcast_ms, wall_ms, ...},
  // plan.{policy, predicted_step_ms, floor_ms, measured_step_ms, recomputed, kinds[], ...},
  // prefetch.{wasted_copies, wasted_bytes, mismatched_forwards}, cache.{hits,misses,
  // evictions,...}, nonfinite.{reruns, last {forward,kind,module,nonfinite_values,...} (null
  // before locate_nonfinite ran)}. A forward's bytes_streamed equals its planned_bytes: the
  // streamed_bytes_by_forward[kind] of the plan it ran under (the balanced plan is made
  // again from the first forward's measurements, so the first forward's may differ).
  std::string stats_json(int indent = 2) const;
  // Chrome/Perfetto trace of the recorded forwards (RuntimeOptions::trace); FileError.
  void write_trace(const std::string& path) const;
  // A self-contained SVG timeline of one steady-state DiT forward (copy, upcast and
  // compute lanes, each layer's box coloured resident or streamed, stalls marked, the
  // step's totals in a caption; README, "The `sluice` command", `--timeline`). Needs
  // RuntimeOptions::trace and a complete DiT forward (else InvalidArgument); FileError.
  void write_timeline_svg(const std::string& path) const;
  // "blocks: RRSRRS...; other: ..." (empty while the model is off the device).
  std::string residency_map() const;

 private:
  friend class ModelCache;
  friend class LockedModel;
  explicit Model(std::shared_ptr<detail::ModelEntry> entry) : entry_(std::move(entry)) {}
  std::shared_ptr<detail::ModelEntry> entry_;
};

// Note [LoRA lifetime]
// ~~~~~~~~~~~~~~~~~~~~
// A LoRA lives no longer than the lock it was made from (LockedModel::apply_lora): it is
// removed by LoraHandle::remove(), when its handle is destroyed, or when that lock ends
// (LockedModel::unlock() or its destruction), whichever comes first. Removal takes the
// sidecars away (the stored weights were never touched, so forwards give the unpatched
// model's outputs bit for bit) and gives their device bytes back (README, "Device memory: every
// byte charged"). A handle that outlives its lock stays valid but inactive: active()
// is false, remove() does nothing. The same rule holds in C (sluice_unlock) and Python
// (LockedModel.unlock, the end of the lock's `with` block).
// Why this rule and not "unlock refuses while LoRAs are live": a lock ends in destructors,
// in `with` exits and while an exception unwinds, where a refusal cannot be acted on (a
// destructor cannot fail, and a failing __exit__ would replace the exception that got
// there); and a frontend reads lock ... unlock as the span in which it changed the model,
// so the next lock, its own or another frontend's, must find the model as loaded. A LoRA
// that stayed would keep the model locked and patched, with no lock left to remove it
// through.
//
// A LoRA applied to a locked model as a forward-time sidecar (the stored weights are never
// touched). Removed when destroyed, by remove(), or when its lock ends (Note [LoRA
// lifetime]); while active it keeps the model locked.
class LoraHandle {
 public:
  LoraHandle() = default;
  LoraHandle(LoraHandle&&) noexcept = default;
  LoraHandle& operator=(LoraHandle&& other) noexcept;
  ~LoraHandle();
  LoraHandle(const LoraHandle&) = delete;
  LoraHandle& operator=(const LoraHandle&) = delete;

  // Whether the LoRA is applied now: false once removed, also by the end of its lock.
  bool active() const;
  explicit operator bool() const { return active(); }
  // Layers the adapter patches (InvalidArgument on an empty handle).
  int64_t patched_layers() const;
  // Removes the sidecars now (waits for a running forward); the handle becomes empty.
  // Nothing to do when its lock ended already.
  void remove();

 private:
  friend class LockedModel;
  explicit LoraHandle(std::shared_ptr<detail::LoraState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::LoraState> state_;
};

// A ControlNet-LLLite adapter bound to a locked model (LockedModel::apply_lllite; README,
// "ControlNet-LLLite"). Its lifetime follows a LoRA's (Note [LoRA lifetime]): removed when
// destroyed, by remove(), or when its lock ends; while active it keeps the model locked.
class LLLiteHandle {
 public:
  LLLiteHandle() = default;
  LLLiteHandle(LLLiteHandle&&) noexcept = default;
  LLLiteHandle& operator=(LLLiteHandle&& other) noexcept;
  ~LLLiteHandle();
  LLLiteHandle(const LLLiteHandle&) = delete;
  LLLiteHandle& operator=(const LLLiteHandle&) = delete;

  // Whether the adapter is bound now: false once removed, also by the end of its lock.
  bool active() const;
  explicit operator bool() const { return active(); }
  // The weight of later forwards (0: exact passthrough), e.g. per step for a step range.
  // InvalidArgument when not finite or the handle is not active.
  void set_weight(double weight);
  double weight() const;
  // Modules in the file, Linears bound, device bytes of its weights (InvalidArgument on an
  // empty handle).
  int64_t modules() const;
  int64_t bound_layers() const;
  uint64_t device_bytes() const;
  // Unbinds it now (waits for a running forward); the handle becomes empty.
  void remove();

 private:
  friend class LockedModel;
  explicit LLLiteHandle(std::shared_ptr<detail::LLLiteState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::LLLiteState> state_;
};

// A model in use (RAII). Movable, not copyable; unlocks when destroyed or by unlock().
class LockedModel {
 public:
  LockedModel() = default;
  LockedModel(LockedModel&&) noexcept = default;
  LockedModel& operator=(LockedModel&& other) noexcept;
  ~LockedModel();
  LockedModel(const LockedModel&) = delete;
  LockedModel& operator=(const LockedModel&) = delete;

  explicit operator bool() const { return token_ != nullptr; }

  // DiT velocity. x [B, in_channels, T, H, W], timesteps [B] (sigma in [0, 1]), context
  // [B, S, context_dim]. Inputs may be on any device and of any floating dtype: they are
  // moved to the model's device and compute dtype. Returns [B, out_channels, T, H, W] in
  // the compute dtype on the model's device. InvalidArgument names a bad input, a NaN or
  // Inf in one too: "forward: input 'x' has 3 non-finite values (first at [0, 2, 0, 5, 7]:
  // nan)" (inputs on a device cost one wait for the stream for that check). The output is
  // not checked: see locate_nonfinite.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context);
  // The same, calling `progress(layers_done, layers_expected)` on this thread after each
  // layer: `layers_expected` is the layer count of the previous forward (0 for the first).
  // On a GPU a layer counts once its work is enqueued. If `progress` throws, one warning
  // is logged and it is not called again in this forward; except sluice::Interrupted,
  // a request to stop: the forward then ends before its next layer and
  // rethrows it, leaving the model as any forward that threw does (every weight in its
  // storage dtype, leases released; the next forward is unchanged). Python's Ctrl-C uses it.
  using LayerProgress = std::function<void(int64_t layers_done, int64_t layers_expected)>;
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
                     const LayerProgress& progress);
  // The same with ForwardOptions: a cross-attention mask (regional prompting) and a progress
  // callback.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
                     const ForwardOptions& options);
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context) {
    return forward(x, timesteps, context);
  }

  // LLM adapter: qwen_hidden [B, S, adapter_source_dim], t5_ids [B, S_t] (integers),
  // optional per-token weights [B, S_t] -> context [B, adapter_output_tokens, context_dim].
  // Non-finite qwen_hidden or t5_weights are an InvalidArgument as in forward.
  at::Tensor encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                         const std::optional<at::Tensor>& t5_weights = std::nullopt);
  // The same through the semantic connector (ModelInfo::has_connector). InvalidArgument, one
  // line, for a model without one, a wrong layer count or width, a mask of another shape, a
  // missing timestep, or non-finite values.
  at::Tensor encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                         const std::optional<at::Tensor>& t5_weights, const SemanticInputs& semantic);

  // Runs forward (encode_text) again on the same inputs with a check after every layer
  // and block, and returns the first module whose output held a NaN or Inf; nothing when
  // no module's output nor the output did. For a caller whose own check of an output
  // failed (sluice run checks each velocity): the normal path pays no per-layer wait, this
  // one waits for the device after each layer. The re-run counts as a forward of its kind
  // in the stats, which keep its finding (ModelStats::nonfinite, stats JSON "nonfinite").
  std::optional<NonFiniteReport> locate_nonfinite(const at::Tensor& x, const at::Tensor& timesteps,
                                                  const at::Tensor& context);
  // The same for a forward with a cross-attention mask (ForwardOptions::progress is not called).
  std::optional<NonFiniteReport> locate_nonfinite(const at::Tensor& x, const at::Tensor& timesteps,
                                                  const at::Tensor& context, const ForwardOptions& options);
  std::optional<NonFiniteReport> locate_nonfinite_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                                       const std::optional<at::Tensor>& t5_weights = std::nullopt);
  // The same through the semantic connector, with the inputs encode_text got: a connector
  // whose output held a NaN or Inf is named as one of its layers (SemanticInputs as there).
  std::optional<NonFiniteReport> locate_nonfinite_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                                       const std::optional<at::Tensor>& t5_weights,
                                                       const SemanticInputs& semantic);

  // Streams (GPU). forward() and encode_text() run on the calling thread's current stream
  // of the model's device, whichever it is (a host may use streams of its own); inputs
  // are read and outputs written on it. Inputs must be ready on that stream, and outputs
  // are ready for later work on it: other streams wait for them with an event, the host
  // with synchronize(). Tensors handed to torch on that stream need nothing more: torch
  // frees stream-ordered. Device memory sluice frees is safe against every stream that
  // used it (the allocator's recordStream).
  // synchronize() blocks until everything sluice enqueued for this model, the copies and
  // the calling thread's current stream, is done; then an output may be read on the host
  // through a raw pointer (tensor.cpu() and .item() already wait).
  void synchronize();

  // Reads a LoRA safetensors file and patches the model with it at `scale`, until the
  // handle is removed or destroyed or this lock ends (Note [LoRA lifetime]). The model's
  // device share grows by the sidecars' bytes from the free budget (other unlocked models
  // give up residency first); only what the budget cannot give streams more of its layers
  // (README, "Device memory: every byte charged"). FileError / CheckpointError name the file
  // and the mismatching keys; ResourceError (one line naming the model, the LoRA and the
  // bytes missing, nothing changed) when the budget cannot hold the sidecars even with
  // every streamable layer streamed. `layout`: where the blocks of a LoRA trained on a
  // shallower Anima go (BlockLayout); CheckpointError naming the file, its highest block and the
  // model's depth when it addresses a block the model lacks.
  LoraHandle apply_lora(const std::string& path, double scale = 1.0, BlockLayout layout = BlockLayout::measured);
  // Same as handle.remove().
  void remove_lora(LoraHandle& handle) { handle.remove(); }

  // Reads a ControlNet-LLLite file (v2 named-key format, InvokeAI's) and binds it to the model
  // with `cond_image` ([3, H, W] or [1, 3, H, W], RGB in [0, 1], any size and device) at
  // `weight`, until the handle is removed or destroyed or this lock ends (Note [LoRA
  // lifetime]). An inpaint adapter (4 input channels) needs `mask` ([H, W], [1, H, W] or
  // [1, 1, H, W], 1 = inpaint); an RGB one takes none. Its weights are charged like a LoRA's
  // sidecars (the share grows into the free budget, else more layers stream). Errors, each one
  // line: FileError / CheckpointError naming the file and what does not fit (legacy format,
  // unknown module, missing key, shape, a target the model lacks); InvalidArgument for a bad
  // image, mask or weight; ResourceError as apply_lora's. `layout`: where the blocks of an
  // adapter trained on a shallower Anima go, as apply_lora's.
  LLLiteHandle apply_lllite(const std::string& path, const at::Tensor& cond_image, double weight = 1.0,
                            const std::optional<at::Tensor>& mask = std::nullopt,
                            BlockLayout layout = BlockLayout::measured);

  const ModelInfo& info() const;
  Model model() const;
  // Releases the lock now, first removing the LoRAs applied through it (Note [LoRA
  // lifetime]); the LockedModel becomes empty.
  void unlock();

 private:
  friend class Model;
  explicit LockedModel(std::shared_ptr<detail::LockToken> token);
  std::shared_ptr<detail::LockToken> token_;
};

// The runtime: models in RAM under a RAM limit (LRU eviction of unlocked models) and on one
// device under one budget shared by all of them. `Runtime` is the same class.
class ModelCache {
 public:
  // Throws InvalidArgument naming the field for a bad option, ResourceError for a budget
  // that leaves nothing beside the working memory.
  explicit ModelCache(RuntimeOptions options = {});
  ~ModelCache();
  ModelCache(const ModelCache&) = delete;
  ModelCache& operator=(const ModelCache&) = delete;

  // A model by preset name ("anima-small": generated from options.seed, no file), by JSON
  // config file (generated likewise), or from a .safetensors checkpoint. A source already
  // cached with the same [reload] options is a hit and returns the same model. Logs at
  // INFO: "Loaded model 'NAME' onto DEVICE in 0.36s. Total model size: 2012.0MiB, VRAM:
  // 1006.0MiB (50.0%)" and the residency map. Throws FileError, CheckpointError,
  // InvalidArgument, or ResourceError naming the minimum budget that would work.
  Model load(const std::string& path_or_preset, const LoadOptions& options = {});

  // Removes a model: now, or when its last lock ends. Its handles' lock() throws afterwards.
  void drop(const Model& model);

  // New budget for all models (RuntimeOptions::vram_budget forms; "auto" reads the free
  // memory now, with RuntimeOptions::vram_headroom). Unlocked models give up
  // residency first; locked ones are only partially unloaded. ResourceError (nothing
  // changed) when the locked models' minimum does not fit.
  void set_vram_budget(const std::string& budget);

  CacheStats stats() const;
  // The "cache" object of Model::stats_json: the counters above, and models_held, one entry
  // per model the cache holds {id, name, source, in_ram, on_device, dropped, locks,
  // share_bytes, device_bytes, allocated_bytes}, so that vram.current = models_allocated_bytes
  // + vram_unattributed_bytes and vram_reserved_bytes = the sum of share_bytes.
  std::string stats_json(int indent = 2) const;
  // Handles on every model the cache holds (also those whose handles were all released,
  // and dropped ones still locked), in load order. Two may share a name: ModelStats::id
  // and the stats JSON's model.id tell them apart. Torch modules offloaded into the cache
  // (OffloadedModel, include/sluice/offload.hpp) are not among them: their OffloadedModel
  // is their handle; stats_json's models_held lists them too.
  std::vector<Model> models() const;
  const RuntimeOptions& options() const;

 private:
  friend class OffloadedModel;  // adopts its model into the cache (include/sluice/offload.hpp)
  std::shared_ptr<detail::CacheImpl> impl_;
};

using Runtime = ModelCache;

}  // namespace sluice
