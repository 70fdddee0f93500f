#include "offload/plan/prefetch_scheduler.h"

#include <algorithm>

#include "runtime/error.h"

namespace sluice::offload {

namespace {
const std::vector<int64_t> kEmpty;
constexpr uint32_t kMaxPrefetch = 65536;
}  // namespace

uint32_t parse_prefetch(std::string_view text, const std::string& flag) {
  if (text == "auto") return kPrefetchAuto;
  uint64_t n = 0;
  bool ok = !text.empty() && text.size() <= 6;
  for (char c : text) {
    if (c < '0' || c > '9') {
      ok = false;
      break;
    }
    n = n * 10 + static_cast<uint64_t>(c - '0');
  }
  if (!ok || n > kMaxPrefetch) {
    throw InvalidArgument((flag.empty() ? std::string() : flag + ": ") + "expected 'auto' or a number of layers from 0 to " + std::to_string(kMaxPrefetch) +
                          ", got '" + std::string(text) + "'");
  }
  return static_cast<uint32_t>(n);
}

std::string prefetch_name(uint32_t max_ahead) {
  return max_ahead == kPrefetchAuto ? std::string("auto") : std::to_string(max_ahead);
}

bool PrefetchScheduler::streamed(int64_t id) const {
  return id >= 0 && static_cast<size_t>(id) < streamed_.size() && streamed_[static_cast<size_t>(id)];
}

void PrefetchScheduler::refresh(Kind& k) const {
  const size_t n = k.order.size();
  k.next_streamed.assign(n + 1, n);
  for (size_t i = n; i-- > 0;) k.next_streamed[i] = streamed(k.order[i]) ? i : k.next_streamed[i + 1];
  k.streamed_before.assign(n + 1, 0);
  for (size_t i = 0; i < n; ++i) k.streamed_before[i + 1] = k.streamed_before[i] + (streamed(k.order[i]) ? 1 : 0);
  std::map<int64_t, uint32_t> seen;
  k.occurrence.resize(n);
  for (size_t i = 0; i < n; ++i) k.occurrence[i] = seen[k.order[i]]++;
}

void PrefetchScheduler::set_streamed(std::vector<bool> streamed) {
  streamed_ = std::move(streamed);
  for (auto& [name, k] : kinds_) refresh(k);
  reset_frontier();
}

void PrefetchScheduler::begin(const std::string& kind, uint64_t epoch, bool implicit) {
  kind_ = &kinds_[kind];
  epoch_ = epoch;
  implicit_ = implicit;
  known_ = !kind_->order.empty();
  cursor_ = 0;
  diverged_ = false;
  recording_.clear();
  calls_.clear();
  occurrence_ = 0;
  overflow_ = false;
  if (frontier_epoch_ < epoch_) {
    frontier_epoch_ = epoch_;
    frontier_ = 0;
  }
}

size_t PrefetchScheduler::acquired(int64_t id) {
  occurrence_ = calls_[id]++;
  if (!overflow_) {
    if (recording_.size() < 4 * streamed_.size() + 16) {
      recording_.push_back(id);
    } else {
      overflow_ = true;  // no forward boundaries: stop recording, stop predicting
      known_ = false;
    }
  }
  if (!known_) return kNone;
  const auto& order = kind_->order;
  if (cursor_ < order.size() && order[cursor_] == id) return cursor_++;
  diverged_ = true;
  for (size_t j = std::min(cursor_, order.size()); j < order.size(); ++j) {
    if (order[j] == id) {
      cursor_ = j + 1;
      return j;
    }
  }
  for (size_t j = 0; j < std::min(cursor_, order.size()); ++j) {
    if (order[j] == id) {
      cursor_ = j + 1;
      return j;
    }
  }
  return kNone;
}

void PrefetchScheduler::top_up(size_t pos, bool at_end, const OfferFn& offer) {
  if (!known_ || !kind_ || max_ahead_ == 0) return;
  const Kind& k = *kind_;
  const size_t n = k.order.size();
  // Offers go from `base` (just after the position computing now) to `limit` (one full
  // cycle ahead, or the end of this forward when it has no successor to wrap into).
  uint64_t base_e, limit_e;
  size_t base_i, limit_i;
  if (at_end) {
    if (implicit_) return;
    base_e = epoch_ + 1, base_i = 0;
    limit_e = epoch_ + 1, limit_i = n;
  } else {
    if (pos == kNone || pos >= n) return;
    base_e = epoch_, base_i = pos + 1;
    if (implicit_) {
      limit_e = epoch_, limit_i = n;
    } else {
      limit_e = epoch_ + 1, limit_i = pos;
    }
  }
  uint64_t e = base_e;
  size_t i = base_i;
  if (frontier_epoch_ > e || (frontier_epoch_ == e && frontier_ > i)) {
    e = frontier_epoch_;
    i = frontier_;
  }
  auto before = [](uint64_t ae, size_t ai, uint64_t be, size_t bi) { return ae < be || (ae == be && ai < bi); };
  // Streamed positions already offered since `base`.
  uint64_t ahead = e == base_e ? k.streamed_before[std::min(i, n)] - k.streamed_before[base_i]
                               : (k.streamed_before[n] - k.streamed_before[base_i]) + k.streamed_before[std::min(i, n)];
  while (ahead < max_ahead_) {
    const size_t j = i <= n ? k.next_streamed[std::min(i, n)] : n;
    if (j >= n) {
      if (e > epoch_ || implicit_) {
        i = n;
        break;
      }
      e = epoch_ + 1;  // the next forward's first streamed layers, during this one's tail
      i = 0;
      continue;
    }
    if (!before(e, j, limit_e, limit_i)) {
      i = j;
      break;
    }
    const Offer answer = offer(k.order[j], e, k.occurrence[j]);
    if (answer != Offer::issued) {
      i = j;
      break;
    }
    ++ahead;
    i = j + 1;
  }
  frontier_epoch_ = e;
  frontier_ = i;
}

PrefetchScheduler::Ended PrefetchScheduler::end(bool aborted) {
  Ended out;
  if (!kind_) return out;
  if (known_ && !aborted && cursor_ != kind_->order.size()) diverged_ = true;
  if (!aborted && !overflow_ && (!known_ || diverged_ || recording_ != kind_->order)) {
    kind_->order = recording_;
    refresh(*kind_);
    // Offers already made for the next forward followed the old order: offer the new one
    // from its start (copies already there are answered as issued, so nothing is copied twice).
    if (frontier_epoch_ > epoch_) {
      frontier_epoch_ = epoch_ + 1;
      frontier_ = 0;
    }
  }
  known_ = !kind_->order.empty();
  out.diverged = diverged_;
  out.overflow = overflow_;
  if (!overflow_) out.acquires = recording_;
  return out;
}

const std::vector<int64_t>& PrefetchScheduler::order(const std::string& kind) const {
  const auto it = kinds_.find(kind);
  return it == kinds_.end() ? kEmpty : it->second.order;
}

std::vector<std::string> PrefetchScheduler::kinds() const {
  std::vector<std::string> out;
  for (const auto& [name, k] : kinds_) {
    if (!k.order.empty()) out.push_back(name);
  }
  return out;
}

void PrefetchScheduler::clear() {
  kinds_.clear();
  kind_ = nullptr;
  known_ = false;
  reset_frontier();
}

}  // namespace sluice::offload
