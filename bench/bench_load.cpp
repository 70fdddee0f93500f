// sluice_bench_load: time-to-ready of an anima-2b-sized checkpoint, sluice against a raw
// read and against what a Python frontend does, in one run (issue 14's table).
//
// It writes a random checkpoint of the config (default anima-2b: bf16, ~4.2 GB) and its fp8
// twin (`sluice convert`), then, with both files warm in the page cache, times three cases:
//   bf16 -> fp8    the bf16 file into float8_e4m3fn storage (cast as read)
//   bf16 -> bf16   the bf16 file into bfloat16 storage (no cast)
//   fp8 -> fp8     the converted file into float8_e4m3fn storage (no cast, byte check only)
// and, for each case and rep, five paths, each in a fresh child process so that no path
// reuses memory another one freed:
//   raw read       read() of the whole file into one reused 16 MiB buffer (what `cat` does)
//   fresh          the file read with sluice's threads and chunks into fresh memory of its
//                  size, one mapping (pages faulted in per chunk, as the fused read does),
//                  printed as sluice / fresh: for the fp8 file, the floor of a load into
//                  owned memory; for the bf16 file it measured slower than sluice's own
//                  bf16 -> bf16 load (docs/BENCHMARKS.md, "Load")
//   python         safetensors.torch.load_file, then .to(float8_e4m3fn) of each 2-d ".weight"
//                  when the storage is fp8, and .clone() of the rest, through the project
//                  venv's Python (SLUICE_PYTHON at configure time, or --python)
//   sluice         anima::load_anima(file, storage, device cpu): read, cast and checks
//                  into the final host storage, the load a ModelCache miss does
//   cache          ModelCache(device cpu).load(): the same plus attach to the CPU device,
//                  which copies every resident byte into the device's own memory
// and, in the bf16 -> fp8 case, once more per fp8 cast variant named by --fp8-isas:
//   sluice:ISA     the sluice path with SLUICE_FP8_ISA=ISA, i.e. the bf16 -> e4m3fn cast
//                  forced to that variant (runtime/fp8_kernels.h, Note [vectorized fp8
//                  loops]): sluice:avx2 on an AVX-512 machine measures what an AVX2-only
//                  CPU runs. Default: every variant this CPU runs but the one picked anyway.
// It prints the CPU (model, cores, vector extensions) and the fp8 cast variant first, then
// every time, the best of each, the ratios the issue's targets name (sluice ÷ raw
// read, sluice ÷ python) and each path's peak RSS: VmHWM at the end minus VmRSS before the
// load, against the final host storage (sluice: host_memory_stats; python: the bytes of the
// tensors it kept) plus one chunk per read thread.
//
//   sluice_bench_load [--config anima-2b] [--reps 3] [--threads 0] [--dir /tmp]
//                     [--python PATH] [--bf16 FILE] [--fp8 FILE] [--keep] [--paths raw,python,sluice,cache]
//                     [--cases bf16-fp8,bf16-bf16,fp8-fp8] [--fp8-isas all|none|avx2,...]
//
// --bf16/--fp8 reuse files written before (then nothing is generated or deleted); without
// the fp8-fp8 case no fp8 file is needed.
// Generated files are deleted at exit unless --keep. The targets (≤ 0.5× python and
// ≤ 1.5× raw for bf16 -> fp8, ≤ 1.2× raw for fp8 -> fp8, peak ≤ storage + a chunk per
// thread) are printed as met or not; they are benchmark goals, never test assertions.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cache/model_cache.h"
#include "models/anima/checkpoint.h"
#include "models/anima/config.h"
#include "models/anima/convert.h"
#include "models/anima/generator.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/fp8_kernels.h"
#include "runtime/fused_read.h"
#include "runtime/hardware.h"
#include "runtime/host_memory.h"

#ifndef SLUICE_BENCH_PYTHON
#define SLUICE_BENCH_PYTHON "python3"
#endif

using namespace sluice;

namespace {

using clock_type = std::chrono::steady_clock;
constexpr uint64_t MiB = 1ull << 20;

// ---- what a child measures --------------------------------------------------------

// A field of /proc/self/status in bytes (VmRSS, VmHWM).
uint64_t status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(key.size())) * 1024;
  }
  return 0;
}

// The line a child prints and the parent parses.
void report(double seconds, uint64_t rss_before, uint64_t storage) {
  std::printf("RESULT %.4f %llu %llu\n", seconds,
              static_cast<unsigned long long>(status_bytes("VmHWM") - std::min(rss_before, status_bytes("VmHWM"))),
              static_cast<unsigned long long>(storage));
  std::fflush(stdout);
}

Fp8Options storage_of(const std::string& storage) {
  Fp8Options o;
  o.storage = storage == "bfloat16" ? at::kBFloat16 : at::kFloat8_e4m3fn;
  o.compute = at::kBFloat16;
  return o;
}

int child(const std::string& path, const std::string& storage, const std::string& what, int threads) {
  if (what == "raw") {
    std::vector<char> buf(16 * MiB);
    const uint64_t before = status_bytes("VmRSS");
    const auto t0 = clock_type::now();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw FileError("cannot open '" + path + "'");
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    ::close(fd);
    report(std::chrono::duration<double>(clock_type::now() - t0).count(), before, 0);
    return 0;
  }
  if (what == "fresh") {
    // The floor of any load into memory the process owns: every file byte read with the
    // sluice path's threads and chunks straight into fresh memory, each chunk's pages
    // faulted in with one madvise first, as the fused read does; no cast, no checks.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw FileError("cannot open '" + path + "'");
    const auto size = static_cast<uint64_t>(::lseek(fd, 0, SEEK_END));
    const uint64_t before = status_bytes("VmRSS");
    const auto t0 = clock_type::now();
    at::Tensor dst = host_empty({static_cast<int64_t>(size)}, at::kByte);
    auto* base = static_cast<uint8_t*>(dst.data_ptr());
    const uint64_t chunk = safetensors::FusedReadOptions{}.chunk_bytes;
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    auto work = [&] {
      for (uint64_t off; (off = next.fetch_add(chunk)) < size;) {
        const uint64_t n = std::min(chunk, size - off);
        populate_pages(base + off, n);
        if (::pread(fd, base + off, n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) failed = true;
      }
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < safetensors::resolve_threads(threads); ++i) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    ::close(fd);
    if (failed) throw FileError("short read of '" + path + "'");
    report(s, before, size);
    return 0;
  }
  // libtorch's own start-up allocations happen before the baseline.
  (void)at::ones({8}, at::kBFloat16).sum().item<float>();
  const uint64_t before = status_bytes("VmRSS");
  if (what == "sluice") {
    anima::LoadOptions lo;
    lo.storage = storage_of(storage);
    lo.threads = threads;
    const auto t0 = clock_type::now();
    anima::AnimaModel model = anima::load_anima(path, lo);
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    report(s, before, static_cast<uint64_t>(host_memory_stats().current_bytes()));
    return 0;
  }
  if (what == "cache") {
    cache::CacheOptions co;
    co.load_threads = threads;
    auto cache = cache::ModelCache::create(co);
    cache::LoadSpec spec;
    spec.source = path;
    spec.storage = storage_of(storage);
    const auto t0 = clock_type::now();
    auto entry = cache->load(spec);
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    report(s, before, static_cast<uint64_t>(host_memory_stats().current_bytes()));
    return 0;
  }
  throw InvalidArgument("--child: unknown path '" + what + "'");
}

// The Python path, one process: prints the same RESULT line.
const char* kPythonScript = R"PY(
import sys, time
import torch, safetensors.torch as sft
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0
path, storage = sys.argv[1], sys.argv[2]
torch.ones(8, dtype=torch.bfloat16).sum().item()
before = status("VmRSS")
t0 = time.perf_counter()
out = {}
for k, v in sft.load_file(path).items():
    if storage.startswith("float8") and v.dim() == 2 and k.endswith(".weight") and v.element_size() > 1:
        out[k] = v.to(torch.float8_e4m3fn)
    else:
        out[k] = v.clone()
t = time.perf_counter() - t0
kept = sum(v.numel() * v.element_size() for v in out.values())
print("RESULT %.4f %d %d" % (t, max(0, status("VmHWM") - before), kept), flush=True)
)PY";

// ---- the parent -------------------------------------------------------------------

struct Sample {
  double seconds = 0;
  uint64_t peak = 0;     // VmHWM - VmRSS before the load
  uint64_t storage = 0;  // final storage bytes
};

// Runs argv (with `env` NAME=VALUE added to its environment), returns its RESULT line
// parsed, or an error string.
std::optional<Sample> run_child(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                                std::string& error) {
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    error = "pipe failed";
    return std::nullopt;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(out[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const auto at = text.rfind("RESULT ");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || at == std::string::npos) {
    error = argv[0] + " exited with status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return std::nullopt;
  }
  Sample s;
  unsigned long long peak = 0, storage = 0;
  if (std::sscanf(text.c_str() + at, "RESULT %lf %llu %llu", &s.seconds, &peak, &storage) != 3) {
    error = "unreadable result line";
    return std::nullopt;
  }
  s.peak = peak;
  s.storage = storage;
  return s;
}

std::vector<std::string> g_remove;  // generated files, deleted at exit
char g_remove_c[2][4096];

void remove_generated() {
  for (const auto& p : g_remove) ::unlink(p.c_str());
  g_remove.clear();
}

// Keeps the generated files: nothing is removed at exit or on a signal.
void forget_generated() {
  g_remove.clear();
  for (auto& p : g_remove_c) p[0] = 0;
}

void on_signal(int sig) {
  for (auto& p : g_remove_c) {
    if (p[0] != 0) ::unlink(p);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void remember(const std::string& path) {
  const size_t i = g_remove.size();
  g_remove.push_back(path);
  if (i < 2) std::snprintf(g_remove_c[i], sizeof g_remove_c[i], "%s", path.c_str());
}

void warm(const std::string& path) {
  std::vector<char> buf(16 * MiB);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError("cannot open '" + path + "'");
  while (::read(fd, buf.data(), buf.size()) > 0) {
  }
  ::close(fd);
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sluice_bench_load: checkpoint time-to-ready against a raw read and the safetensors+torch path"};
  std::string config_name = "anima-2b", dir = "/tmp", python = SLUICE_BENCH_PYTHON, bf16_file, fp8_file;
  std::string paths_arg = "raw,fresh,python,sluice,cache", cases_arg = "bf16-fp8,bf16-bf16,fp8-fp8", isas_arg = "all";
  int reps = 3, threads = 0;
  bool keep = false;
  std::vector<std::string> child_args;
  app.add_option("--config", config_name, "Model config of the generated checkpoint");
  app.add_option("--reps", reps, "Runs of each path and case")->check(CLI::Range(1, 100));
  app.add_option("--threads", threads, "sluice read workers (0: every core)")->check(CLI::Range(0, 1024));
  app.add_option("--dir", dir, "Where generated checkpoints go");
  app.add_option("--python", python, "Python with torch and safetensors");
  app.add_option("--bf16", bf16_file, "Use this bf16 checkpoint instead of generating one");
  app.add_option("--fp8", fp8_file, "Use this fp8 checkpoint instead of converting one");
  app.add_option("--paths", paths_arg, "Comma-separated subset of raw,fresh,python,sluice,cache");
  app.add_option("--cases", cases_arg, "Comma-separated subset of bf16-fp8,bf16-bf16,fp8-fp8");
  app.add_option("--fp8-isas", isas_arg,
                 "fp8 cast variants to force in extra sluice rows of bf16 -> fp8 (SLUICE_FP8_ISA): all (every one "
                 "this CPU runs but the default), none, or a comma-separated list");
  app.add_flag("--keep", keep, "Keep generated checkpoints");
  app.add_option("--child", child_args, "(internal) FILE STORAGE PATH: one timed load")->expected(3);
  CLI11_PARSE(app, argc, argv);
  try {
    if (!child_args.empty()) return child(child_args[0], child_args[1], child_args[2], threads);

    auto split = [](const std::string& list) {
      std::vector<std::string> out;
      std::stringstream ss(list);
      for (std::string p; std::getline(ss, p, ',');) out.push_back(p);
      return out;
    };
    std::vector<std::string> paths = split(paths_arg);
    for (const auto& p : paths) {
      if (p != "raw" && p != "fresh" && p != "python" && p != "sluice" && p != "cache") {
        throw InvalidArgument("--paths: unknown path '" + p + "' (raw, fresh, python, sluice, cache)");
      }
    }
    const std::vector<std::string> case_names = split(cases_arg);
    for (const auto& c : case_names) {
      if (c != "bf16-fp8" && c != "bf16-bf16" && c != "fp8-fp8") {
        throw InvalidArgument("--cases: unknown case '" + c + "' (bf16-fp8, bf16-bf16, fp8-fp8)");
      }
    }
    auto has_case = [&](const char* c) {
      return std::find(case_names.begin(), case_names.end(), c) != case_names.end();
    };
    // The fp8 cast variants: what runs by default, and the ones forced in rows of their own.
    namespace fk = fp8_kernels;
    const std::vector<fk::Isa> available = fk::available_isas();
    std::string available_names;
    for (const fk::Isa isa : available) {
      available_names += std::string(available_names.empty() ? "" : " ") + fk::isa_name(isa);
    }
    std::vector<std::string> forced;
    if (isas_arg == "all") {
      for (const fk::Isa isa : available) {
        if (isa != fk::active_isa()) forced.push_back(fk::isa_name(isa));
      }
    } else if (isas_arg != "none") {
      forced = split(isas_arg);
      for (const auto& f : forced) {
        if (std::none_of(available.begin(), available.end(), [&](fk::Isa isa) { return f == fk::isa_name(isa); })) {
          throw InvalidArgument("--fp8-isas: '" + f + "' is not a variant this CPU runs (" + available_names + ")");
        }
      }
    }
    if (std::find(paths.begin(), paths.end(), "sluice") == paths.end()) forced.clear();
    std::string forced_names;
    for (const auto& f : forced) forced_names += (forced_names.empty() ? "; forced in rows sluice:" : ", sluice:") + f;
    const char* env_isa = std::getenv("SLUICE_FP8_ISA");
    std::printf("cpu: %s\n", cpu_summary().c_str());
    std::printf("fp8 cast variant: %s (this CPU runs: %s; SLUICE_FP8_ISA %s)%s\n", fk::isa_name(fk::active_isa()),
                available_names.c_str(), env_isa ? env_isa : "unset", forced_names.c_str());
    std::fflush(stdout);
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    std::atexit(remove_generated);
    const anima::AnimaConfig config = anima::config_from_name_or_file(config_name);
    if (bf16_file.empty()) {
      bf16_file = dir + "/sluice_bench_load_" + std::to_string(::getpid()) + ".safetensors";
      remember(bf16_file);
      const auto t0 = clock_type::now();
      anima::write_random_checkpoint(config, 1, at::kBFloat16, bf16_file);
      std::printf("wrote %s (%s, bf16) in %.1f s\n", bf16_file.c_str(), config_name.c_str(),
                  std::chrono::duration<double>(clock_type::now() - t0).count());
    }
    if (fp8_file.empty() && has_case("fp8-fp8")) {
      fp8_file = dir + "/sluice_bench_load_" + std::to_string(::getpid()) + "_fp8.safetensors";
      remember(fp8_file);
      const auto t0 = clock_type::now();
      anima::convert_checkpoint(bf16_file, fp8_file, storage_of("float8_e4m3fn"), threads);
      std::printf("converted to %s in %.1f s\n", fp8_file.c_str(),
                  std::chrono::duration<double>(clock_type::now() - t0).count());
    }
    if (keep) forget_generated();
    const int workers = safetensors::resolve_threads(threads);
    const uint64_t chunk = safetensors::FusedReadOptions{}.chunk_bytes;
    std::printf("read threads %d, chunk %llu MiB, python %s, %d reps, a fresh process per load\n", workers,
                static_cast<unsigned long long>(chunk / MiB), python.c_str(), reps);

    struct Case {
      const char* name;
      std::string file, storage;
    };
    std::vector<Case> cases;
    if (has_case("bf16-fp8")) cases.push_back({"bf16 -> fp8", bf16_file, "float8_e4m3fn"});
    if (has_case("bf16-bf16")) cases.push_back({"bf16 -> bf16", bf16_file, "bfloat16"});
    if (has_case("fp8-fp8")) cases.push_back({"fp8 -> fp8", fp8_file, "float8_e4m3fn"});
    const std::string self = "/proc/self/exe";
    char exe[4096];
    const ssize_t n = ::readlink(self.c_str(), exe, sizeof exe - 1);
    const std::string me = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string(argv[0]);
    bool all_met = true;
    for (const Case& c : cases) {
      warm(c.file);
      std::map<std::string, std::vector<Sample>> got;
      std::map<std::string, std::string> failed;
      // This case's rows: the paths, then sluice with each forced cast variant (bf16 -> fp8).
      std::vector<std::string> rows = paths;
      if (std::string(c.name) == "bf16 -> fp8") {
        for (const auto& f : forced) rows.push_back("sluice:" + f);
      }
      for (int r = 0; r < reps; ++r) {
        for (const auto& p : rows) {
          std::vector<std::string> argv_child, env;
          if (p == "python") {
            argv_child = {python, "-c", kPythonScript, c.file, c.storage};
          } else if (p.rfind("sluice:", 0) == 0) {
            argv_child = {me, "--threads", std::to_string(threads), "--child", c.file, c.storage, "sluice"};
            env = {"SLUICE_FP8_ISA=" + p.substr(7)};
          } else {
            argv_child = {me, "--threads", std::to_string(threads), "--child", c.file, c.storage, p};
          }
          std::string error;
          if (auto s = run_child(argv_child, env, error)) {
            got[p].push_back(*s);
          } else {
            failed[p] = error;
          }
        }
      }
      std::printf("\n%s (%s, %.2f GB)\n", c.name, c.file.c_str(),
                  static_cast<double>(std::ifstream(c.file, std::ios::ate | std::ios::binary).tellg()) / 1e9);
      std::printf("  %-14s %-22s %8s %14s %14s\n", "path", "times (s)", "best", "peak RSS MiB", "storage MiB");
      std::map<std::string, double> best;
      for (const auto& p : rows) {
        if (failed.count(p)) {
          std::printf("  %-14s not measured: %s\n", p.c_str(), failed[p].c_str());
          continue;
        }
        std::string times;
        double b = 1e30;
        uint64_t peak = 0, storage = 0;
        for (const Sample& s : got[p]) {
          times += fmt("%.2f ", s.seconds);
          b = std::min(b, s.seconds);
          peak = std::max(peak, s.peak);
          storage = s.storage;
        }
        best[p] = b;
        std::printf("  %-14s %-22s %8.3f %14.0f %14.0f\n", p.c_str(), times.c_str(), b,
                    static_cast<double>(peak) / MiB, static_cast<double>(storage) / MiB);
        if (p == "sluice") {
          const uint64_t bound = storage + static_cast<uint64_t>(workers) * chunk;
          const bool met = peak <= bound;
          all_met &= met;
          std::printf("  peak RSS of sluice: %.0f MiB, storage + %d chunks = %.0f MiB: %s (%+.0f MiB)\n",
                      static_cast<double>(peak) / MiB, workers, static_cast<double>(bound) / MiB,
                      met ? "met" : "NOT met", (static_cast<double>(peak) - static_cast<double>(bound)) / MiB);
        }
      }
      auto ratio = [&](const char* what, const char* base, double target) {
        if (!best.count(what) || !best.count(base)) return;
        const double r = best[what] / best[base];
        if (target <= 0) {
          std::printf("  %s / %s = %.2f\n", what, base, r);
          return;
        }
        const bool met = r <= target;
        all_met &= met;
        std::printf("  %s / %s = %.2f (target <= %.2f: %s)\n", what, base, r, target, met ? "met" : "NOT met");
      };
      const std::string name = c.name;
      if (name == "bf16 -> fp8") {
        ratio("sluice", "python", 0.5);
        ratio("sluice", "raw", 1.5);
        for (const auto& f : forced) {
          const std::string row = "sluice:" + f;
          ratio(row.c_str(), "python", 0);
          ratio(row.c_str(), "sluice", 0);
        }
      } else if (name == "fp8 -> fp8") {
        ratio("sluice", "raw", 1.2);
      } else {
        ratio("sluice", "python", 0);
        ratio("sluice", "raw", 0);
      }
      ratio("sluice", "fresh", 0);
      if (best.count("cache") && best.count("sluice")) {
        std::printf("  cache / sluice = %.2f (attach to the CPU device)\n", best["cache"] / best["sluice"]);
      }
    }
    std::printf("\nTARGETS %s\n", all_met ? "all met" : "not all met");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sluice_bench_load: %s\n", e.what());
    return 1;
  }
}
