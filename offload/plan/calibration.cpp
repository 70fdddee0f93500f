#include "offload/plan/calibration.h"

#include <algorithm>
#include <cmath>

namespace sluice::offload {

namespace {
constexpr size_t kMaxCopies = 8192;  // timed copies kept for the fit
}

std::vector<double> compute_times(const ForwardSample& s) {
  const size_t n = s.order.size();
  if (n == 0 || s.acquire_ms.size() != n || s.stall_ms.size() != n || !(s.wall_ms > 0)) return {};
  std::vector<double> c(n);
  for (size_t i = 0; i + 1 < n; ++i) c[i] = s.acquire_ms[i + 1] - s.acquire_ms[i] - s.stall_ms[i];
  // The last position runs to the end, and the head of the forward (before the first
  // acquire) joins it: see Note [calibration].
  c[n - 1] = s.wall_ms - s.acquire_ms[n - 1] - s.stall_ms[n - 1] + s.acquire_ms[0];
  for (double& v : c) {
    if (!std::isfinite(v)) return {};
    v = std::max(v, 0.0);  // event resolution: a wait can read a hair longer than its interval
  }
  return c;
}

std::optional<CopyFit> fit_copies(const std::vector<std::pair<uint64_t, double>>& copies) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  double lo = 0, hi = 0;
  size_t n = 0;
  for (const auto& [bytes, ms] : copies) {
    if (bytes == 0 || !std::isfinite(ms) || ms < 0) continue;
    const double x = static_cast<double>(bytes);
    lo = n ? std::min(lo, x) : x;
    hi = n ? std::max(hi, x) : x;
    sx += x, sy += ms, sxx += x * x, sxy += x * ms;
    ++n;
  }
  if (n == 0 || !(sy > 0)) return std::nullopt;
  const double N = static_cast<double>(n);
  // ms per byte through the origin: the fallback when sizes do not spread enough to tell
  // latency from bandwidth, or when the line's intercept would be negative.
  auto through_origin = [&] {
    CopyFit f;
    f.gbps = sx / (sy * 1e6);
    return f;
  };
  if (hi < 1.5 * lo) return through_origin();
  const double var = sxx / N - (sx / N) * (sx / N);
  const double slope = (sxy / N - (sx / N) * (sy / N)) / var;
  const double intercept = sy / N - slope * sx / N;
  if (!(var > 0) || !(slope > 0) || intercept < 0) {
    CopyFit f;
    f.gbps = sxx / (sxy * 1e6);  // least squares slope through the origin
    return f;
  }
  CopyFit f;
  f.gbps = 1.0 / (slope * 1e6);
  f.overhead_ms = intercept;
  return f;
}

bool Calibrator::begin(const std::string& kind) {
  Kind& k = kinds_[kind];
  bool detail = false;
  if (!k.pending) {
    if (k.compute_ms.empty()) {
      detail = k.started >= 1;  // not the first forward: it pays one-time costs
    } else {
      detail = k.predicted.has_value() && !recomputed_ && k.started_under_plan == 1;  // the check forward
    }
  }
  k.started += 1;
  if (k.predicted) k.started_under_plan += 1;
  k.pending = k.pending || detail;
  return detail;
}

void Calibrator::take_profile(Kind& k, const ForwardSample& s) {
  std::vector<double> c = compute_times(s);
  if (c.empty()) return;
  k.order = s.order;
  k.compute_ms = std::move(c);
  copies_.insert(copies_.end(), s.copies.begin(), s.copies.end());
  if (copies_.size() > kMaxCopies) copies_.erase(copies_.begin(), copies_.end() - static_cast<ptrdiff_t>(kMaxCopies));
  if (auto f = fit_copies(copies_)) copy_ = f;
  replan_due_ = true;
}

void Calibrator::forward(const std::string& kind, bool detailed, double wall_ms, const ForwardSample* sample) {
  Kind& k = kinds_[kind];
  if (detailed) k.pending = false;
  if (!sample) return;
  const ForwardSample* detail = detailed ? sample : nullptr;
  k.forwards += 1;
  if (k.compute_ms.empty()) {
    if (detail) take_profile(k, *detail);
    return;
  }
  if (!k.predicted) return;
  k.under_plan += 1;
  if (k.under_plan < 2) return;  // the first forward under a plan fills the ring: not steady state
  k.steps.push_back(wall_ms);
  if (k.under_plan == 2 && !recomputed_ && detail && *k.predicted > 0 &&
      std::abs(wall_ms - *k.predicted) > kTolerance * *k.predicted) {
    recomputed_ = true;
    take_profile(k, *detail);
  }
}

void Calibrator::copies(const std::vector<std::pair<uint64_t, double>>& timed) {
  if (copy_ || timed.empty()) return;
  copies_ = timed;
  copy_ = fit_copies(copies_);
  bool profiled = false;
  for (const auto& [name, k] : kinds_) profiled = profiled || !k.compute_ms.empty();
  if (copy_ && profiled) replan_due_ = true;
}

CostModel Calibrator::model(size_t layers) const {
  CostModel m;
  if (copy_) {
    m.copy_gbps = copy_->gbps;
    m.copy_overhead_ms = copy_->overhead_ms;
  }
  for (const auto& [name, k] : kinds_) {
    if (k.compute_ms.empty()) continue;
    KindProfile p;
    p.kind = name;
    p.weight = static_cast<double>(std::max<uint64_t>(k.forwards, 1));
    bool ok = true;
    for (int64_t id : k.order) {
      if (id < 0 || static_cast<size_t>(id) >= layers) ok = false;
      p.order.push_back(static_cast<size_t>(std::max<int64_t>(id, 0)));
    }
    if (!ok) continue;
    p.compute_ms = k.compute_ms;
    m.kinds.push_back(std::move(p));
  }
  return m;
}

void Calibrator::planned(const std::vector<KindPrediction>& predictions) {
  measured_plans_ += 1;
  replan_due_ = false;
  for (auto& [name, k] : kinds_) {
    k.predicted.reset();
    k.under_plan = 0;
    k.started_under_plan = 0;
    k.steps.clear();
    for (const auto& p : predictions) {
      if (p.kind == name) k.predicted = p.step_ms;
    }
  }
}

void Calibrator::unplanned() {
  for (auto& [name, k] : kinds_) {
    k.predicted.reset();
    k.under_plan = 0;
    k.started_under_plan = 0;
    k.steps.clear();
  }
}

double Calibrator::measured_step_ms(const std::string& kind) const {
  const auto it = kinds_.find(kind);
  if (it == kinds_.end() || it->second.steps.empty()) return 0;
  std::vector<double> v = it->second.steps;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

uint64_t Calibrator::measured_forwards(const std::string& kind) const {
  const auto it = kinds_.find(kind);
  return it == kinds_.end() ? 0 : it->second.steps.size();
}

std::string Calibrator::main_kind() const {
  std::string best;
  uint64_t most = 0;
  for (const auto& [name, k] : kinds_) {
    if (k.forwards > most) {
      most = k.forwards;
      best = name;
    }
  }
  return best;
}

}  // namespace sluice::offload
