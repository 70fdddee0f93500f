// runtime/torch_compat: what differs between the torch versions sluice builds against
// (Note [torch compat]). The version-independent pieces are tested on every torch: the
// /proc/cpuinfo reader that stands in for torch's cpuinfo before torch 2.11.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "runtime/torch_compat.h"

namespace {

namespace fs = std::filesystem;

std::string write_cpuinfo(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / ("sluice_cpuinfo_" + name);
  std::ofstream(p) << text;
  return p.string();
}

}  // namespace

TEST_CASE("torch_compat: an x86 cpuinfo's flags are named as torch names them, from the first processor") {
  const std::string path = write_cpuinfo("x86",
                                         "processor\t: 0\n"
                                         "vendor_id\t: AuthenticAMD\n"
                                         "cpu family\t: 25\n"
                                         "model\t\t: 17\n"
                                         "model name\t: AMD EPYC 9R14 96-Core Processor\n"
                                         "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw "
                                         "avx512vl avx512_bf16 avx512_vnni amx_tile\n"
                                         "\n"
                                         "processor\t: 1\n"
                                         "cpu family\t: 26\n"
                                         "model\t\t: 2\n"
                                         "model name\t: another name\n"
                                         "flags\t\t: avx512_fp16\n");
  const sluice::torch_compat::CpuCapabilities caps = sluice::torch_compat::cpu_capabilities_from(path);
  CHECK(caps.name == "AMD EPYC 9R14 96-Core Processor");
  CHECK(caps.x86_family == "25");  // the first processor's, "model" not confused with "model name"
  CHECK(caps.x86_model == "17");
  for (const char* key : {"avx", "avx2", "fma3", "f16c", "avx512_f", "avx512_dq", "avx512_cd", "avx512_bw",
                          "avx512_vl", "avx512_bf16", "avx512_vnni", "amx_tile"}) {
    INFO(key);
    CHECK(caps.has(key));
  }
  CHECK_FALSE(caps.has("fma"));          // the kernel's name, not torch's
  CHECK_FALSE(caps.has("sse2"));         // not among the extensions sluice names
  CHECK_FALSE(caps.has("avx512_fp16"));  // only the first processor's flags are read
  CHECK(caps.flags.size() == 12);
  std::remove(path.c_str());
}

TEST_CASE("torch_compat: an Arm cpuinfo's Features are named as torch names them") {
  const std::string path = write_cpuinfo("arm", "processor\t: 0\nFeatures\t: fp asimd asimdhp asimddp i8mm bf16 sve "
                                                "sve2 svebf16 sme\nCPU implementer\t: 0x41\n");
  const auto caps = sluice::torch_compat::cpu_capabilities_from(path);
  for (const char* key : {"neon", "fp16_arith", "dot", "i8mm", "bf16", "sve", "sve2", "sve_bf16", "sme"}) {
    INFO(key);
    CHECK(caps.has(key));
  }
  CHECK(caps.flags.size() == 9);
  CHECK(caps.name.empty());  // Arm's cpuinfo has no model name
  CHECK(caps.x86_family.empty());
  CHECK(caps.x86_model.empty());
  std::remove(path.c_str());
}

TEST_CASE("torch_compat: a missing cpuinfo gives no name and no flags, and the architecture still") {
  const auto caps = sluice::torch_compat::cpu_capabilities_from("/nonexistent/sluice/cpuinfo");
  CHECK(caps.name.empty());
  CHECK(caps.flags.empty());
  CHECK_FALSE(caps.architecture.empty());  // from uname
}

TEST_CASE("torch_compat: this machine's cpuinfo agrees with the capabilities this torch reports") {
  const auto mine = sluice::torch_compat::cpu_capabilities();
  const auto from_proc = sluice::torch_compat::cpu_capabilities_from("/proc/cpuinfo");
  CHECK(mine.architecture == from_proc.architecture);
  if (from_proc.architecture == "x86_64") {
    // The extensions both the kernel and torch's cpuinfo report from the same cpuid bits.
    for (const char* key : {"avx", "avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_dq", "avx512_vl"}) {
      INFO(key);
      CHECK(mine.has(key) == from_proc.has(key));
    }
  }
}

TEST_CASE("torch_compat: the torch version the binary was built against reads as MAJOR.MINOR.PATCH") {
  CHECK(std::regex_match(sluice::torch_compat::built_torch_version(), std::regex("2\\.[0-9]+\\.[0-9]+")));
}
