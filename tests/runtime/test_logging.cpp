#include <catch2/catch.hpp>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/progress.h"
#include "runtime/status_line.h"

using sluice::log::Level;

TEST_CASE("logging: parse_level accepts every level name, case-insensitively") {
  CHECK(sluice::log::parse_level("trace") == Level::trace);
  CHECK(sluice::log::parse_level("DEBUG") == Level::debug);
  CHECK(sluice::log::parse_level("Info") == Level::info);
  CHECK(sluice::log::parse_level("warn") == Level::warn);
  CHECK(sluice::log::parse_level("warning") == Level::warn);
  CHECK(sluice::log::parse_level("error") == Level::error);
  CHECK(sluice::log::parse_level("off") == Level::off);
}

TEST_CASE("logging: parse_level names the bad value") {
  try {
    sluice::log::parse_level("verbose");
    FAIL("no exception");
  } catch (const sluice::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("'verbose'") != std::string::npos);
  }
}

TEST_CASE("logging: set_level gates enabled()") {
  const Level before = sluice::log::level();
  sluice::log::set_level(Level::warn);
  CHECK_FALSE(sluice::log::enabled(Level::info));
  CHECK(sluice::log::enabled(Level::error));
  sluice::log::set_level(Level::debug);
  CHECK(sluice::log::enabled(Level::debug));
  sluice::log::set_level(before);
}

TEST_CASE("logging: progress: the line gives bytes done of the total, the rate and the time left") {
  const uint64_t GiB = 1024ull * 1024 * 1024;
  CHECK(sluice::progress::format("reading a.safetensors", GiB, 4 * GiB, 2.0) ==
        "reading a.safetensors  1.00 GiB / 4.00 GiB  537 MB/s  ETA 6 s");
  CHECK(sluice::progress::format("writing b", 512ull << 20, 512ull << 20, 1.0) == "writing b  512 MiB / 512 MiB  537 MB/s");
  CHECK(sluice::progress::format("x", 0, GiB, 0.0) == "x  0 MiB / 1.00 GiB");  // no rate before the first byte
  CHECK(sluice::progress::format_duration(42.4) == "42 s");
  CHECK(sluice::progress::format_duration(185) == "3 min 05 s");
  CHECK(sluice::progress::format_duration(3720) == "1 h 02 min");
  CHECK(sluice::progress::format_duration(-1) == "?");
}

TEST_CASE("logging: progress: with the status line off (not a terminal) a task only counts") {
  // Under ctest stderr is a file: the line is unavailable, so enable() leaves it off. (Run
  // by hand on a terminal, there is nothing to check here; tests/cli/test_run.cpp checks the
  // terminal side through a pseudo-terminal.)
  if (sluice::status_line::available()) return;
  sluice::status_line::enable(true);
  CHECK_FALSE(sluice::status_line::enabled());
  sluice::progress::Task t("reading x", 100);
  t.advance(40);
  t.advance(60);
  CHECK(t.done() == 100);
  CHECK(t.elapsed_s() >= 0.0);
  sluice::status_line::show("drawn nowhere");  // no-ops off a terminal
  sluice::status_line::clear();
}
