#include "runtime/status_line.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace sluice::status_line {
namespace {

std::atomic<bool> g_on{false};
// Recursive: a Pause may be held while a log message (which pauses too) is written.
std::recursive_mutex g_mutex;
std::string g_text;    // the line's text, shown or to be redrawn
bool g_drawn = false;  // the text is on the terminal now
int g_paused = 0;

size_t width() {
  winsize ws{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1) return ws.ws_col - 1;
  return 79;
}

void put(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stderr);
  std::fflush(stderr);
}

void erase_locked() {
  if (g_drawn) put("\r\033[K");
  g_drawn = false;
}

void draw_locked() {
  if (g_paused > 0 || g_text.empty()) return;
  std::string line = g_text;
  const size_t w = width();
  if (line.size() > w) line.resize(w);
  put("\r" + line + "\033[K");
  g_drawn = true;
}

}  // namespace

bool available() {
  static const bool yes = [] {
    if (::isatty(STDERR_FILENO) == 0) return false;
    const char* term = std::getenv("TERM");
    return term == nullptr || std::strcmp(term, "dumb") != 0;
  }();
  return yes;
}

void enable(bool on) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (!on) {
    erase_locked();
    g_text.clear();
  }
  g_on.store(on && available(), std::memory_order_relaxed);
}

bool enabled() { return g_on.load(std::memory_order_relaxed); }

void show(const std::string& text) {
  if (!enabled()) return;
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  g_text = text;
  for (char& c : g_text)
    if (c == '\n' || c == '\r') c = ' ';
  draw_locked();
}

void clear() {
  if (!enabled()) return;
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  erase_locked();
  g_text.clear();
}

Pause::Pause() : locked_(enabled()) {
  if (!locked_) return;
  g_mutex.lock();
  ++g_paused;
  erase_locked();
}

Pause::~Pause() {
  if (!locked_) return;
  std::fflush(stdout);  // what was written meanwhile reaches the terminal before the line
  --g_paused;
  draw_locked();
  g_mutex.unlock();
}

}  // namespace sluice::status_line
