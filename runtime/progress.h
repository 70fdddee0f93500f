#pragma once
// Progress of long operations: reading a checkpoint, generating a model's random weights,
// casting it to its storage dtype, writing a checkpoint (anima-2b takes minutes on 2
// cores). Note [progress]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A Task counts bytes done against a total. Once it has run for a second (or
// SLUICE_PROGRESS_AFTER seconds, if set) it shows itself on the status line
// (runtime/status_line.h: a terminal only, and only where a host turned the line on) as
// "reading anima.safetensors  1.20 GiB / 4.00 GiB  850 MB/s  ETA 3 s", at most ten times
// a second; at its end it erases itself. Where the line is off a Task costs an addition
// and a relaxed atomic load per advance().
#include <chrono>
#include <cstdint>
#include <string>

namespace sluice::progress {

// "LABEL  DONE/TOTAL  RATE  ETA" for `done` of `total` bytes after `elapsed_s` seconds.
std::string format(const std::string& label, uint64_t done, uint64_t total, double elapsed_s);
// Seconds as "42 s", "3 min 05 s", "1 h 02 min".
std::string format_duration(double seconds);

class Task {
 public:
  Task(std::string label, uint64_t total_bytes);
  ~Task();
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;

  // `bytes` more are done. Not thread-safe: one Task per thread.
  void advance(uint64_t bytes);
  uint64_t done() const { return done_; }
  double elapsed_s() const;

 private:
  std::string label_;
  uint64_t total_, done_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_;
  bool shown_ = false;
};

}  // namespace sluice::progress
