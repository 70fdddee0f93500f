#pragma once
// The live status line: one line at the bottom of the terminal that is redrawn in place
// (progress of a load, the step and layer of a run). Note [status line]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
//  - It is drawn on stderr, and only when stderr is a terminal and a host turned it on
//    (the sluice command does; a library host gets nothing drawn unless it asks). Off a
//    terminal nothing is drawn at all: logs and pipes see whole lines only.
//  - Anything else written to the same terminal first erases the line (Pause), then the
//    line is drawn again: log::write() does this for every message, and the sluice
//    command around each line it prints to stdout, so lines never interleave.
//  - Thread-safe: loads on several threads may each show their progress; the line shows
//    the latest. Text is cut to the terminal's width.
#include <string>

namespace sluice::status_line {

// stderr is a terminal whose TERM is not "dumb" (decided once).
bool available();
// Turns the line on where available() (off by default); turning it off erases it.
void enable(bool on);
bool enabled();
// Shows `text` (one line; newlines become spaces) in place of the line shown.
void show(const std::string& text);
// Erases the line (the next show() draws it again).
void clear();

// Erases the line for the duration of the scope and draws it again at its end.
class Pause {
 public:
  Pause();
  ~Pause();
  Pause(const Pause&) = delete;
  Pause& operator=(const Pause&) = delete;

 private:
  bool locked_;
};

}  // namespace sluice::status_line
