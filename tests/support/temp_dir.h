#pragma once
// A scratch folder per test case under $TMPDIR (else /tmp), removed with everything in it
// when the case ends, pass or fail: `TempDir dir; write(dir / "model.safetensors")`.
// POSIX calls only: the torch wheel exports its own std::filesystem symbols, which crash
// when called from code built against the system libstdc++ (remove_all segfaults).
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <ftw.h>
#include <string>
#include <unistd.h>

namespace sluice::testing {

inline std::string temp_root() {
  const char* t = std::getenv("TMPDIR");
  return (t != nullptr && *t != '\0') ? t : "/tmp";
}

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = temp_root() + "/sluice_test_XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    // Depth first, without following links: files and sub-folders, then the folder itself.
    // A failed removal is not an error here: the case's own checks have run.
    const auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) {
      std::remove(p);
      return 0;  // go on with the rest
    };
    ::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

}  // namespace sluice::testing
