#include "runtime/progress.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "runtime/status_line.h"

namespace sluice::progress {
namespace {

constexpr double kRedrawEveryS = 0.1;

// Quick operations never show: 1 s, or SLUICE_PROGRESS_AFTER seconds (tests set 0).
double show_after_s() {
  static const double s = [] {
    const char* env = std::getenv("SLUICE_PROGRESS_AFTER");
    if (env == nullptr || *env == '\0') return 1.0;
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    return end != env && *end == '\0' && v >= 0 ? v : 1.0;
  }();
  return s;
}

std::string gib(uint64_t bytes) {
  char buf[32];
  const double g = static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
  if (g >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", g);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  }
  return buf;
}

}  // namespace

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(std::llround(seconds));
  char buf[48];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%lld s", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%lld min %02lld s", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lld h %02lld min", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

std::string format(const std::string& label, uint64_t done, uint64_t total, double elapsed_s) {
  std::string out = label + "  " + gib(done) + " / " + gib(total);
  if (elapsed_s > 0 && done > 0) {
    const double rate = static_cast<double>(done) / elapsed_s;  // bytes per second
    char buf[48];
    std::snprintf(buf, sizeof buf, "  %.0f MB/s", rate / 1e6);
    out += buf;
    if (total > done) out += "  ETA " + format_duration(static_cast<double>(total - done) / rate);
  }
  return out;
}

Task::Task(std::string label, uint64_t total_bytes)
    : label_(std::move(label)), total_(total_bytes), start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

Task::~Task() {
  if (shown_) status_line::clear();
}

double Task::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Task::advance(uint64_t bytes) {
  done_ += bytes;
  if (!status_line::enabled()) return;
  const auto now = std::chrono::steady_clock::now();
  const double since_start = std::chrono::duration<double>(now - start_).count();
  if (since_start < show_after_s()) return;
  if (shown_ && std::chrono::duration<double>(now - last_draw_).count() < kRedrawEveryS && done_ < total_) return;
  last_draw_ = now;
  shown_ = true;
  status_line::show(format(label_, done_, total_, since_start));
}

}  // namespace sluice::progress
