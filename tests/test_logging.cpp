#include <catch2/catch.hpp>

#include "runtime/error.h"
#include "runtime/logging.h"

using sluice::log::Level;

TEST_CASE("parse_level accepts every level name, case-insensitively") {
  CHECK(sluice::log::parse_level("trace") == Level::trace);
  CHECK(sluice::log::parse_level("DEBUG") == Level::debug);
  CHECK(sluice::log::parse_level("Info") == Level::info);
  CHECK(sluice::log::parse_level("warn") == Level::warn);
  CHECK(sluice::log::parse_level("warning") == Level::warn);
  CHECK(sluice::log::parse_level("error") == Level::error);
  CHECK(sluice::log::parse_level("off") == Level::off);
}

TEST_CASE("parse_level names the bad value") {
  try {
    sluice::log::parse_level("verbose");
    FAIL("no exception");
  } catch (const sluice::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("'verbose'") != std::string::npos);
  }
}

TEST_CASE("set_level gates enabled()") {
  const Level before = sluice::log::level();
  sluice::log::set_level(Level::warn);
  CHECK_FALSE(sluice::log::enabled(Level::info));
  CHECK(sluice::log::enabled(Level::error));
  sluice::log::set_level(Level::debug);
  CHECK(sluice::log::enabled(Level::debug));
  sluice::log::set_level(before);
}
