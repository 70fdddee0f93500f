#include "cache/sidecar_share.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <thread>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::cache {

namespace {

// The placer ModelCache::patch hands out, one per entry. Its calls come from a LoraScope
// inside patch() (this thread holds the cache mutex, the entry is idle); a release from
// anywhere else takes the cache mutex and waits for the entry's forward itself.
class EntrySidecars final : public offload::SidecarPlacer {
 public:
  EntrySidecars(SidecarShare& share, Entry& entry) : share_(share), entry_(entry) {}

  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what) override {
    TORCH_CHECK(patching_.load() == std::this_thread::get_id(), what, ": sidecars of model '", entry_.name,
                "' are placed through ModelCache::patch only");
    return share_.place(entry_, host, dtypes, what);
  }

  void sidecars_released(uint64_t bytes) noexcept override {
    if (patching_.load() == std::this_thread::get_id()) {
      share_.release(entry_, bytes);
      return;
    }
    try {
      Guard g(share_.locking().mutex());
      share_.locking().wait_idle(entry_, g);
      share_.release(entry_, bytes);
    } catch (const std::exception& e) {
      log::error("releasing sidecars of model '" + entry_.name + "' failed: " + e.what());
    }
  }

  std::atomic<std::thread::id> patching_{};  // the thread inside patch() for this entry

 private:
  SidecarShare& share_;
  Entry& entry_;
};

}  // namespace

void SidecarShare::patch(Entry& e, const std::function<void(anima::AnimaModelImpl&, offload::SidecarPlacer&)>& fn) {
  Guard g(locking_.mutex());
  locking_.wait_idle(e, g);  // locked: it stays in RAM and on the device meanwhile
  TORCH_INTERNAL_ASSERT(e.in_ram() && e.attached && e.engine, "locked model '", e.name, "' is not on the device");
  if (!e.model) throw InvalidArgument("model '" + e.name + "' is an offloaded torch module, not an Anima model: it cannot be patched");
  if (!e.placer) e.placer = std::make_unique<EntrySidecars>(*this, e);
  auto& placer = static_cast<EntrySidecars&>(*e.placer);
  struct Patching {
    EntrySidecars& p;
    ~Patching() { p.patching_.store(std::thread::id()); }
  } patching{placer};
  placer.patching_.store(std::this_thread::get_id());
  fn(*e.model, placer);
}

std::vector<at::Tensor> SidecarShare::place(Entry& e, const std::vector<at::Tensor>& host,
                                            const std::vector<at::ScalarType>& dtypes, const std::string& what) {
  TORCH_INTERNAL_ASSERT(e.attached && e.engine && !e.running, "sidecars of '", e.name,
                        "' placed off the device or during its forward");
  uint64_t bytes = 0;
  for (size_t i = 0; i < host.size() && i < dtypes.size(); ++i) {
    bytes += static_cast<uint64_t>(host[i].numel()) * c10::elementSize(dtypes[i]);
  }
  // The most the share can become: its free part of the limit and every other unlocked
  // model's share (DeviceShares::make_room takes them, partially and then whole).
  const uint64_t free = shares_.unreserved();
  uint64_t others = 0;
  for (const auto& p : s_.entries) {
    if (p.get() != &e && p->attached && p->locks == 0) others += p->share;
  }
  const uint64_t most = e.share + free + others;
  const uint64_t minimum = e.engine->minimum_budget();  // with the sidecars placed so far (no working memory in a share)
  if (minimum + bytes > most) {
    std::ostringstream msg;
    msg << what << " needs " << format_mib(bytes) << " of device memory for its sidecars (" << bytes
        << " bytes), but model '" << e.name << "' can have at most " << format_mib(most - std::min(most, minimum))
        << " beside its minimum of " << format_mib(minimum) << " on " << s_.device->name() << ": its share of "
        << format_mib(e.share) << ", " << format_mib(free) << " free and " << format_mib(others)
        << " held by unlocked models, of the " << format_mib(shares_.limit()) << " that the vram budget ("
        << format_mib(s_.budget) << ") leaves beside the working memory; " << format_mib(minimum + bytes - most)
        << " missing (raise the vram budget or unlock other models)";
    throw ResourceError(msg.str());
  }
  const uint64_t before = e.share;
  shift(e, static_cast<int64_t>(bytes));
  std::vector<at::Tensor> out;
  try {
    // Grow by the sidecars' bytes, no further than the model now wants.
    const uint64_t want = shares_.wanted_share(e);
    uint64_t grow = want > e.share ? std::min(want - e.share, bytes) : 0;
    uint64_t room = shares_.unreserved();
    if (room < grow) {
      shares_.make_room(grow - room, &e);
      room = shares_.unreserved();
    }
    grow = std::min(grow, room);
    out = e.engine->place_sidecars(host, dtypes, what, grow);  // one replan: budget and sidecars
    e.share += grow;
  } catch (...) {
    shift(e, -static_cast<int64_t>(bytes));
    throw;
  }
  shares_.count_pinned_ram(e);
  locking_.publish(e);
  log::info(what + " on '" + e.name + "': sidecars " + format_mib(bytes) + ", share " + format_mib(before) + " -> " +
            format_mib(e.share) + " of " + format_mib(shares_.limit()) + "; residency " + e.engine->plan().residency_map());
  return out;
}

void SidecarShare::release(Entry& e, uint64_t bytes) noexcept {
  try {
    shift(e, -static_cast<int64_t>(std::min(bytes, e.sidecar_bytes)));
    if (!e.engine) return;
    // Back to what the model wants without them: the bytes the share grew for them.
    const uint64_t want = e.attached ? shares_.wanted_share(e) : 0;
    const uint64_t shrink = e.attached && e.share > want ? std::min(e.share - want, bytes) : 0;
    const uint64_t shrunk = e.engine->sidecars_released(bytes, shrink);
    if (!e.attached) return;
    e.share -= std::min(e.share, shrunk);
    shares_.count_pinned_ram(e);
    locking_.publish(e);
  } catch (const std::exception& ex) {
    log::error("releasing sidecars of model '" + e.name + "' failed: " + ex.what());
  }
}

void SidecarShare::shift(Entry& e, int64_t delta) {
  const int64_t now = static_cast<int64_t>(e.sidecar_bytes) + delta;
  TORCH_INTERNAL_ASSERT(now >= 0, "sidecar bytes of '", e.name, "' below zero");
  e.sidecar_bytes = static_cast<uint64_t>(now);
  const auto moved = [delta](uint64_t v) { return static_cast<uint64_t>(std::max<int64_t>(static_cast<int64_t>(v) + delta, 0)); };
  if (e.target) e.target = moved(*e.target);  // the residency asked for, beside the sidecars
  if (!e.in_ram()) return;
  e.needs.minimum = moved(e.needs.minimum);
  e.needs.full = moved(e.needs.full);
  e.needs.wanted = moved(e.needs.wanted);
}

}  // namespace sluice::cache
