#pragma once
// The share a model's LoRA sidecars take on the device. A LoRA applied through the cache
// (ModelCache::patch) places its sidecars inside the model's share, which is sized for the
// weights: without a rule of its own the sidecars would push resident layers out of the
// share, or the share would grow past what the budget gives. This part grows the share for
// them first, the way a lock's share grows (cache/device_shares.h), takes out of the
// model's own residency only what the budget cannot give, and gives the bytes back when the
// sidecars go. It hands out each entry's placer (offload::SidecarPlacer), whose calls come
// with the cache mutex held and the entry idle (Note [cache locking]).
//
// Note [sidecar share]
// ~~~~~~~~~~~~~~~~~~~~
// LoRA sidecars live on the device beside the weights, inside the model's share (Note
// [device extras] in offload/engine/model_budget.h). A model's share is sized for its weights, so when
// sidecars of B bytes are placed (ModelCache::patch), the share first grows by B, as a
// lock's share does: from the free part of the budget, then by partially unloading other
// unlocked models, then by taking whole ones off the device; the engine grows its budget
// and places the sidecars in one replan, so the resident layers stay as they were. Only
// what the budget cannot give (the share never grows past what the model wants, nor past
// the limit) comes out of the model's own residency: more layers stream. A budget that
// cannot hold the sidecars even with every streamable layer streamed refuses them, before
// anything changes, with one line naming the model, the LoRA and the bytes missing. The
// model's minimum, wanted and full shares and its residency target include the sidecars
// while they live (so set_vram_budget, full_load, partial_load and set_max_resident size
// the share with them), and when they go the share shrinks back to what the model then
// wants: the bytes it grew for them go back to the budget, the rest back to resident layers.
//
// Tested by (indirectly, through LoRAs applied to models of a cache by the API and the bindings):
// tests/api/test_api.cpp ("api: a LoRA's sidecars grow the model's share into the free budget and the
// share shrinks back", "api: an unlocked model gives up residency for another model's LoRA and a
// budget that cannot hold it refuses in one line", "api: LoRA changes the output and its removal
// restores it bit-exactly"), tests/python/test_bindings.py
// (test_a_lora_grows_the_share_into_the_free_budget_and_gives_it_back,
// test_a_budget_that_cannot_hold_the_sidecars_refuses_them_in_one_line,
// test_a_lora_does_not_outlive_its_lock).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cache/cache_locking.h"
#include "cache/cache_state.h"
#include "cache/device_shares.h"
#include "models/anima/anima.h"
#include "offload/engine/engine.h"

namespace sluice::cache {

class SidecarShare {
 public:
  SidecarShare(CacheState& state, CacheLocking& locking, DeviceShares& shares)
      : s_(state), locking_(locking), shares_(shares) {}
  SidecarShare(const SidecarShare&) = delete;
  SidecarShare& operator=(const SidecarShare&) = delete;

  // ModelCache::patch on the locked entry `e`: waits for its running forward (taking the
  // cache mutex), then runs fn with the entry's placer, the mutex held.
  void patch(Entry& e, const std::function<void(anima::AnimaModelImpl&, offload::SidecarPlacer&)>& fn);

  // The placer's calls (cache mutex held, `e` locked and idle): grow the share of `e` for
  // the sidecars and place them, or give their room back.
  std::vector<at::Tensor> place(Entry& e, const std::vector<at::Tensor>& host,
                                const std::vector<at::ScalarType>& dtypes, const std::string& what);
  void release(Entry& e, uint64_t bytes) noexcept;

  CacheLocking& locking() const { return locking_; }

 private:
  void shift(Entry& e, int64_t delta);  // sidecar bytes, needs and target follow

  CacheState& s_;
  CacheLocking& locking_;
  DeviceShares& shares_;
};

}  // namespace sluice::cache
