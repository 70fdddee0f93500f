#pragma once
// A fake filesystem root for the host memory limit (runtime/host_memory_limit.h, Note [host
// memory limit]): a temporary folder with the files a test writes (proc/self/cgroup,
// sys/fs/cgroup/..., proc/meminfo), named by SLUICE_CGROUP_ROOT while the object lives (the
// `sluice` binaries a test starts meanwhile inherit it). The variable's previous value comes
// back and the folder is removed when it goes.
#include <catch2/catch.hpp>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/logging.h"

namespace sluice::testing {

class FakeCgroupRoot {
 public:
  FakeCgroupRoot() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/sluice_cgroup_XXXXXX";
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
    if (const char* was = std::getenv("SLUICE_CGROUP_ROOT")) had_ = true, was_ = was;
    setenv("SLUICE_CGROUP_ROOT", path_.c_str(), 1);
  }
  ~FakeCgroupRoot() {
    had_ ? setenv("SLUICE_CGROUP_ROOT", was_.c_str(), 1) : unsetenv("SLUICE_CGROUP_ROOT");
    // POSIX only: the torch wheel's std::filesystem symbols crash here
    // (tests/support/cli_runner.h).
    nftw(
        path_.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  FakeCgroupRoot(const FakeCgroupRoot&) = delete;
  FakeCgroupRoot& operator=(const FakeCgroupRoot&) = delete;

  const std::string& path() const { return path_; }
  // `rel` ("sys/fs/cgroup/app") under the root, as the limit's source names it.
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

  // Writes `text` to `rel` under the root, making its folders.
  void write(const std::string& rel, const std::string& text) const {
    std::string dir = path_;
    size_t start = 0;
    for (size_t slash; (slash = rel.find('/', start)) != std::string::npos; start = slash + 1) {
      dir += "/" + rel.substr(start, slash - start);
      ::mkdir(dir.c_str(), 0755);
    }
    std::ofstream out(path_ + "/" + rel, std::ios::binary);
    out << text;
    REQUIRE(out.good());
  }
  void mkdir(const std::string& rel) const { write(rel + "/.keep", ""); }

  // proc/meminfo with MemTotal and MemAvailable (bytes, written in kB as the kernel does).
  void meminfo(uint64_t total, uint64_t available) const {
    write("proc/meminfo", "MemTotal:       " + std::to_string(total / 1024) +
                              " kB\nMemFree:         1024 kB\nMemAvailable:   " + std::to_string(available / 1024) +
                              " kB\nBuffers:          512 kB\n");
  }

 private:
  std::string path_;
  std::string was_;
  bool had_ = false;
};

// The warnings logged while the object lives (into a sink; Note [log sink]).
class CapturedWarnings {
 public:
  CapturedWarnings() {
    log::set_sink([this](log::Level level, const std::string& m) {
      if (level != log::Level::warn) return;
      std::lock_guard<std::mutex> g(mutex_);
      lines_.push_back(m);
    });
  }
  ~CapturedWarnings() { log::set_sink({}); }
  CapturedWarnings(const CapturedWarnings&) = delete;
  CapturedWarnings& operator=(const CapturedWarnings&) = delete;

  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> g(mutex_);
    return lines_;
  }
  // The warnings that contain `part`.
  std::vector<std::string> with(const std::string& part) const {
    std::vector<std::string> out;
    for (const auto& l : lines()) {
      if (l.find(part) != std::string::npos) out.push_back(l);
    }
    return out;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;
};

}  // namespace sluice::testing
