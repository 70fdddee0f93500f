#include "cli/run_progress.h"

#include <algorithm>
#include <cstdio>

#include "runtime/progress.h"
#include "runtime/status_line.h"

namespace sluice::cli {

std::string format_run_progress(int step, int steps, int64_t layers_done, int64_t layers_expected, double elapsed_s,
                                double eta_s) {
  char buf[160];
  const int w = static_cast<int>(std::to_string(steps).size());
  int n = std::snprintf(buf, sizeof buf, "step %*d/%d", w, std::min(step + 1, steps), steps);
  if (layers_done > 0) {
    if (layers_expected > 0) {
      n += std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), "  layer %lld/%lld",
                         static_cast<long long>(std::min(layers_done, layers_expected)),
                         static_cast<long long>(layers_expected));
    } else {
      n += std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), "  layer %lld",
                         static_cast<long long>(layers_done));
    }
  }
  std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), "  elapsed %.1f s", elapsed_s);
  std::string out = buf;
  out += "  ETA " + (eta_s < 0 ? std::string("after step 1") : progress::format_duration(eta_s));
  return out;
}

RunProgress::RunProgress(int steps) : steps_(steps) {}

double RunProgress::eta_s() const {
  if (done_steps_ == 0) return -1;
  const double mean_s = done_ms_ / 1000.0 / done_steps_;
  double left = static_cast<double>(steps_ - done_steps_);
  if (layers_expected_ > 0)
    left -= std::min(1.0, static_cast<double>(layers_done_) / static_cast<double>(layers_expected_));
  return std::max(0.0, left * mean_s);
}

void RunProgress::on_layer(int64_t done, int64_t expected) {
  layers_done_ = done;
  layers_expected_ = expected;
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_draw_).count() < 0.05 && done != expected) return;
  last_draw_ = now;
  redraw();
}

void RunProgress::on_step(double ms) {
  done_ms_ += ms;
  ++done_steps_;
  layers_done_ = 0;
}

void RunProgress::redraw() const {
  if (!status_line::enabled() || done_steps_ >= steps_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  status_line::show(format_run_progress(done_steps_, steps_, layers_done_, layers_expected_, elapsed, eta_s()));
}

}  // namespace sluice::cli
