#include "offload/engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <regex>
#include <sstream>
#include <unordered_set>

#include "offload/cpu_device.h"
#include "offload/repoint.h"
#include "offload/upcast_registry.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/fp8.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

namespace {

constexpr size_t kNone = static_cast<size_t>(-1);

at::Tensor typed_view(const at::Tensor& bytes, uint64_t offset, at::ScalarType dtype, at::IntArrayRef sizes) {
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const int64_t n = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return bytes.narrow(0, static_cast<int64_t>(offset), n).view(dtype).view(sizes);
}

at::Tensor host_alias(const at::Tensor& t) {
  if (!t.defined()) return t;
  at::Tensor a = t.detach();
  return a.is_contiguous() ? a : a.contiguous();
}

}  // namespace

PinMode parse_pin_mode(std::string_view text, const std::string& flag) {
  if (text == "auto") return PinMode::auto_;
  if (text == "on") return PinMode::on;
  if (text == "off") return PinMode::off;
  throw InvalidArgument(flag + ": unknown pin mode '" + std::string(text) + "' (use auto, on or off)");
}

StreamingEngine::StreamingEngine(EngineOptions options) : options_(std::move(options)) {
  device_ = options_.device ? options_.device : std::shared_ptr<DeviceBackend>(make_cpu_device());
  if (device_->device().is_cuda()) register_cuda_kernels();  // fp8 upcast kernel, where built
  if (options_.max_resident && !(*options_.max_resident >= 0.0 && *options_.max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*options_.max_resident));
  }
  if (options_.ring_slots == 0) {
    options_.ring_slots = options_.prefetch_depth == kPrefetchAuto ? 3 : options_.prefetch_depth + 1;
  }
  sched_ = PrefetchScheduler(options_.prefetch_depth);
  max_resident_ = options_.max_resident;
  ResidencyApplierOptions applier;
  applier.pin = options_.pin == PinMode::on || (options_.pin == PinMode::auto_ && device_->pins_memory());
  applier.arena = options_.pin_arena ? options_.pin_arena
                                     : std::make_shared<PinnedArena>(options_.pin_memory_limit ? *options_.pin_memory_limit
                                                                                              : default_pin_memory_limit());
  applier.ring_slots = options_.ring_slots;
  applier_ = std::make_unique<ResidencyApplier>(*device_, applier);
}

StreamingEngine::~StreamingEngine() {
  if (!attached_) return;
  for (auto& l : leases_) l.clear();
  depth_ = 0;
  restore_to_host();
  clear_state();
}

double StreamingEngine::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - epoch0_).count();
}

// Note [trace clock]: where done event `e` happened on the trace's time axis.
double StreamingEngine::trace_us(const DeviceEvent& e) const {
  return trace_origin_->host_us + device_->elapsed_ms(*trace_origin_->event, e) * 1000.0;
}

// ---------------------------------------------------------------------------------------
// attach / detach

std::vector<std::regex> StreamingEngine::required_regexes() const {
  std::vector<std::regex> required;
  for (const auto& p : options_.required_patterns) {
    try {
      required.emplace_back(p);
    } catch (const std::regex_error& e) {
      throw InvalidArgument("required layer pattern '" + p + "' is not a valid regex: " + e.what());
    }
  }
  return required;
}

void StreamingEngine::collect(torch::nn::Module& model, const std::vector<std::regex>& required, bool check_host) {
  const auto managed = managed_layers(model);
  std::unordered_set<const c10::TensorImpl*> managed_impls;
  layers_.reserve(managed.size());
  for (const auto& [name, layer] : managed) {
    LayerRecord r = describe_layer(name, *layer);
    if (check_host && r.host_s.defined() && !r.host_s.device().is_cpu()) {
      throw InvalidArgument("attach: weight scale of layer '" + name + "' is not on the host");
    }
    managed_impls.insert(layer->stored_weight().unsafeGetTensorImpl());
    if (layer->has_bias()) managed_impls.insert(layer->stored_bias().unsafeGetTensorImpl());
    r.required = layer->kind() == LayerKind::embedding || (options_.require_unconverted && !r.upcast_w);
    for (const auto& re : required) r.required = r.required || std::regex_search(name, re);
    index_[layer] = static_cast<int64_t>(layers_.size());
    layers_.push_back(std::move(r));
    leases_.emplace_back();
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (managed_impls.count(item.value().unsafeGetTensorImpl())) continue;
    extras_.push_back({item.value(), host_alias(item.value()), at::Tensor()});
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    extras_.push_back({item.value(), host_alias(item.value()), at::Tensor()});
  }
  for (const auto& e : extras_) {
    if (check_host && !e.host.device().is_cpu()) throw InvalidArgument("attach: a parameter of model '" + model_name_ + "' is not on the host");
    extra_bytes_ += e.host.nbytes();
  }
  for (const auto& r : layers_) scratch_bytes_ = std::max(scratch_bytes_, r.scratch_bytes);
}

WeightNeeds StreamingEngine::needs(torch::nn::Module& model, const EngineOptions& options) {
  StreamingEngine probe(options);
  probe.model_name_ = "(sizing)";
  probe.collect(model, probe.required_regexes(), /*check_host=*/false);
  WeightNeeds n;
  n.model_bytes = probe.extra_bytes_;
  uint64_t largest_slot = 0;
  for (const auto& r : probe.layers_) {
    n.model_bytes += r.stored_bytes;
    largest_slot = std::max(largest_slot, r.slot_bytes);
  }
  n.full = n.model_bytes + probe.reserved_bytes();
  n.minimum = minimum_weight_budget(probe.plan_input(0, options.max_resident));
  // With no budget limit the plan is bounded by max_resident alone.
  const uint64_t unlimited = n.full + static_cast<uint64_t>(probe.options_.ring_slots) * largest_slot;
  n.wanted = plan_residency(probe.plan_input(unlimited, options.max_resident)).device_bytes();
  probe.layers_.clear();
  probe.leases_.clear();
  probe.extras_.clear();
  probe.index_.clear();
  return n;
}

void StreamingEngine::set_max_resident(std::optional<double> max_resident) {
  if (max_resident && !(*max_resident >= 0.0 && *max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*max_resident));
  }
  if (!attached_) {
    max_resident_ = max_resident;
    return;
  }
  replan(weight_budget_, max_resident);
}

void StreamingEngine::attach(torch::nn::Module& model, std::string model_name, std::optional<uint64_t> budget_bytes) {
  if (attached_) throw InvalidArgument("engine already has model '" + model_name_ + "' attached");
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::regex> required = required_regexes();
  auto managed = managed_layers(model);
  for (const auto& [name, layer] : managed) {
    if (layer->provider()) {
      throw InvalidArgument("layer '" + name + "' of model '" + model_name + "' already has a weight provider");
    }
    if (!layer->stored_weight().device().is_cpu() || (layer->has_bias() && !layer->stored_bias().device().is_cpu())) {
      throw InvalidArgument("attach: layer '" + name + "' of model '" + model_name +
                            "' is not on the host; attach a model loaded in RAM");
    }
  }
  model_name_ = std::move(model_name);
  try {
    collect(model, required, /*check_host=*/true);
    budget_bytes_ = budget_bytes ? *budget_bytes : options_.budget_bytes ? options_.budget_bytes : device_->total_memory();
    if (budget_bytes_ == 0) {
      throw InvalidArgument("the memory of device " + device_->name() + " is unknown: give the budget in bytes");
    }
    if (budget_bytes_ <= options_.working_memory_bytes) {
      throw ResourceError("budget " + format_mib(budget_bytes_) + " for model '" + model_name_ +
                          "' leaves nothing beside the working memory of " + format_mib(options_.working_memory_bytes));
    }
    weight_budget_ = budget_bytes_ - options_.working_memory_bytes;
    const PlanInput input = plan_input(weight_budget_, max_resident_);
    const uint64_t min_weights = minimum_weight_budget(input);
    if (weight_budget_ < min_weights) {
      const uint64_t min_budget = min_weights + options_.working_memory_bytes;
      std::ostringstream msg;
      msg << "budget " << format_mib(budget_bytes_) << " is too small for model '" << model_name_ << "' on "
          << device_->name() << ": the minimum is " << format_mib(min_budget) << " (" << min_budget
          << " bytes: always-resident layers and params, upcast scratch and the staging ring need "
          << format_mib(min_weights) << ", working memory " << format_mib(options_.working_memory_bytes) << ")";
      throw ResourceError(msg.str());
    }
    const ResidencyPlan plan = plan_residency(input);
    budget_ = std::make_shared<MemoryLedger>("device budget of model '" + model_name_ + "'", weight_budget_);
    applier_->begin_model(model_name_, budget_);

    for (auto& e : extras_) {
      e.dev = device_->allocate(e.host.sizes(), e.host.scalar_type(), MemoryKind::params, "parameter", budget_);
      device_->copy_to_device(e.dev, e.host);
    }
    device_->synchronize();  // reports a failed parameter copy here (apply_plan's first synchronize orders them)
    for (auto& e : extras_) repoint(e.handle, e.dev);
    if (scratch_bytes_) {
      scratch_.push_back({device_->allocate({static_cast<int64_t>(scratch_bytes_)}, at::kByte, MemoryKind::scratch,
                                            "upcast scratch", budget_),
                          false});
    }
    apply_plan(plan);
    planned();
    for (auto& r : layers_) r.layer->set_provider(this);
    attached_ = true;
  } catch (...) {
    restore_to_host();
    clear_state();
    throw;
  }

  if (!options_.log_attach) return;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t total = extra_bytes_;
  for (const auto& r : layers_) total += r.stored_bytes;
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(2);
  line << "Loaded model '" << model_name_ << "' onto " << device_->name() << " in " << secs
       << "s. Total model size: " << format_mib(total) << ", VRAM: " << format_mib(plan_.resident_bytes);
  line.precision(1);
  line << " (" << (total ? 100.0 * static_cast<double>(plan_.resident_bytes) / static_cast<double>(total) : 100.0)
       << "%)";
  log::info(line.str());
  std::ostringstream map;
  map << "Residency of '" << model_name_ << "' (" << residency_policy_name(plan_.policy) << "): "
      << plan_.residency_map() << "; ring " << format_mib(plan_.ring_bytes) << " (largest slot "
      << format_mib(plan_.slot_bytes) << "), scratch " << format_mib(scratch_bytes_) << ", budget " << format_mib(budget_bytes_)
      << " (working memory " << format_mib(options_.working_memory_bytes) << ")";
  log::info(map.str());
  if (log::enabled(log::Level::debug)) log::debug(plan_.to_string());
}

void StreamingEngine::detach() {
  if (!attached_) return;
  require_idle("detach");
  restore_to_host();
  clear_state();
}

// Frees device memory without waiting for the device: every use by another stream was
// recorded (Note [stream-safe frees]). clear_state() synchronizes afterwards, only to
// report a copy that failed.
void StreamingEngine::restore_to_host() noexcept {
  for (auto& r : layers_) {
    try {
      r.layer->set_stored(r.host_w, r.host_b.defined() ? std::optional<at::Tensor>(r.host_b) : std::nullopt);
      r.layer->set_weight_scale(r.host_s);
      r.layer->set_provider(nullptr);  // ours while attached, even if a wrapper was installed
      r.dev_w = r.dev_b = r.dev_s = at::Tensor();
      r.resident = false;
    } catch (const std::exception& e) {
      log::error("detach: restoring layer '" + r.name + "' failed: " + e.what());
    }
  }
  for (auto& e : extras_) {
    try {
      if (e.host.defined()) repoint(e.handle, e.host);
      e.dev = at::Tensor();
    } catch (const std::exception& ex) {
      log::error(std::string("detach: restoring a parameter failed: ") + ex.what());
    }
  }
}

void StreamingEngine::retire_ring() {
  if (!ring_) return;
  ring_->invalidate();
  ring_violations_ += ring_->violations();
  wasted_copies_ += ring_->wasted_copies();
  wasted_bytes_ += ring_->wasted_bytes();
  ring_.reset();
  sched_.reset_frontier();
}

void StreamingEngine::clear_state() noexcept {
  retire_ring();
  scratch_.clear();
  layers_.clear();
  leases_.clear();
  index_.clear();
  extras_.clear();
  extra_bytes_ = scratch_bytes_ = 0;
  lora_bytes_ = nested_reserve_ = nested_seen_ = 0;
  sidecars_.clear();
  forward_sidecars_.clear();
  measured_kinds_.clear();  // the next model's forwards are measured afresh
  measuring_ = false;
  nested_flag_ = false;
  sched_.clear();
  acc_cur_ = ForwardAcc{};
  acc_next_ = ForwardAcc{};
  unresolved_.clear();
  anchor_.reset();
  plan_ = ResidencyPlan{};
  calib_.reset();
  if (budget_ && budget_->current() != 0) {
    log::warn("model '" + model_name_ + "': " + format_mib(budget_->current()) +
              " of device memory is still referenced outside the engine after detach");
  }
  budget_.reset();
  bounce_.reset();
  last_end_.reset();
  last_stream_ = 0;
  try {
    device_->synchronize();
  } catch (const std::exception& e) {
    log::error("detach of model '" + model_name_ + "': a device copy had failed: " + e.what());
  }
  device_->release_cached_memory();  // the model's device memory goes back to the driver
  applier_->end_model();
  depth_ = 0;
  implicit_ = false;
  attached_ = false;
}

// ---------------------------------------------------------------------------------------
// residency

PlanInput StreamingEngine::plan_input(uint64_t weight_budget, std::optional<double> max_resident) const {
  PlanInput in;
  in.layers.reserve(layers_.size());
  for (const auto& r : layers_) {
    PlanLayer l;
    l.name = r.name;
    l.stored_bytes = r.stored_bytes;
    l.slot_bytes = r.slot_bytes;
    l.group = r.group;
    l.block = r.block;
    l.required = r.required;
    in.layers.push_back(std::move(l));
  }
  in.extra_required_bytes = extra_bytes_;
  in.scratch_bytes = reserved_bytes();  // Note [device extras]: scratch, nested-lease reserve, sidecars
  in.weight_budget = weight_budget;
  in.max_resident = max_resident;
  in.policy = options_.policy;
  in.ring_slots = options_.ring_slots;
  in.max_ahead = options_.prefetch_depth;
  in.costs = calib_.model(layers_.size());
  return in;
}

void StreamingEngine::apply_plan(const ResidencyPlan& plan) {
  TORCH_INTERNAL_ASSERT(plan.resident.size() == layers_.size(), "apply_plan: plan for another model");
  try {
    device_->synchronize();
  } catch (const DeviceError& e) {
    // A copy that no forward read (a prefetch) failed; its slot goes with the ring below.
    log::warn("model '" + model_name_ + "': " + e.what() + " (an unread prefetch, dropped with the staging ring)");
  }
  retire_ring();
  acc_next_ = ForwardAcc{};  // prefetches for the next forward went with the ring
  while (scratch_.size() > 1) scratch_.pop_back();  // extra buffers from nested leases
  ResidencyApplier::Applied applied;
  try {
    // Note [residency applier]: the residency moves, their synchronize, the ring, pinning.
    applied = applier_->apply(layers_, plan, [this](uint64_t capacity) { make_ring(capacity); });
    plan_ = plan;
    if (applied.is_degraded()) plan_from_layers();
  } catch (...) {
    // The applier dropped what this call made resident; stream the rest through a ring
    // sized for what is streamed now (if that still fits).
    plan_ = plan;
    plan_from_layers();
    retire_ring();
    try {
      ensure_ring();
    } catch (const std::exception& e) {
      log::error("model '" + model_name_ + "': no staging ring after a failed residency change (" + e.what() +
                 "); the next forward tries again");
    }
    refresh_streamed();
    throw;
  }
  if (applied.is_degraded()) {
    std::ostringstream msg;
    msg << "model '" << model_name_ << "': " << applied.degraded << "; continuing with a smaller residency: "
        << format_mib(plan_.resident_bytes) << " resident, " << format_mib(plan_.streamed_bytes) << " streamed ("
        << plan_.residency_map() << ")";
    log::warn(msg.str());
  }
  refresh_streamed();
}

void StreamingEngine::plan_from_layers() {
  offload::plan_from_layers(plan_, layers_, extra_bytes_, options_.ring_slots);
}

void StreamingEngine::ensure_ring() {
  if (ring_ || plan_.ring_bytes == 0) return;
  make_ring(plan_.ring_bytes);
}

void StreamingEngine::make_ring(uint64_t capacity) {
  retire_ring();
  auto ring = std::make_unique<StagingRing>(*device_, budget_, capacity);
  // The first slots now, in execution order: an allocation failure surfaces here.
  std::vector<uint64_t> sizes;
  for (const auto& r : layers_) {
    if (!r.resident) sizes.push_back(r.slot_bytes);
  }
  ring->prepare(sizes);
  ring_ = std::move(ring);
}

void StreamingEngine::require_idle(const char* what) const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!leases_[i].empty()) {
      throw InvalidArgument(std::string(what) + ": layer '" + layers_[i].name + "' of model '" + model_name_ +
                            "' is in use by a running forward");
    }
  }
  if (depth_ > 0 && !implicit_) {
    throw InvalidArgument(std::string(what) + ": called during a forward of model '" + model_name_ + "'");
  }
}

int64_t StreamingEngine::replan(uint64_t weight_budget, std::optional<double> max_resident, bool release_freed) {
  TORCH_CHECK(attached_, "no model attached");
  require_idle("residency change");
  if (depth_ > 0) end_forward(false);  // an implicit forward
  const PlanInput input = plan_input(weight_budget, max_resident);
  const uint64_t min_weights = minimum_weight_budget(input);
  if (weight_budget < min_weights) {
    throw ResourceError("model '" + model_name_ + "' needs at least " + format_mib(min_weights + options_.working_memory_bytes) +
                        " of budget (" + std::to_string(min_weights + options_.working_memory_bytes) + " bytes), got " +
                        format_mib(weight_budget + options_.working_memory_bytes));
  }
  const ResidencyPlan plan = plan_residency(input);
  const int64_t before = static_cast<int64_t>(budget_->current());
  budget_->set_limit(weight_budget);
  weight_budget_ = weight_budget;
  max_resident_ = max_resident;
  apply_plan(plan);
  planned();
  budget_->reset_peak();  // the budget may have shrunk: peaks count from the new plan on
  check_invariants("residency change");
  const int64_t change = static_cast<int64_t>(budget_->current()) - before;
  // Note [releasing cached memory]: only a budget cut gives the freed blocks back to the
  // driver; a shrinking replan leaves them in the allocator's cache for the next forward.
  if (change < 0 && release_freed) device_->release_cached_memory();
  return change;
}

void StreamingEngine::planned() {
  if (plan_.predictions.empty()) {
    calib_.unplanned();
  } else {
    calib_.planned(plan_.predictions);
  }
}

void StreamingEngine::replan_if_measured() {
  if (!calib_.replan_due() || !attached_) return;
  try {
    const PlanInput input = plan_input(weight_budget_, max_resident_);
    if (!input.costs.usable()) {
      calib_.planned({});  // nothing to plan by yet (no copy was timed): keep the plan
      return;
    }
    ResidencyPlan plan = plan_residency(input);
    if (plan.resident == plan_.resident && plan.ring_bytes == plan_.ring_bytes) {
      plan_.predictions = plan.predictions;  // the same residency: keep the ring and its prefetches
    } else {
      apply_plan(plan);
      budget_->reset_peak();
      check_invariants("plan from measurements");
    }
    calib_.planned(plan_.predictions);
  } catch (const std::exception& e) {
    calib_.planned(plan_.predictions);  // do not retry every forward
    log::warn("model '" + model_name_ + "': planning from the measured costs failed, keeping the plan: " + e.what());
    return;
  }
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(2);
  line << "Plan of '" << model_name_ << "' (" << residency_policy_name(plan_.policy) << ", from measurements"
       << (calib_.recomputed() ? ", recomputed" : "") << "): " << plan_.residency_map() << "; ring "
       << format_mib(plan_.ring_bytes) << ", copy " << calib_.copy_fit()->gbps << " GB/s";
  for (const auto& p : plan_.predictions) {
    line << "; '" << p.kind << "' predicted " << p.step_ms << " ms (floor " << p.floor_ms << ", compute "
         << p.compute_ms << ", copy " << p.copy_ms << ")";
  }
  log::info(line.str());
}

uint64_t StreamingEngine::weight_budget_of(uint64_t budget) const {
  return budget > options_.working_memory_bytes ? budget - options_.working_memory_bytes : 0;
}

int64_t StreamingEngine::partial_load(uint64_t bytes) {
  TORCH_CHECK(attached_, "partial_load: no model attached");
  const uint64_t full = weight_budget_of(budget_bytes_);
  const uint64_t now = budget_->current();
  const uint64_t target = bytes >= full - std::min(full, now) ? full : now + bytes;
  return replan(std::max(weight_budget_, target), max_resident_);
}

int64_t StreamingEngine::partial_unload(uint64_t bytes) {
  TORCH_CHECK(attached_, "partial_unload: no model attached");
  const uint64_t now = budget_->current();
  const uint64_t min_weights = minimum_weight_budget(plan_input(0, max_resident_));
  const uint64_t target = now > bytes ? now - bytes : 0;
  return replan(std::max(target, min_weights), max_resident_);
}

int64_t StreamingEngine::full_load() {
  TORCH_CHECK(attached_, "full_load: no model attached");
  const uint64_t full = weight_budget_of(budget_bytes_);
  uint64_t all = extra_bytes_ + reserved_bytes();
  for (const auto& r : layers_) all += r.stored_bytes;
  if (all > full) {
    throw ResourceError("full_load: model '" + model_name_ + "' needs " + format_mib(all + options_.working_memory_bytes) +
                        " of budget to be fully resident, the budget is " + format_mib(budget_bytes_));
  }
  return replan(full, std::nullopt);
}

int64_t StreamingEngine::full_unload() {
  TORCH_CHECK(attached_, "full_unload: no model attached");
  return replan(minimum_weight_budget(plan_input(0, max_resident_)), max_resident_);
}

void StreamingEngine::set_budget(uint64_t budget_bytes, bool release_freed) {
  TORCH_CHECK(attached_, "set_budget: no model attached");
  if (budget_bytes <= options_.working_memory_bytes) {
    throw ResourceError("budget " + format_mib(budget_bytes) + " for model '" + model_name_ +
                        "' leaves nothing beside the working memory of " + format_mib(options_.working_memory_bytes));
  }
  const uint64_t old = budget_bytes_;
  budget_bytes_ = budget_bytes;
  try {
    replan(budget_bytes - options_.working_memory_bytes, max_resident_, release_freed && budget_bytes < old);
  } catch (...) {
    budget_bytes_ = old;
    throw;
  }
}

bool StreamingEngine::is_resident(const std::string& layer_name) const {
  for (const auto& r : layers_) {
    if (r.name == layer_name) return r.resident;
  }
  throw InvalidArgument("model '" + model_name_ + "' has no managed layer '" + layer_name + "'");
}

uint64_t StreamingEngine::minimum_budget() const {
  TORCH_CHECK(attached_, "minimum_budget: no model attached");
  return minimum_weight_budget(plan_input(0, max_resident_)) + options_.working_memory_bytes;
}

uint64_t StreamingEngine::device_bytes() const { return budget_ ? budget_->current() : 0; }

uint64_t StreamingEngine::device_allocated_bytes() const {
  return device_bytes() - (ring_ ? ring_->capacity() - std::min(ring_->capacity(), ring_->bytes()) : 0);
}

// ---------------------------------------------------------------------------------------
// forwards

void StreamingEngine::refresh_streamed() {
  std::vector<bool> streamed(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) streamed[i] = !layers_[i].resident;
  sched_.set_streamed(std::move(streamed));
}

void StreamingEngine::begin_forward(std::string_view kind) { open_forward(kind, false); }

void StreamingEngine::open_forward(std::string_view kind, bool implicit) {
  if (!attached_) throw InvalidArgument("begin_forward: no model attached");
  if (depth_ > 0) {
    if (!implicit_) {
      ++depth_;
      return;
    }
    end_forward(false);
  }
  depth_ = 1;
  implicit_ = implicit;
  ++epoch_;
  interrupt_ = nullptr;  // a request to stop the last forward that came after its last layer
  kind_name_ = std::string(kind);
  acc_cur_ = std::move(acc_next_);
  acc_next_ = ForwardAcc{};
  if (forwards_ > 0 && kind_name_ != last_kind_name_) {
    // Prefetches made for a forward of the other kind will not be read: free their slots
    // (counted as wasted) and do not count them as this forward's.
    if (ring_) ring_->drop_unread(epoch_);
    sched_.reset_frontier();
    acc_cur_ = ForwardAcc{};
  }
  sched_.begin(kind_name_, epoch_, implicit_);
  nested_seen_ = 0;
  released_ = 0;
  acc_cur_.detail = timing() && options_.plan_from_measurements && !implicit_ && calib_.begin(kind_name_);
  // A forward on another compute stream than the last one (a host running forwards on
  // streams of its own) reuses its scratch and reads what it left: it starts after it.
  const uint64_t stream = device_->compute_stream_id();
  if (last_end_ && stream != last_stream_) device_->wait(StreamKind::compute, *last_end_);  // FENCE(F6)
  last_stream_ = stream;
  for (auto& e : extras_) device_->begin_access(e.dev, StreamKind::compute, Access::read, "parameter read by a forward");
  // LoRA sidecars: every forward may read them (Note [device extras]).
  forward_sidecars_.clear();
  sidecars_.erase(std::remove_if(sidecars_.begin(), sidecars_.end(), [](const auto& w) { return w.expired(); }),
                  sidecars_.end());
  for (const auto& w : sidecars_) {
    auto impl = w.lock();
    if (!impl) continue;
    forward_sidecars_.emplace_back(std::move(impl));
    device_->begin_access(forward_sidecars_.back(), StreamKind::compute, Access::read, "LoRA sidecar read by a forward");
  }
  measuring_ = false;
  if (!measured_kinds_.count(kind_name_) && device_->allocator_stats().available) {
    // Note [measured working memory]: this forward's peak, from now.
    device_->reset_allocator_peak();
    const DeviceMemoryStats ledger = device_->memory_stats();
    measure_base_ = ledger.total.current;
    measure_base_peak_ = ledger.total.peak;
    measuring_ = true;
  }
  anchor_ = std::make_shared<Anchor>();
  anchor_->event = device_->create_event();
  device_->record(*anchor_->event, StreamKind::compute);
  anchor_->host_us = now_us();
  if (options_.trace && !trace_origin_) trace_origin_ = anchor_;
}

void StreamingEngine::end_forward(bool aborted) {
  if (depth_ == 0) return;
  if (depth_ > 1) {
    --depth_;
    return;
  }
  const bool explicit_forward = !implicit_;
  depth_ = 0;
  implicit_ = false;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerRecord& r = layers_[i];
    if (!leases_[i].empty()) {
      log::warn("end of forward: layer '" + r.name + "' of '" + model_name_ + "' still had " +
                std::to_string(leases_[i].size()) + " open lease(s); releasing them");
      while (!leases_[i].empty()) release(*r.layer);
    }
  }
  const PrefetchScheduler::Ended ended = sched_.end(aborted);

  ForwardRecord rec;
  rec.index = forwards_++;
  rec.kind = kind_name_;
  rec.bytes_streamed = acc_cur_.bytes;
  rec.copies = acc_cur_.copies;
  rec.demand_copies = acc_cur_.demand;
  rec.stalls = acc_cur_.stalls;  // host-query count without timing(); resolve() counts timed ones
  rec.stalls_timed = timing();
  rec.diverged = ended.diverged;
  rec.aborted = aborted;
  // Each streamed layer is copied exactly once per forward (Note [prefetch order]).
  uint64_t expected = rec.bytes_streamed;
  if (!aborted && !ended.diverged && !ended.overflow) {
    std::unordered_set<int64_t> seen;
    bool dup = false;
    expected = 0;
    for (int64_t id : ended.acquires) {
      if (!seen.insert(id).second) {
        dup = true;
      } else if (!layers_[static_cast<size_t>(id)].resident) {
        expected += layers_[static_cast<size_t>(id)].stored_bytes;
      }
    }
    if (dup) expected = rec.bytes_streamed;
  }
  rec.planned_bytes = expected;
  for (auto& e : extras_) {
    device_->end_access(e.dev, StreamKind::compute);
    device_->record_use(e.dev, StreamKind::compute);  // FENCE(F5)
  }
  for (const auto& t : forward_sidecars_) {
    device_->end_access(t, StreamKind::compute);
    device_->record_use(t, StreamKind::compute);  // FENCE(F10): a free on another stream waits for this forward
  }
  forward_sidecars_.clear();
  if (!last_end_) last_end_ = device_->create_event();
  device_->record(*last_end_, StreamKind::compute);
  Unresolved u;
  u.record = rec;
  u.spans = std::move(acc_cur_.spans);
  u.detail = acc_cur_.detail;
  u.complete = !aborted && !ended.diverged && !ended.overflow;
  u.ids = std::move(acc_cur_.ids);
  u.marks = std::move(acc_cur_.marks);
  u.stall_span = std::move(acc_cur_.stall_span);
  u.begin = anchor_;
  u.end = device_->create_event();
  device_->record(*u.end, StreamKind::compute);
  unresolved_.push_back(std::move(u));
  const bool measured = unresolved_.back().detail;
  acc_cur_ = ForwardAcc{};
  last_kind_name_ = kind_name_;
  if (ended.diverged && !aborted && ring_) {
    // The prefetches made for the next forward followed the old order: drop them (counted
    // as wasted) so the next forward runs on the new order with a clean ring.
    ring_->drop_unread(epoch_ + 1);
    acc_next_ = ForwardAcc{};
  }
  // A forward measured in detail is waited for (twice per attach, Note [calibration]), so
  // the plan from it is made before the next forward on every device.
  resolve(measured);
  if (nested_seen_ > nested_reserve_ && !aborted) reserve_nesting();
  nested_seen_ = 0;
  if (measuring_) measure_working_memory(aborted);
  if (!aborted && explicit_forward) {
    replan_if_measured();  // between forwards, before the next one's prefetches
    top_up(0, /*at_end=*/true);
  }
  if (rec.bytes_streamed != expected) {
    // A prefetch was dropped or a layer was copied twice (Note [prefetch order] in
    // engine.h): bytes on the bus, not a wrong result.
    ++mismatched_forwards_;
    if (!waste_warned_) {
      waste_warned_ = true;
      log::warn("model '" + model_name_ + "': forward " + std::to_string(rec.index) + " streamed " +
                format_mib(rec.bytes_streamed) + " where its streamed layers hold " + format_mib(expected) +
                " (a copy was repeated or dropped; counted in the stats as wasted prefetch, warned once)");
    }
  }
  check_invariants("end of forward");
}

void StreamingEngine::measure_working_memory(bool aborted) {
  measuring_ = false;
  if (aborted) return;  // measured again by the next forward of the kind
  measured_kinds_.insert(kind_name_);
  const DeviceBackend::AllocatorStats a = device_->allocator_stats();
  // The most the ledger held during the forward: its bytes at the start and the end, or
  // its peak where the forward raised it (overflow slots, nested scratch freed before the end).
  const DeviceMemoryStats now = device_->memory_stats();
  int64_t ledger = std::max(measure_base_, now.total.current);
  if (now.total.peak > measure_base_peak_) ledger = std::max(ledger, now.total.peak);
  const uint64_t used = a.peak_bytes > ledger ? static_cast<uint64_t>(a.peak_bytes - ledger) : 0;
  measured_any_ = true;
  measured_working_ = std::max(measured_working_, used);
  const uint64_t wm = options_.working_memory_bytes;
  if (!options_.grow_working_memory || used <= wm) return;
  const uint64_t min_weights = minimum_weight_budget(plan_input(0, max_resident_));
  uint64_t want = used + used / 8;
  const uint64_t most = budget_bytes_ > min_weights ? budget_bytes_ - min_weights : 0;
  const bool short_of_it = want > most;
  want = std::min(want, most);
  if (want <= wm) {
    log::warn("model '" + model_name_ + "': the first '" + kind_name_ + "' forward used " + format_mib(used) +
              " of device memory beyond the weights, more than the working memory of " + format_mib(wm) +
              ", and the budget of " + format_mib(budget_bytes_) + " has no room to reserve more");
    return;
  }
  options_.working_memory_bytes = want;
  try {
    replan(std::min(weight_budget_, budget_bytes_ - want), max_resident_);
  } catch (const std::exception& e) {
    options_.working_memory_bytes = wm;
    log::warn("model '" + model_name_ + "': growing the working memory to " + format_mib(want) +
              " after measuring " + format_mib(used) + " failed, keeping " + format_mib(wm) + ": " + e.what());
    return;
  }
  ++working_grown_;
  std::ostringstream line;
  line << "model '" << model_name_ << "': the first '" << kind_name_ << "' forward used " << format_mib(used)
       << " of device memory beyond the weights (allocator peak " << format_mib(static_cast<uint64_t>(a.peak_bytes))
       << ", sluice's ledger " << format_mib(static_cast<uint64_t>(ledger)) << "), more than the working memory of "
       << format_mib(wm) << ": working memory now " << format_mib(want)
       << (short_of_it ? " (all the budget leaves beside the minimum)" : " (measured plus a margin)")
       << ", replanned: " << plan_.residency_map();
  if (short_of_it) {
    log::warn(line.str());
  } else {
    log::info(line.str());
  }
}

void StreamingEngine::end_forward_noexcept(bool aborted) noexcept {
  try {
    end_forward(aborted);
  } catch (const c10::Error& e) {
    log::error(std::string("end of forward: ") + e.what_without_backtrace());
    deferred_error_ = e.what_without_backtrace();
  } catch (const std::exception& e) {
    log::error(std::string("end of forward: ") + e.what());
    deferred_error_ = e.what();
  }
}

void StreamingEngine::top_up(size_t pos, bool at_end) {
  if (!ring_) return;
  sched_.top_up(pos, at_end, [this](int64_t id, uint64_t epoch) { return offer(id, epoch); });
}

PrefetchScheduler::Offer StreamingEngine::offer(int64_t id, uint64_t epoch) {
  if (layers_[static_cast<size_t>(id)].resident || ring_->find(id, epoch) >= 0) return PrefetchScheduler::Offer::issued;
  try {
    return issue(id, epoch, /*demand=*/false) < 0 ? PrefetchScheduler::Offer::full : PrefetchScheduler::Offer::issued;
  } catch (const ResourceError&) {
    return PrefetchScheduler::Offer::full;  // the budget has no room for a slot now (nested leases hold it)
  } catch (const DeviceError& e) {
    // Only a prefetch: the layer is copied on demand when it is used (and that copy's
    // failure, if it fails too, fails that forward).
    log::warn("model '" + model_name_ + "': prefetching layer '" + layers_[static_cast<size_t>(id)].name +
              "' failed: " + e.what());
    return PrefetchScheduler::Offer::failed;
  }
}

int StreamingEngine::issue(int64_t id, uint64_t epoch, bool demand) {
  const LayerRecord& r = layers_[static_cast<size_t>(id)];
  int s = ring_->pick(r.slot_bytes, epoch_, /*keep_unconsumed=*/true);
  if (s < 0) {
    if (!demand) return -1;
    s = ring_->pick(r.slot_bytes, epoch_, /*keep_unconsumed=*/false);
    if (s < 0) {
      s = ring_->overflow(r.slot_bytes);  // more leases open at once than the ring holds: budget permitting
      nested_flag_ = true;
    }
  }
  std::vector<SlotPart> parts;
  parts.push_back({r.host_w, 0});
  if (r.host_b.defined()) parts.push_back({r.host_b, r.off_b});
  if (r.host_s.defined()) parts.push_back({r.host_s, r.off_s});
  std::unique_ptr<DeviceEvent> a, b;
  if (timing()) {
    a = take_event();
    b = take_event();
  }
  ring_->fill(s, id, epoch, parts, a.get(), b.get(), bounce_for(parts));
  ForwardAcc& acc = epoch == epoch_ ? acc_cur_ : acc_next_;
  acc.bytes += r.stored_bytes;
  acc.copies += 1;
  if (demand) acc.demand += 1;
  if (a) add_span(acc, TraceTrack::copy, 0, id, std::move(a), std::move(b));
  return s;
}

int StreamingEngine::take_scratch(uint64_t bytes) {
  for (size_t i = 0; i < scratch_.size(); ++i) {
    if (!scratch_[i].in_use && scratch_[i].buffer.nbytes() >= bytes) {
      scratch_[i].in_use = true;
      return static_cast<int>(i);
    }
  }
  // More leases open at once than planned for (one): another buffer, budget permitting;
  // later plans reserve it (Note [device extras]).
  nested_flag_ = true;
  scratch_.push_back({device_->allocate({static_cast<int64_t>(scratch_bytes_)}, at::kByte, MemoryKind::scratch,
                                        "upcast scratch for a nested lease", budget_),
                      true});
  return static_cast<int>(scratch_.size()) - 1;
}

BounceRing* StreamingEngine::bounce_for(const std::vector<SlotPart>& parts) {
  bool pageable = false;
  for (const auto& p : parts) pageable = pageable || !device_->is_pinned(p.host);
  if (!pageable) return nullptr;
  if (!bounce_) {
    bounce_ = std::make_unique<BounceRing>(*device_, options_.bounce_slots, options_.bounce_slot_bytes);
    bounce_->set_limit(bounce_limit());
    if (bounce_->pinned()) {
      log::info("model '" + model_name_ + "': streamed layers are in pageable memory; copying them through a " +
                format_mib(bounce_->bytes()) + " pinned bounce ring so copies still overlap compute");
    } else {
      log::warn("model '" + model_name_ + "': streamed layers are in pageable memory and the " +
                format_mib(options_.bounce_slot_bytes * options_.bounce_slots) +
                " bounce ring could not be pinned: copies are synchronous (no overlap with compute)");
    }
  }
  bounce_->set_limit(bounce_limit());  // the ring may have changed since
  return bounce_.get();
}

// Note [bounce ring sizing]: ceil(ring capacity / slot) + F + 2 * P slots, F the fills the
// ring holds unread at most, P the pieces of the largest streamed layer.
size_t StreamingEngine::bounce_limit() const {
  const uint64_t slot = options_.bounce_slot_bytes;
  uint64_t smallest = 0, largest = 0;
  for (const auto& r : layers_) {
    if (r.resident) continue;
    smallest = smallest ? std::min(smallest, r.slot_bytes) : r.slot_bytes;
    largest = std::max(largest, r.slot_bytes);
  }
  const uint64_t capacity = ring_ ? ring_->capacity() : plan_.ring_bytes;
  if (largest == 0) return options_.bounce_slots;
  const uint64_t fills = capacity / std::max<uint64_t>(smallest, 1);
  const uint64_t pieces = (capacity + slot - 1) / slot + fills + 2 * ((largest + slot - 1) / slot);
  return static_cast<size_t>(std::max<uint64_t>(pieces, options_.bounce_slots));
}

std::unique_ptr<DeviceEvent> StreamingEngine::take_event() {
  if (event_pool_.empty()) return device_->create_event();
  std::unique_ptr<DeviceEvent> e = std::move(event_pool_.back());
  event_pool_.pop_back();
  return e;
}

std::unique_ptr<DeviceEvent> StreamingEngine::mark() {
  std::unique_ptr<DeviceEvent> e = take_event();
  device_->record(*e, StreamKind::compute);
  return e;
}

void StreamingEngine::add_span(ForwardAcc& acc, TraceTrack track, int kind, int64_t layer,
                               std::unique_ptr<DeviceEvent> a, std::unique_ptr<DeviceEvent> b) {
  const bool resident = layers_[static_cast<size_t>(layer)].resident;
  acc.spans.push_back(Span{track, kind, layer, resident, std::move(a), std::move(b), anchor_});
}

LayerWeights StreamingEngine::acquire(ManagedLayerImpl& layer) {
  if (!deferred_error_.empty()) {
    std::string msg = std::move(deferred_error_);
    deferred_error_.clear();
    TORCH_INTERNAL_ASSERT(false, "streaming engine: an earlier forward ended with an error: ", msg);
  }
  // A layer callback asked to stop (set_layer_progress): this forward ends here, before the
  // layer, as from any error.
  if (interrupt_ && depth_ > 0) std::rethrow_exception(take_interrupt());
  const auto it = index_.find(&layer);
  TORCH_CHECK(attached_ && it != index_.end(), "acquire: layer '", layer.qualified_name(),
              "' is not attached to this engine");
  const int64_t id = it->second;
  LayerRecord& r = layers_[static_cast<size_t>(id)];
  if (depth_ == 0) {
    open_forward(kind_name_, /*implicit=*/true);
  }
  const size_t pos = sched_.acquired(id);
  last_pos_ = pos;
  if (acc_cur_.detail) {
    acc_cur_.ids.push_back(id);
    acc_cur_.marks.push_back(mark());
    acc_cur_.stall_span.push_back(-1);
  }
  Lease lease;
  at::Tensor w, b, s;
  if (r.resident) {
    top_up(pos, false);
    w = r.dev_w;
    b = r.dev_b;
    s = r.dev_s;
    lease.reads = {w, b, s};
  } else {
    if (!ring_) {
      try {
        ensure_ring();  // a residency change that failed could not make one
      } catch (const ResourceError& e) {
        throw ResourceError("model '" + model_name_ + "' has no staging ring to stream '" + r.name + "': " + e.what());
      }
    }
    int slot = ring_->find(id, epoch_);
    if (slot < 0) {
      try {
        slot = issue(id, epoch_, /*demand=*/true);
      } catch (const DeviceError& e) {
        throw DeviceError("model '" + model_name_ + "': streaming layer '" + r.name + "' failed: " + e.what());
      }
    }
    top_up(pos, false);
    StagingSlot& st = ring_->slot(static_cast<size_t>(slot));
    try {
      if (timing()) {
        // Timed on the compute stream: resolve() counts it as a stall when the wait took
        // time on the device. A host query here would see copies the device has long
        // finished by the time compute gets there as stalls.
        std::unique_ptr<DeviceEvent> a = mark();
        device_->wait(StreamKind::compute, *st.copy_done);  // FENCE(F1): the slot's copy is done
        add_span(acc_cur_, TraceTrack::compute, 1, id, std::move(a), mark());
        if (acc_cur_.detail) acc_cur_.stall_span.back() = static_cast<int>(acc_cur_.spans.size()) - 1;
      } else {
        if (!st.copy_done->query()) acc_cur_.stalls += 1;
        device_->wait(StreamKind::compute, *st.copy_done);  // FENCE(F1)
      }
    } catch (const DeviceError& e) {
      // The slot's bytes are not the layer's: forget them, so nothing reads them.
      st.layer = -1;
      st.consumed = true;
      throw DeviceError("model '" + model_name_ + "': streaming layer '" + r.name + "' failed: " + e.what());
    }
    ring_->begin_use(slot);
    st.consumed = true;
    lease.slot = slot;
    lease.reads[0] = st.buffer;
    w = ring_->view(slot, 0, r.stored_dtype, r.host_w.sizes());
    if (r.host_b.defined()) b = ring_->view(slot, r.off_b, r.host_b.scalar_type(), r.host_b.sizes());
    if (r.host_s.defined()) s = ring_->view(slot, r.off_s, r.host_s.scalar_type(), r.host_s.sizes());
  }
  for (const auto& t : lease.reads) device_->begin_access(t, StreamKind::compute, Access::read, r.name);
  try {
    LayerWeights out;
    out.weight = w;
    out.bias = b;
    if (r.upcast_w || r.upcast_b) {
      lease.scratch = take_scratch(r.scratch_bytes);
      const at::Tensor& buf = scratch_[static_cast<size_t>(lease.scratch)].buffer;
      lease.written = buf;
      device_->begin_access(buf, StreamKind::compute, Access::write, "upcast of '" + r.name + "'");
      std::unique_ptr<DeviceEvent> a = timing() ? mark() : nullptr;
      if (r.upcast_w) {
        out.weight = typed_view(buf, 0, r.compute, w.sizes());
        sluice::upcast_into(w, s, out.weight);
      }
      if (r.upcast_b) {
        out.bias = typed_view(buf, r.scratch_off_b, r.compute, b.sizes());
        sluice::upcast_into(b, at::Tensor(), out.bias);
      }
      if (a) add_span(acc_cur_, TraceTrack::upcast, 2, id, std::move(a), mark());
    }
    if (options_.trace) lease.start = mark();
    leases_[static_cast<size_t>(id)].push_back(std::move(lease));
    if (nested_flag_) note_nesting();
    return out;
  } catch (...) {
    end_lease(lease);
    throw;
  }
}

void StreamingEngine::reserve_nesting() {
  const uint64_t before = nested_reserve_;
  nested_reserve_ = nested_seen_;
  std::string outcome;
  try {
    replan(weight_budget_, max_resident_);
    outcome = "every plan reserves that room from now on (" + plan_.residency_map() + ")";
  } catch (const ResourceError& e) {
    nested_reserve_ = before;  // the plan did not change
    outcome = std::string("the budget has no room to reserve it (") + e.what() +
              "): such forwards allocate it while the budget has room, and fail when it has none";
  }
  if (!nested_warned_) {
    nested_warned_ = true;
    log::warn("model '" + model_name_ + "': a forward held " + format_mib(nested_seen_) +
              " of upcast scratch and staging slots beyond its plan (leases open at once); " + outcome);
  }
}

// ---------------------------------------------------------------------------------------
// device extras (Note [device extras])

std::vector<at::Tensor> StreamingEngine::place_sidecars(const std::vector<at::Tensor>& host,
                                                        const std::vector<at::ScalarType>& dtypes,
                                                        const std::string& what) {
  return place_sidecars(host, dtypes, what, 0);
}

std::vector<at::Tensor> StreamingEngine::place_sidecars(const std::vector<at::Tensor>& host,
                                                        const std::vector<at::ScalarType>& dtypes,
                                                        const std::string& what, uint64_t grow_budget) {
  if (!attached_) throw InvalidArgument(what + ": no model is attached to place sidecars for");
  TORCH_CHECK(host.size() == dtypes.size(), "place_sidecars: ", host.size(), " tensors, ", dtypes.size(), " dtypes");
  require_idle("placing sidecars");
  uint64_t bytes = 0;
  for (size_t i = 0; i < host.size(); ++i) bytes += static_cast<uint64_t>(host[i].numel()) * c10::elementSize(dtypes[i]);
  const uint64_t minimum = minimum_weight_budget(plan_input(0, max_resident_));
  const uint64_t old_weight_budget = weight_budget_, old_budget = budget_bytes_;
  const uint64_t weight_budget = weight_budget_ + grow_budget;
  const uint64_t room = weight_budget - std::min(weight_budget, minimum);
  if (bytes > room) {
    std::ostringstream msg;
    msg << what << " needs " << format_mib(bytes) << " of device memory (" << bytes << " bytes) for its sidecars, but "
        << "model '" << model_name_ << "' has " << format_mib(room) << " beside its minimum of "
        << format_mib(minimum + options_.working_memory_bytes) << " under its budget of "
        << format_mib(budget_bytes_ + grow_budget) << " even with every streamable layer streamed: "
        << format_mib(bytes - room) << " missing";
    throw ResourceError(msg.str());
  }
  lora_bytes_ += bytes;
  budget_bytes_ += grow_budget;
  std::vector<at::Tensor> out;
  try {
    replan(weight_budget, max_resident_);  // streams more layers if the sidecars need their room
    out.reserve(host.size());
    for (size_t i = 0; i < host.size(); ++i) {
      at::Tensor d = device_->allocate(host[i].sizes(), dtypes[i], MemoryKind::lora, what, budget_);
      device_->copy_to_device(d, host[i].to(at::kCPU, dtypes[i]).contiguous());
      device_->record_use(d, StreamKind::copy);  // freed later without waiting for anything else
      out.push_back(std::move(d));
    }
    // FENCE(F9): the copies are done before a forward reads them (and a failed one throws here)
    device_->synchronize();  // FENCE(F9)
    for (const auto& d : out) sidecars_.emplace_back(d.getIntrusivePtr());
  } catch (...) {
    out.clear();
    lora_bytes_ -= bytes;
    budget_bytes_ = old_budget;
    try {
      replan(old_weight_budget, max_resident_);
    } catch (const std::exception& e) {
      log::warn("model '" + model_name_ + "': growing residency back after failed sidecars: " + e.what());
    }
    throw;
  }
  return out;
}

void StreamingEngine::sidecars_released(uint64_t bytes) noexcept { sidecars_released(bytes, 0); }

uint64_t StreamingEngine::sidecars_released(uint64_t bytes, uint64_t shrink_budget) noexcept {
  lora_bytes_ -= std::min(lora_bytes_, bytes);
  if (!attached_) return 0;
  shrink_budget = std::min(shrink_budget, weight_budget_);
  std::string error;
  if (shrink_budget > 0) {
    try {
      // The room goes back to resident layers, less what the budget gives back.
      replan(weight_budget_ - shrink_budget, max_resident_, /*release_freed=*/false);
      budget_bytes_ -= std::min(budget_bytes_, shrink_budget);
      return shrink_budget;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  try {
    replan(weight_budget_, max_resident_);  // the room goes back to resident layers
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) {
    log::warn("model '" + model_name_ + "': residency stays as it is after sidecars were dropped: " + error);
  }
  return 0;
}

void StreamingEngine::note_nesting() {
  nested_flag_ = false;
  uint64_t beyond = ring_ ? ring_->overflow_bytes() : 0;
  for (size_t i = 1; i < scratch_.size(); ++i) beyond += scratch_[i].buffer.nbytes();
  nested_seen_ = std::max(nested_seen_, beyond);
}

void StreamingEngine::release(ManagedLayerImpl& layer) noexcept {
  const auto it = index_.find(&layer);
  if (it == index_.end()) {
    log::error("release: layer '" + layer.qualified_name() + "' is not attached to this engine");
    return;
  }
  const int64_t id = it->second;
  LayerRecord& r = layers_[static_cast<size_t>(id)];
  std::vector<Lease>& leases = leases_[static_cast<size_t>(id)];
  if (leases.empty()) {
    log::error("release: layer '" + r.name + "' has no open lease");
    return;
  }
  Lease lease = std::move(leases.back());
  leases.pop_back();
  if (lease.start) {
    try {
      add_span(acc_cur_, TraceTrack::compute, 3, id, std::move(lease.start), mark());
    } catch (...) {
    }
  }
  const bool freed_slot = lease.slot >= 0;
  end_lease(lease);
  if (layer_progress_ && depth_ > 0) {
    try {
      layer_progress_(++released_, static_cast<int64_t>(sched_.order(kind_name_).size()));
    } catch (const Interrupted&) {
      interrupt_ = std::current_exception();  // thrown by the next acquire()
      layer_progress_ = nullptr;
    } catch (const std::exception& e) {
      log::warn("model '" + model_name_ + "': the layer progress callback threw (" + e.what() + "); it is turned off");
      layer_progress_ = nullptr;
    } catch (...) {
      log::warn("model '" + model_name_ + "': the layer progress callback threw; it is turned off");
      layer_progress_ = nullptr;
    }
  }
  if (freed_slot && depth_ > 0) {
    // The slot is free now: the next copy need not wait for the next acquire (work
    // between layers, such as attention, would otherwise leave the copy stream idle).
    try {
      top_up(last_pos_, false);
    } catch (const std::exception& e) {
      log::warn(std::string("release: prefetching failed: ") + e.what());
    }
  }
}

void StreamingEngine::end_lease(Lease& lease) noexcept {
  try {
    for (const at::Tensor* t : {&lease.reads[0], &lease.reads[1], &lease.reads[2], &lease.written}) {
      if (!t->defined()) continue;
      device_->end_access(*t, StreamKind::compute);
      device_->record_use(*t, StreamKind::compute);  // FENCE(F5): a free on another stream waits for this forward
    }
  } catch (const std::exception& e) {
    log::error(std::string("release: recording a stream use failed: ") + e.what());
  }
  if (lease.scratch >= 0) scratch_[static_cast<size_t>(lease.scratch)].in_use = false;
  if (lease.slot >= 0 && ring_) ring_->end_use(lease.slot);
}

// ---------------------------------------------------------------------------------------
// invariants, stats, trace

void StreamingEngine::check_invariants(const char* where) {
  const uint64_t full = weight_budget_of(budget_bytes_);
  const DeviceMemoryStats mem = budget_->stats();
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(mem.total.peak) <= full, where, ": device peak ", mem.total.peak,
                        " bytes over the budget minus working memory ", full);
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(mem.total.current) <= weight_budget_, where, ": device use ",
                        mem.total.current, " over the current limit ", weight_budget_);
  for (const auto& r : layers_) {
    const at::Tensor& w = r.layer->stored_weight();
    TORCH_INTERNAL_ASSERT(w.scalar_type() == r.stored_dtype, where, ": stored dtype of '", r.name, "' changed to ",
                          w.scalar_type());
    const at::Tensor& expected = r.resident ? r.dev_w : r.host_w;
    TORCH_INTERNAL_ASSERT(w.data_ptr() == expected.data_ptr(), where, ": stored weight of '", r.name,
                          "' is not where the plan puts it");
  }
  if (ring_) {
    TORCH_INTERNAL_ASSERT(ring_->violations() == 0, where, ": a staging slot was overwritten while in use");
  }
}

void StreamingEngine::resolve(bool wait_all) {
  while (!unresolved_.empty()) {
    Unresolved& u = unresolved_.front();
    if (!wait_all && unresolved_.size() == 1 && !u.end->query()) break;
    u.end->synchronize();
    ForwardRecord& rec = u.record;
    double copy_ms = 0;
    std::vector<double> span_ms;
    span_ms.reserve(u.spans.size());
    std::vector<std::pair<uint64_t, double>> copies;
    for (auto& sp : u.spans) {
      sp.a->synchronize();
      sp.b->synchronize();
      const double ms = device_->elapsed_ms(*sp.a, *sp.b);
      span_ms.push_back(ms);
      switch (sp.kind) {
        case 0:
          copy_ms += ms;
          copies.emplace_back(layers_[static_cast<size_t>(sp.layer)].stored_bytes, ms);
          break;
        case 1:
          rec.stall_ms += ms;
          if (ms >= kStallMs) rec.stalls += 1;
          break;
        case 2: rec.upcast_ms += ms; break;
        default: break;
      }
      if (options_.trace && !(sp.kind == 1 && ms < kStallMs)) {
        const double ts = trace_us(*sp.a);
        const std::string& name = layers_[static_cast<size_t>(sp.layer)].name;
        trace_.add_span(sp.track, sp.kind == 1 ? "wait " + name : name, ts, ms * 1000.0,
                        {{"forward", static_cast<int64_t>(rec.index)}, {"layer", name}, {"resident", sp.resident}});
      }
      event_pool_.push_back(std::move(sp.a));  // done: reusable
      event_pool_.push_back(std::move(sp.b));
    }
    rec.wall_ms = device_->elapsed_ms(*u.begin->event, *u.end);
    rec.h2d_gbps = copy_ms > 0 ? static_cast<double>(rec.bytes_streamed) / (copy_ms * 1e6) : 0.0;
    if (options_.trace) {
      // The forward as a whole, begin to end on the compute stream, with its totals.
      const std::string title = "forward " + std::to_string(rec.index) + (rec.kind.empty() ? "" : " " + rec.kind);
      trace_.add_span(TraceTrack::forward, title, trace_us(*u.begin->event), rec.wall_ms * 1000.0,
                      {{"forward", static_cast<int64_t>(rec.index)},
                       {"kind", rec.kind},
                       {"complete", u.complete},
                       {"wall_ms", rec.wall_ms},
                       {"bytes_streamed", static_cast<int64_t>(rec.bytes_streamed)},
                       {"stall_ms", rec.stall_ms},
                       {"upcast_ms", rec.upcast_ms},
                       {"stalls", static_cast<int64_t>(rec.stalls)},
                       {"copies", static_cast<int64_t>(rec.copies)}});
    }
    if (timing() && options_.plan_from_measurements) {
      ForwardSample sample;
      if (u.detail && u.complete) {
        sample.kind = rec.kind;
        sample.order = u.ids;
        sample.wall_ms = rec.wall_ms;
        sample.copies = std::move(copies);
        for (size_t i = 0; i < u.marks.size(); ++i) {
          u.marks[i]->synchronize();
          sample.acquire_ms.push_back(device_->elapsed_ms(*u.begin->event, *u.marks[i]));
          const int k = u.stall_span[i];
          sample.stall_ms.push_back(k >= 0 ? span_ms[static_cast<size_t>(k)] : 0.0);
          event_pool_.push_back(std::move(u.marks[i]));
        }
      }
      if (!u.detail && u.complete) calib_.copies(copies);
      calib_.forward(rec.kind, u.detail, rec.wall_ms, u.complete ? &sample : nullptr);
    }
    if (log::enabled(log::Level::debug)) {
      std::ostringstream line;
      line.setf(std::ios::fixed);
      line.precision(2);
      line << "Forward " << rec.index << " of '" << model_name_ << "': streamed " << format_mib(rec.bytes_streamed)
           << " in " << rec.copies << " copies (" << rec.demand_copies << " on demand) at " << rec.h2d_gbps
           << " GB/s, " << rec.stalls << " stalls " << rec.stall_ms << " ms, upcast " << rec.upcast_ms
           << " ms, wall " << rec.wall_ms << " ms" << (rec.diverged ? ", diverged" : "")
           << (rec.aborted ? ", aborted" : "");
      log::debug(line.str());
    }
    records_.push_back(rec);
    while (records_.size() > options_.max_forward_records) records_.pop_front();
    unresolved_.pop_front();
  }
  if (event_pool_.size() > 4096) event_pool_.resize(4096);
}

void set_allocator_stats(EngineStats& stats, const DeviceBackend& device) {
  const DeviceBackend::AllocatorStats a = device.allocator_stats();
  stats.allocator_stats_available = a.available;
  stats.allocator_current_bytes = a.current_bytes;
  stats.allocator_peak_bytes = a.peak_bytes;
  stats.allocator_reserved_bytes = a.reserved_bytes;
}

EngineStats StreamingEngine::stats(bool wait) {
  resolve(wait);
  EngineStats s;
  s.model_name = model_name_;
  s.device = device_->name();
  s.budget_bytes = budget_bytes_;
  s.working_memory_bytes = options_.working_memory_bytes;
  s.measured_working_memory = measured_any_;
  s.measured_working_memory_bytes = measured_working_;
  s.working_memory_grown = working_grown_;
  s.model_total_bytes = extra_bytes_;
  for (const auto& r : layers_) {
    s.model_total_bytes += r.stored_bytes;
    s.layers += 1;
    (r.resident ? s.resident_layers : s.streamed_layers) += 1;
  }
  s.model_resident_bytes = plan_.resident_bytes;
  s.residency = plan_.residency_map();
  s.residency_grid = plan_.residency_grid();
  s.ring_slots = ring_ ? ring_->live_slots() : 0;
  s.slot_bytes = plan_.slot_bytes;
  s.ring_capacity_bytes = ring_ ? ring_->capacity() : 0;
  s.ring_slot_bytes = ring_ ? ring_->bytes() : 0;
  s.wasted_prefetch_copies = wasted_copies_ + (ring_ ? ring_->wasted_copies() : 0);
  s.wasted_prefetch_bytes = wasted_bytes_ + (ring_ ? ring_->wasted_bytes() : 0);
  s.mismatched_forwards = mismatched_forwards_;
  s.plan.policy = residency_policy_name(plan_.policy);
  s.plan.from_measurements = !plan_.predictions.empty();
  s.plan.copy_gbps = calib_.copy_fit() ? calib_.copy_fit()->gbps : 0.0;
  s.plan.ring_bytes = plan_.ring_bytes;
  s.plan.measured_plans = calib_.measured_plans();
  s.plan.recomputed = calib_.recomputed();
  s.plan.step_kind = calib_.main_kind();
  for (const auto& p : plan_.predictions) {
    PlanKindStats k;
    k.kind = p.kind;
    k.predicted_step_ms = p.step_ms;
    k.floor_ms = p.floor_ms;
    k.compute_ms = p.compute_ms;
    k.copy_ms = p.copy_ms;
    k.measured_step_ms = calib_.measured_step_ms(p.kind);
    k.measured_forwards = calib_.measured_forwards(p.kind);
    s.plan.kinds.push_back(std::move(k));
  }
  if (budget_) s.device_memory = budget_->stats();
  s.pinned = applier_->pinned();
  s.pinned_bytes = applier_->pinned_bytes();
  s.pin_limit_bytes = applier_->arena().limit();
  s.residency_h2d = applier_->residency_h2d();
  s.forwards = forwards_;
  s.slot_violations = ring_violations_ + (ring_ ? ring_->violations() : 0);
  if (bounce_) {
    s.bounce_bytes = bounce_->bytes();
    s.bounce_copies = bounce_->copies();
    s.sync_copies = bounce_->sync_copies();
    s.bounce_waits = bounce_->waits();
    s.bounce_limit_bytes = bounce_->limit() * bounce_->slot_bytes();
  }
  s.forward_records.assign(records_.begin(), records_.end());
  s.nonfinite_reruns = nonfinite_reruns_;
  s.nonfinite = nonfinite_;
  set_allocator_stats(s, *device_);
  return s;
}

TraceWriter& StreamingEngine::trace() {
  resolve(true);
  return trace_;
}

ForwardScope::ForwardScope(StreamingEngine& engine, std::string_view kind)
    : engine_(engine), uncaught_(std::uncaught_exceptions()) {
  engine_.begin_forward(kind);
}

ForwardScope::~ForwardScope() { engine_.end_forward_noexcept(std::uncaught_exceptions() > uncaught_); }

}  // namespace sluice::offload
