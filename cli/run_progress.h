#pragma once
// sluice run's live line (Note [status line] in runtime/status_line.h): while a step
// runs, "step 3/12  layer 17/40  elapsed 12.3 s  ETA 20 s" is redrawn after every layer,
// on a terminal only. Off a terminal the run prints its one line per step and nothing
// else.
#include <chrono>
#include <cstdint>
#include <string>

namespace sluice::cli {

// The line's text. `step` is 0-based (the step running); `layers_expected` 0: unknown
// (the first forward); `eta_s` < 0: unknown.
std::string format_run_progress(int step, int steps, int64_t layers_done, int64_t layers_expected, double elapsed_s,
                                double eta_s);

class RunProgress {
 public:
  explicit RunProgress(int steps);
  // From the forward's layer callback (LockedModel::forward's progress).
  void on_layer(int64_t done, int64_t expected);
  // A step ended after `ms` (its line is printed next, under a status_line::Pause).
  void on_step(double ms);
  // Seconds left: the mean step so far times the steps left, less the running step's
  // layer fraction; < 0 before the first step ends.
  double eta_s() const;
  // Draws the line now (after the step's own line was printed).
  void redraw() const;

 private:
  int steps_;
  int done_steps_ = 0;
  double done_ms_ = 0;
  int64_t layers_done_ = 0, layers_expected_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  mutable std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace sluice::cli
