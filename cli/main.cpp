#include <CLI/CLI.hpp>

#include <iostream>

#include "runtime/error.h"
#include "runtime/runtime_info.h"

int main(int argc, char** argv) {
  CLI::App app{"sluice: runs large diffusion transformers on GPUs too small to hold them"};
  app.set_version_flag("--version", sluice::version_string());
  app.require_subcommand(0, 1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::cout << sluice::version_string() << "\n";
  return 0;
}
