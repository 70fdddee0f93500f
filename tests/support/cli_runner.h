#pragma once
// Runs the built `sluice` binary from Catch2 tests (SLUICE_CLI_PATH) and checks the CLI's
// error contract. Shared by test_cli.cpp and test_run.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <iterator>
#include <spawn.h>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "tests/support/temp_dir.h"  // TempDir, temp_root

extern char** environ;

namespace sluice::testing {

struct Result {
  int status = -1;  // exit code; -1 when killed by a signal
  std::string out;
  std::string err;
};

// POSIX file helpers: the torch wheel exports its own std::filesystem symbols, which
// crash when called from code built against the system libstdc++ (remove_all segfaults).
inline std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// Runs the sluice binary with `args`, capturing stdout and stderr through files. The
// environment is ours minus SLUICE_LOG_LEVEL, so the CLI's own defaults are what is tested.
inline Result run_cli(const std::vector<std::string>& args) {
  static int counter = 0;
  const std::string base =
      temp_root() + "/sluice_test_cli_" + std::to_string(getpid()) + "_" + std::to_string(counter++);
  const std::string out_path = base + ".out", err_path = base + ".err";
  std::vector<std::string> argv_s{SLUICE_CLI_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string(*e).rfind("SLUICE_LOG_LEVEL=", 0) != 0) env_s.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE(rc == 0);
  int wstatus = 0;
  REQUIRE(waitpid(pid, &wstatus, 0) == pid);
  Result r;
  r.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  ::unlink(out_path.c_str());
  ::unlink(err_path.c_str());
  return r;
}

// Runs the sluice binary on a pseudo-terminal (util-linux `script`, in Debian's essential
// bsdutils), as a person at a terminal would: stdout and stderr both go to the terminal and
// come back together in `out` (with its "\r\n" line ends). `env` is added to ours.
inline Result run_cli_tty(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  const auto quote = [](const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::string cmd;
  for (const auto& e : env) cmd += e + " ";
  cmd += quote(SLUICE_CLI_PATH);
  for (const auto& a : args) cmd += " " + quote(a);
  static int counter = 0;
  const std::string out_path =
      temp_root() + "/sluice_test_tty_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".out";
  std::vector<std::string> argv_s{"/usr/bin/script", "-q", "-e", "-c", cmd, "/dev/null"};
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string(*e).rfind("SLUICE_LOG_LEVEL=", 0) != 0 && std::string(*e).rfind("TERM=", 0) != 0)
      env_s.emplace_back(*e);
  env_s.emplace_back("TERM=xterm");
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE(rc == 0);  // /usr/bin/script is there (bsdutils is essential)
  int wstatus = 0;
  REQUIRE(waitpid(pid, &wstatus, 0) == pid);
  Result r;
  r.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
  r.out = slurp(out_path);
  ::unlink(out_path.c_str());
  return r;
}

inline std::string describe(const std::vector<std::string>& args, const Result& r) {
  std::string cmd = "sluice";
  for (const auto& a : args) cmd += " " + a;
  return cmd + "\n  exit " + std::to_string(r.status) + "\n  stdout: " + r.out + "\n  stderr: " + r.err;
}

inline Result run_ok(const std::vector<std::string>& args) {
  Result r = run_cli(args);
  INFO(describe(args, r));
  REQUIRE(r.status == 0);
  return r;
}

// The error contract: the given exit status, nothing on stdout, and stderr exactly one
// line "sluice: error: ..." that mentions every string in `names`.
inline void expect_error(const std::vector<std::string>& args, int status, const std::vector<std::string>& names) {
  const Result r = run_cli(args);
  INFO(describe(args, r));
  CHECK(r.status == status);
  CHECK(r.out.empty());
  REQUIRE(!r.err.empty());
  CHECK(r.err.rfind("sluice: error: ", 0) == 0);
  CHECK(r.err.back() == '\n');
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  for (const auto& n : names) CHECK(r.err.find(n) != std::string::npos);
  CHECK(r.err.find("Exception raised from") == std::string::npos);  // no torch backtrace
}

}  // namespace sluice::testing
