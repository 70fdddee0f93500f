#pragma once
// The project's logging API. spdlog stays behind this header: callers see only a
// level enum and printf-free formatting through fmt-style strings built by the caller.
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace sluice::log {

enum class Level { trace, debug, info, warn, error, off };

// Parses "trace|debug|info|warn|error|off" (case-insensitive); throws InvalidArgument.
Level parse_level(std::string_view name);

// Sets the level of the "sluice" logger. The initial level is read once, at the
// first log call, from SLUICE_LOG_LEVEL (default info).
void set_level(Level level);
Level level();
bool enabled(Level level);

// Sends one message to the "sluice" logger (stderr). Messages should name the
// model, file or tensor they concern.
void write(Level level, std::string_view message);

// Where messages go instead of stderr (an embedder's own logging: Python's `sluice` logger,
// Note [log sink] in python/src/sluice_python.cpp); an empty function: stderr again. The
// sink is called on the thread that logs, for the messages the level lets through, and
// must neither block nor throw. Thread-safe.
using Sink = std::function<void(Level, const std::string&)>;
void set_sink(Sink sink);

// Messages passed to write() at `level` since the process started, shown or filtered
// out alike: tests check "exactly one warning" with it, the stress driver reports it.
uint64_t message_count(Level level);

inline void trace(std::string_view m) { write(Level::trace, m); }
inline void debug(std::string_view m) { write(Level::debug, m); }
inline void info(std::string_view m) { write(Level::info, m); }
inline void warn(std::string_view m) { write(Level::warn, m); }
inline void error(std::string_view m) { write(Level::error, m); }

}  // namespace sluice::log
