#include "runtime/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include "runtime/error.h"
#include "runtime/status_line.h"

namespace sluice::log {
namespace {

spdlog::level::level_enum to_spdlog(Level l) {
  switch (l) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("sluice");
    l->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
    Level lvl = Level::info;
    if (const char* env = std::getenv("SLUICE_LOG_LEVEL"); env && *env) {
      try {
        lvl = parse_level(env);
      } catch (const Error&) {
        l->warn("SLUICE_LOG_LEVEL='{}' is not a level (trace|debug|info|warn|error|off); using info", env);
      }
    }
    l->set_level(to_spdlog(lvl));
    return l;
  }();
  return *instance;
}

std::array<std::atomic<uint64_t>, 6> g_counts{};  // by Level

std::mutex g_sink_mutex;
std::shared_ptr<const Sink> g_sink;  // none: stderr

}  // namespace

Level parse_level(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "trace") return Level::trace;
  if (s == "debug") return Level::debug;
  if (s == "info") return Level::info;
  if (s == "warn" || s == "warning") return Level::warn;
  if (s == "error") return Level::error;
  if (s == "off") return Level::off;
  throw InvalidArgument("unknown log level '" + std::string(name) + "' (expected trace|debug|info|warn|error|off)");
}

void set_level(Level l) { logger().set_level(to_spdlog(l)); }

Level level() {
  switch (logger().level()) {
    case spdlog::level::trace: return Level::trace;
    case spdlog::level::debug: return Level::debug;
    case spdlog::level::info: return Level::info;
    case spdlog::level::warn: return Level::warn;
    case spdlog::level::err: return Level::error;
    default: return Level::off;
  }
}

bool enabled(Level l) { return logger().should_log(to_spdlog(l)); }

void set_sink(Sink sink) {
  std::lock_guard<std::mutex> lock(g_sink_mutex);
  g_sink = sink ? std::make_shared<const Sink>(std::move(sink)) : nullptr;
}

void write(Level l, std::string_view message) {
  g_counts[static_cast<size_t>(l)].fetch_add(1, std::memory_order_relaxed);
  if (!enabled(l)) return;
  std::shared_ptr<const Sink> sink;
  {
    std::lock_guard<std::mutex> lock(g_sink_mutex);
    sink = g_sink;
  }
  if (sink) {
    try {
      (*sink)(l, std::string(message));
    } catch (...) {  // a sink must not throw; a message is not worth an error
    }
    return;
  }
  const status_line::Pause pause;  // Note [status line]: the message never lands inside the live line
  logger().log(to_spdlog(l), "{}", message);
}

uint64_t message_count(Level l) { return g_counts[static_cast<size_t>(l)].load(std::memory_order_relaxed); }

}  // namespace sluice::log
