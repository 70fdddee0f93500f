#include "offload/engine/forward_pass.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

namespace {

at::Tensor typed_view(const at::Tensor& bytes, uint64_t offset, at::ScalarType dtype, at::IntArrayRef sizes) {
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const int64_t n = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return bytes.narrow(0, static_cast<int64_t>(offset), n).view(dtype).view(sizes);
}

}  // namespace

ForwardPass::ForwardPass(ModelResidency& residency, ModelBudget& budget, ForwardRecorder& recorder)
    : residency_(residency),
      budget_(budget),
      recorder_(recorder),
      device_(residency.device()),
      options_(residency.options()),
      sched_(residency.options().prefetch_depth) {}

void ForwardPass::streamed_changed() {
  const auto& layers = residency_.records().layers();
  std::vector<bool> streamed(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) streamed[i] = !layers[i].resident;
  sched_.set_streamed(std::move(streamed));
}

void ForwardPass::clear() noexcept {
  leases_.clear();
  sidecars_.clear();
  measured_kinds_.clear();  // the next model's forwards are measured afresh
  measuring_ = false;
  nested_seen_ = 0;
  nested_flag_ = false;
  sched_.clear();
  recorder_.clear();
  bounce_.reset();
  last_end_.reset();
  last_stream_ = 0;
  depth_ = 0;
  implicit_ = false;
}

void ForwardPass::require_idle(const char* what) const {
  const auto& layers = residency_.records().layers();
  for (size_t i = 0; i < leases_.size(); ++i) {
    if (!leases_[i].empty()) {
      throw InvalidArgument(std::string(what) + ": layer '" + layers[i].name + "' of model '" +
                            residency_.model_name() + "' is in use by a running forward");
    }
  }
  if (depth_ > 0 && !implicit_) {
    throw InvalidArgument(std::string(what) + ": called during a forward of model '" + residency_.model_name() + "'");
  }
}

// ---------------------------------------------------------------------------------------
// open and end

bool ForwardPass::nest() {
  if (depth_ == 0 || implicit_) return false;
  ++depth_;
  return true;
}

void ForwardPass::open(std::string_view kind, bool implicit) {
  depth_ = 1;
  implicit_ = implicit;
  ++epoch_;
  interrupt_ = nullptr;  // a request to stop the last forward that came after its last layer
  kind_ = std::string(kind);
  const bool fresh = forwards_ > 0 && kind_ != last_kind_;
  if (fresh) {
    // Prefetches made for a forward of the other kind will not be read: free their slots
    // (counted as wasted) and do not count them as this forward's.
    if (StagingRing* ring = residency_.buffers().ring()) ring->drop_unread(epoch_);
    sched_.reset_frontier();
  }
  sched_.begin(kind_, epoch_, implicit_);
  nested_seen_ = 0;
  released_ = 0;
  recorder_.open(fresh, options_.timed() && options_.plan_from_measurements && !implicit_ &&
                            residency_.calibrator().begin(kind_));
  // A forward on another compute stream than the last one reuses its scratch and reads
  // what it left: it starts after it (Note [forward kinds and wasted copies]).
  const uint64_t stream = device_.compute_stream_id();
  if (last_end_ && stream != last_stream_) device_.wait(StreamKind::compute, *last_end_);  // FENCE(F6)
  last_stream_ = stream;
  for (auto& e : residency_.records().extras()) {
    device_.begin_access(e.dev, StreamKind::compute, Access::read, "parameter read by a forward");
  }
  // LoRA sidecars: every forward may read them (Note [device extras]).
  sidecars_ = budget_.live_sidecars();
  for (const auto& t : sidecars_) device_.begin_access(t, StreamKind::compute, Access::read, "LoRA sidecar read by a forward");
  measuring_ = false;
  if (!measured_kinds_.count(kind_) && device_.allocator_stats().available) {
    // Note [measured working memory]: this forward's peak, from now.
    device_.reset_allocator_peak();
    const DeviceMemoryStats ledger = device_.memory_stats();
    measure_base_ = ledger.total.current;
    measure_base_peak_ = ledger.total.peak;
    measuring_ = true;
  }
  recorder_.anchor();
}

ForwardPass::Ended ForwardPass::end(bool aborted) {
  Ended out;
  if (depth_ == 0) return out;
  if (depth_ > 1) {
    --depth_;
    return out;
  }
  out.closed = true;
  out.aborted = aborted;
  out.explicit_forward = !implicit_;
  depth_ = 0;
  implicit_ = false;
  const auto& layers = residency_.records().layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!leases_[i].empty()) {
      log::warn("end of forward: layer '" + layers[i].name + "' of '" + residency_.model_name() + "' still had " +
                std::to_string(leases_[i].size()) + " open lease(s); releasing them");
      while (!leases_[i].empty()) release(*layers[i].layer);
    }
  }
  const PrefetchScheduler::Ended ended = sched_.end(aborted);
  const ForwardAcc& acc = recorder_.current();
  ForwardRecord rec;
  rec.index = forwards_++;
  rec.kind = kind_;
  rec.bytes_streamed = acc.bytes;
  const uint64_t loaded = static_cast<uint64_t>(residency_.applier().residency_h2d().allocated);
  rec.bytes_loaded = loaded - std::min(loaded, loaded_before_);
  loaded_before_ = loaded;
  rec.copies = acc.copies;
  rec.demand_copies = acc.demand;
  rec.stalls = acc.stalls;  // host-query count without timing; resolve() counts timed ones
  rec.stalls_timed = options_.timed();
  rec.diverged = ended.diverged;
  rec.aborted = aborted;
  // Each call of a streamed layer is copied exactly once per forward (Note [prefetch order],
  // Note [repeated calls]).
  uint64_t expected = rec.bytes_streamed;
  if (!aborted && !ended.diverged && !ended.overflow) {
    expected = 0;
    for (int64_t id : ended.acquires) {
      if (!layers[static_cast<size_t>(id)].resident) expected += layers[static_cast<size_t>(id)].stored_bytes;
    }
  }
  rec.planned_bytes = expected;
  for (auto& e : residency_.records().extras()) {
    device_.end_access(e.dev, StreamKind::compute);
    device_.record_use(e.dev, StreamKind::compute);  // FENCE(F5)
  }
  for (const auto& t : sidecars_) {
    device_.end_access(t, StreamKind::compute);
    device_.record_use(t, StreamKind::compute);  // FENCE(F10): a free on another stream waits for this forward
  }
  sidecars_.clear();
  if (!last_end_) last_end_ = device_.create_event();
  device_.record(*last_end_, StreamKind::compute);
  const bool measured = recorder_.close(rec, !aborted && !ended.diverged && !ended.overflow);
  last_kind_ = kind_;
  if (ended.diverged && !aborted) {
    // Said once per model at INFO (each forward record says it too: "diverged"): a host
    // whose layers run in another order each call (a conditional branch) copies on demand.
    if (!diverge_logged_) {
      diverge_logged_ = true;
      log::info("model '" + residency_.model_name() + "': forward " + std::to_string(rec.index) + " ('" + kind_ +
                "') called its layers in another order than the one recorded (" + std::to_string(rec.demand_copies) +
                " copies on demand); its order is recorded for the next one (said once; each forward's stats "
                "record says 'diverged')");
    }
    // The prefetches made for the next forward followed the old order: drop them (counted
    // as wasted) so the next forward runs on the new order with a clean ring.
    if (StagingRing* ring = residency_.buffers().ring()) {
      ring->drop_unread(epoch_ + 1);
      recorder_.next() = ForwardAcc{};
    }
  }
  // A forward measured in detail is waited for (twice per attach, Note [calibration]), so
  // the plan from it is made before the next forward on every device.
  recorder_.resolve(measured);
  out.nested_seen = nested_seen_;
  nested_seen_ = 0;
  if (rec.bytes_streamed != expected) warn_mismatch(rec, expected);
  return out;
}

void ForwardPass::warn_mismatch(const ForwardRecord& rec, uint64_t expected) {
  // A prefetch was dropped or a layer was copied twice (Note [forward kinds and wasted
  // copies]): bytes on the bus, not a wrong result.
  ++mismatched_;
  if (waste_warned_) return;
  waste_warned_ = true;
  log::warn("model '" + residency_.model_name() + "': forward " + std::to_string(rec.index) + " streamed " +
            format_mib(rec.bytes_streamed) + " where its streamed layers hold " + format_mib(expected) +
            " (a copy was repeated or dropped; counted in the stats as wasted prefetch, warned once)");
}

std::optional<WorkingMeasure> ForwardPass::take_working_measure(bool aborted) {
  if (!measuring_) return std::nullopt;
  measuring_ = false;
  if (aborted) return std::nullopt;  // measured again by the next forward of the kind
  measured_kinds_.insert(last_kind_);
  WorkingMeasure m;
  const DeviceBackend::AllocatorStats a = device_.allocator_stats();
  // The most the ledger held during the forward: its bytes at the start and the end, or
  // its peak where the forward raised it (overflow slots, nested scratch freed before the end).
  const DeviceMemoryStats now = device_.memory_stats();
  int64_t ledger = std::max(measure_base_, now.total.current);
  if (now.total.peak > measure_base_peak_) ledger = std::max(ledger, now.total.peak);
  m.used = a.peak_bytes > ledger ? static_cast<uint64_t>(a.peak_bytes - ledger) : 0;
  m.allocator_peak = a.peak_bytes;
  m.ledger = ledger;
  return m;
}

void ForwardPass::top_up_for_next() { top_up(0, /*at_end=*/true); }

// ---------------------------------------------------------------------------------------
// copies

void ForwardPass::top_up(size_t pos, bool at_end) {
  if (!residency_.buffers().ring()) return;
  sched_.top_up(pos, at_end,
                [this](int64_t id, uint64_t epoch, uint32_t occurrence) { return offer(id, epoch, occurrence); });
}

PrefetchScheduler::Offer ForwardPass::offer(int64_t id, uint64_t epoch, uint32_t occurrence) {
  const LayerRecord& r = residency_.records().at(id);
  if (r.resident || residency_.buffers().ring()->find(id, epoch, occurrence) >= 0) {
    return PrefetchScheduler::Offer::issued;
  }
  try {
    return issue(id, epoch, occurrence, /*demand=*/false) < 0 ? PrefetchScheduler::Offer::full : PrefetchScheduler::Offer::issued;
  } catch (const ResourceError&) {
    return PrefetchScheduler::Offer::full;  // the budget has no room for a slot now (nested leases hold it)
  } catch (const DeviceError& e) {
    // Only a prefetch: the layer is copied on demand when it is used (and that copy's
    // failure, if it fails too, fails that forward).
    log::warn("model '" + residency_.model_name() + "': prefetching layer '" + r.name + "' failed: " + e.what());
    return PrefetchScheduler::Offer::failed;
  }
}

int ForwardPass::issue(int64_t id, uint64_t epoch, uint32_t occurrence, bool demand) {
  const LayerRecord& r = residency_.records().at(id);
  StagingRing& ring = *residency_.buffers().ring();
  int s = ring.pick(r.slot_bytes, epoch_, /*keep_unconsumed=*/true);
  if (s < 0) {
    if (!demand) return -1;
    s = ring.pick(r.slot_bytes, epoch_, /*keep_unconsumed=*/false);
    if (s < 0) {
      s = ring.overflow(r.slot_bytes);  // more leases open at once than the ring holds: budget permitting
      nested_flag_ = true;
    }
  }
  std::vector<SlotPart> parts;
  parts.push_back({r.host_w, 0});
  if (r.host_b.defined()) parts.push_back({r.host_b, r.off_b});
  if (r.host_s.defined()) parts.push_back({r.host_s, r.off_s});
  std::unique_ptr<DeviceEvent> a, b;
  if (options_.timed()) {
    a = recorder_.take_event();
    b = recorder_.take_event();
  }
  ring.fill(s, id, epoch, parts, a.get(), b.get(), bounce_for(parts));
  ring.slot(static_cast<size_t>(s)).occurrence = occurrence;  // Note [repeated calls]
  ForwardAcc& acc = epoch == epoch_ ? recorder_.current() : recorder_.next();
  acc.bytes += r.stored_bytes;
  acc.copies += 1;
  if (demand) acc.demand += 1;
  if (a) recorder_.add_span(acc, TraceTrack::copy, SpanKind::copy, id, std::move(a), std::move(b));
  return s;
}

BounceRing* ForwardPass::bounce_for(const std::vector<SlotPart>& parts) {
  bool pageable = false;
  for (const auto& p : parts) pageable = pageable || !device_.is_pinned(p.host);
  if (!pageable) return nullptr;
  if (!bounce_) {
    bounce_ = std::make_unique<BounceRing>(device_, options_.bounce_slots, options_.bounce_slot_bytes);
    bounce_->set_limit(bounce_limit());
    if (bounce_->pinned()) {
      log::info("model '" + residency_.model_name() + "': streamed layers are in pageable memory; copying them through a " +
                format_mib(bounce_->bytes()) + " pinned bounce ring so copies still overlap compute");
    } else {
      log::warn("model '" + residency_.model_name() + "': streamed layers are in pageable memory and the " +
                format_mib(options_.bounce_slot_bytes * options_.bounce_slots) +
                " bounce ring could not be pinned: copies are synchronous (no overlap with compute)");
    }
  }
  bounce_->set_limit(bounce_limit());  // the ring may have changed since
  return bounce_.get();
}

// Note [bounce ring sizing]: ceil(ring capacity / slot) + F + 2 * P slots, F the fills the
// ring holds unread at most, P the pieces of the largest streamed layer.
size_t ForwardPass::bounce_limit() const {
  const uint64_t slot = options_.bounce_slot_bytes;
  uint64_t smallest = 0, largest = 0;
  for (const auto& r : residency_.records().layers()) {
    if (r.resident) continue;
    smallest = smallest ? std::min(smallest, r.slot_bytes) : r.slot_bytes;
    largest = std::max(largest, r.slot_bytes);
  }
  const StagingRing* ring = residency_.buffers().ring();
  const uint64_t capacity = ring ? ring->capacity() : residency_.plan().ring_bytes;
  if (largest == 0) return options_.bounce_slots;
  const uint64_t fills = capacity / std::max<uint64_t>(smallest, 1);
  const uint64_t pieces = (capacity + slot - 1) / slot + fills + 2 * ((largest + slot - 1) / slot);
  return static_cast<size_t>(std::max<uint64_t>(pieces, options_.bounce_slots));
}

// ---------------------------------------------------------------------------------------
// leases

LayerWeights ForwardPass::acquire(ManagedLayerImpl& layer, bool stored) {
  // A layer callback asked to stop (set_layer_progress): this forward ends here, before the
  // layer, as from any error.
  if (interrupt_ && depth_ > 0) std::rethrow_exception(take_interrupt());
  const int64_t id = residency_.records().find(&layer);
  TORCH_CHECK(residency_.attached() && id >= 0, "acquire: layer '", layer.qualified_name(),
              "' is not attached to this engine");
  const LayerRecord& r = residency_.records().at(id);
  if (depth_ == 0) open(kind_, /*implicit=*/true);
  const size_t pos = sched_.acquired(id);
  last_pos_ = pos;
  recorder_.note_acquire(id);
  Lease lease;
  at::Tensor w, b, s;
  if (r.resident) {
    top_up(pos, false);
    w = r.dev_w;
    b = r.dev_b;
    s = r.dev_s;
    lease.reads = {w, b, s};
  } else {
    const int slot = read_streamed(id, pos);
    StagingRing& ring = *residency_.buffers().ring();
    lease.slot = slot;
    lease.reads[0] = ring.slot(static_cast<size_t>(slot)).buffer;
    w = ring.view(slot, 0, r.stored_dtype, r.host_w.sizes());
    if (r.host_b.defined()) b = ring.view(slot, r.off_b, r.host_b.scalar_type(), r.host_b.sizes());
    if (r.host_s.defined()) s = ring.view(slot, r.off_s, r.host_s.scalar_type(), r.host_s.sizes());
  }
  for (const auto& t : lease.reads) device_.begin_access(t, StreamKind::compute, Access::read, r.name);
  try {
    LayerWeights out;
    out.weight = w;
    out.bias = b;
    if (stored) {
      out.scale = s;
      out.stored = true;
    } else if (r.upcast_w || r.upcast_b) {
      ForwardBuffers& buffers = residency_.buffers();
      lease.scratch = buffers.take_scratch(r.scratch_bytes, nested_flag_);
      const at::Tensor& buf = buffers.scratch(lease.scratch);
      lease.written = buf;
      device_.begin_access(buf, StreamKind::compute, Access::write, "upcast of '" + r.name + "'");
      std::unique_ptr<DeviceEvent> a = options_.timed() ? recorder_.mark() : nullptr;
      if (r.upcast_w) {
        out.weight = typed_view(buf, 0, r.compute, w.sizes());
        sluice::upcast_into(w, s, out.weight);
      }
      if (r.upcast_b) {
        out.bias = typed_view(buf, r.scratch_off_b, r.compute, b.sizes());
        sluice::upcast_into(b, at::Tensor(), out.bias);
      }
      if (a) recorder_.add_span(recorder_.current(), TraceTrack::upcast, SpanKind::upcast, id, std::move(a), recorder_.mark());
    }
    if (options_.trace) lease.start = recorder_.mark();
    leases_[static_cast<size_t>(id)].push_back(std::move(lease));
    if (nested_flag_) {
      // The most this forward holds beyond the plan (Note [upcast scratch]).
      nested_flag_ = false;
      nested_seen_ = std::max(nested_seen_, residency_.buffers().beyond_plan_bytes());
    }
    return out;
  } catch (...) {
    end_lease(lease);
    throw;
  }
}

int ForwardPass::read_streamed(int64_t id, size_t pos) {
  const LayerRecord& r = residency_.records().at(id);
  const std::string& model = residency_.model_name();
  if (!residency_.buffers().ring()) {
    try {
      residency_.ensure_ring();  // a residency change that failed could not make one
    } catch (const ResourceError& e) {
      throw ResourceError("model '" + model + "' has no staging ring to stream '" + r.name + "': " + e.what());
    }
  }
  const uint32_t occurrence = sched_.occurrence();
  int slot = residency_.buffers().ring()->find(id, epoch_, occurrence);
  if (slot < 0) {
    try {
      slot = issue(id, epoch_, occurrence, /*demand=*/true);
    } catch (const DeviceError& e) {
      throw DeviceError("model '" + model + "': streaming layer '" + r.name + "' failed: " + e.what());
    }
  }
  top_up(pos, false);
  StagingRing& ring = *residency_.buffers().ring();
  StagingSlot& st = ring.slot(static_cast<size_t>(slot));
  try {
    if (options_.timed()) {
      // Timed on the compute stream: resolve() counts it as a stall when the wait took
      // time on the device. A host query here would see copies the device has long
      // finished by the time compute gets there as stalls.
      std::unique_ptr<DeviceEvent> a = recorder_.mark();
      device_.wait(StreamKind::compute, *st.copy_done);  // FENCE(F1): the slot's copy is done
      recorder_.add_span(recorder_.current(), TraceTrack::compute, SpanKind::stall, id, std::move(a), recorder_.mark());
    } else {
      if (!st.copy_done->query()) recorder_.current().stalls += 1;
      device_.wait(StreamKind::compute, *st.copy_done);  // FENCE(F1)
    }
  } catch (const DeviceError& e) {
    // The slot's bytes are not the layer's: forget them, so nothing reads them.
    st.layer = -1;
    st.consumed = true;
    throw DeviceError("model '" + model + "': streaming layer '" + r.name + "' failed: " + e.what());
  }
  ring.begin_use(slot);
  st.consumed = true;
  return slot;
}

void ForwardPass::release(ManagedLayerImpl& layer) noexcept {
  const int64_t id = residency_.records().find(&layer);
  if (id < 0) {
    log::error("release: layer '" + layer.qualified_name() + "' is not attached to this engine");
    return;
  }
  std::vector<Lease>& leases = leases_[static_cast<size_t>(id)];
  if (leases.empty()) {
    log::error("release: layer '" + residency_.records().at(id).name + "' has no open lease");
    return;
  }
  Lease lease = std::move(leases.back());
  leases.pop_back();
  if (lease.start) {
    try {
      recorder_.add_span(recorder_.current(), TraceTrack::compute, SpanKind::compute, id, std::move(lease.start),
                         recorder_.mark());
    } catch (...) {
    }
  }
  const bool freed_slot = lease.slot >= 0;
  end_lease(lease);
  if (layer_progress_ && depth_ > 0) {
    try {
      layer_progress_(++released_, static_cast<int64_t>(sched_.order(kind_).size()));
    } catch (const Interrupted&) {
      interrupt_ = std::current_exception();  // thrown by the next acquire()
      layer_progress_ = nullptr;
    } catch (const std::exception& e) {
      log::warn("model '" + residency_.model_name() + "': the layer progress callback threw (" + e.what() +
                "); it is turned off");
      layer_progress_ = nullptr;
    } catch (...) {
      log::warn("model '" + residency_.model_name() + "': the layer progress callback threw; it is turned off");
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

void ForwardPass::end_lease(Lease& lease) noexcept {
  try {
    for (const at::Tensor* t : {&lease.reads[0], &lease.reads[1], &lease.reads[2], &lease.written}) {
      if (!t->defined()) continue;
      device_.end_access(*t, StreamKind::compute);
      device_.record_use(*t, StreamKind::compute);  // FENCE(F5): a free on another stream waits for this forward
    }
  } catch (const std::exception& e) {
    log::error(std::string("release: recording a stream use failed: ") + e.what());
  }
  ForwardBuffers& buffers = residency_.buffers();
  if (lease.scratch >= 0) buffers.give_back_scratch(lease.scratch);
  if (lease.slot >= 0 && buffers.ring()) buffers.ring()->end_use(lease.slot);
}

}  // namespace sluice::offload
