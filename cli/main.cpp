// `sluice`: dispatches to one subcommand and turns every failure into one line on
// stderr and an exit status (see commands.h for the contract).
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "runtime/error.h"
#include "runtime/hardware.h"
#include "runtime/logging.h"
#include "runtime/runtime_info.h"
#include "runtime/status_line.h"

namespace {

constexpr int kRuntimeError = 1;
constexpr int kUsageError = 2;

// Error texts (CLI11's, torch's) may span lines; the contract is one line.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

int fail(int status, const std::string& message) {
  sluice::status_line::enable(false);  // erases a live line first
  std::cerr << "sluice: error: " << one_line(message) << std::endl;
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sluice: runs large diffusion transformers on GPUs too small to hold them"};
  app.name("sluice");
  app.set_version_flag("--version", sluice::version_string());
  app.require_subcommand(1);
  app.fallthrough();  // global flags may follow the subcommand name
  std::string log_level;
  app.add_option("--log-level", log_level,
                 "trace|debug|info|warn|error|off (default: $SLUICE_LOG_LEVEL, else warn)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  bool no_progress = false;
  app.add_flag("--no-progress", no_progress,
               "No live progress line on the terminal (loads, writes, run steps); off a terminal there is none");

  std::vector<sluice::cli::Subcommand> commands{
      sluice::cli::add_inspect(app),
      sluice::cli::add_forward(app),
      sluice::cli::add_make_checkpoint(app),
      sluice::cli::add_convert(app),
      sluice::cli::add_fp8_report(app),
      sluice::cli::add_run(app),
  };

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Name the subcommand whose help would have helped.
    std::string where = "sluice";
    for (int i = 1; i < argc; ++i)
      for (const auto& c : commands)
        if (where == "sluice" && c.app->get_name() == argv[i]) where += " " + c.app->get_name();
    std::string message = e.what();
    if (where == "sluice") {
      // CLI11 reports a misspelt subcommand as a missing one; name the word instead.
      for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--log-level") {
          ++i;
          continue;
        }
        if (arg.empty() || arg[0] == '-') continue;
        std::string known;
        for (const auto& c : commands) known += (known.empty() ? "" : ", ") + c.app->get_name();
        message = "unknown subcommand '" + arg + "' (expected one of: " + known + ")";
        break;
      }
    }
    return fail(kUsageError, message + "; run '" + where + " --help'");
  }

  try {
    if (!log_level.empty()) {
      sluice::log::set_level(sluice::log::parse_level(log_level));
    } else if (std::getenv("SLUICE_LOG_LEVEL") == nullptr) {
      // Scripts parse stdout and expect stderr to hold only problems.
      sluice::log::set_level(sluice::log::Level::warn);
    }
    // Note [status line]: drawn only when stderr is a terminal.
    sluice::status_line::enable(!no_progress);
    sluice::apply_cpu_onednn_env();  // Note [native bf16]: before any command asks what the CPU computes fast
    for (const auto& c : commands) {
      if (!c.app->parsed()) continue;
      const int status = c.run();
      sluice::status_line::enable(false);
      return status;
    }
    return fail(kUsageError, "no subcommand given; run 'sluice --help'");
  } catch (const sluice::Error& e) {
    return fail(kRuntimeError, e.what());
  } catch (const c10::Error& e) {
    return fail(kRuntimeError, e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return fail(kRuntimeError, "out of memory");
  } catch (const std::exception& e) {
    return fail(kRuntimeError, e.what());
  }
}
