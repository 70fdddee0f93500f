// How --vram-budget and --vram-headroom resolve (offload/engine/vram_budget.h, Note [vram
// budget]) against device memory the test controls: sizes, percentages of the total,
// "auto" (free minus headroom), headroom sizes and percentages, and the errors. Also that
// the CPU device reports what its memory source says, and the stats JSON's device fields.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <string>

#include "offload/device/cpu_device.h"
#include "offload/device/device.h"
#include "offload/report/stats.h"
#include "offload/engine/vram_budget.h"
#include "runtime/error.h"
#include "runtime/host_memory_limit.h"

using namespace sluice::offload;
using Memory = DeviceBackend::DeviceMemoryInfo;

namespace {

constexpr int64_t MiB = 1 << 20;
constexpr int64_t GiB = int64_t{1} << 30;

uint64_t resolve(const std::string& spec, const std::string& headroom, Memory m) {
  return resolve_vram_budget(spec, headroom, m).bytes;
}

std::string error_of(const std::string& spec, const std::string& headroom, Memory m) {
  try {
    resolve_vram_budget(spec, headroom, m);
  } catch (const sluice::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("vram budget: sizes are taken as given and percentages are of the total memory") {
  const Memory m{4 * GiB, 16 * GiB};  // most of the device held by someone else
  CHECK(resolve("6GiB", "", m) == static_cast<uint64_t>(6 * GiB));
  CHECK(resolve("6GB", "", m) == 6000000000ull);
  CHECK(resolve("8G", "", m) == static_cast<uint64_t>(8 * GiB));
  CHECK(resolve("12345", "", m) == 12345u);
  CHECK(resolve_vram_budget("6GiB", "", m).how.empty());
  // Of the total, not of the free memory.
  CHECK(resolve("50%", "", m) == static_cast<uint64_t>(8 * GiB));
  CHECK(resolve("12.5%", "", m) == static_cast<uint64_t>(2 * GiB));
  CHECK(resolve_vram_budget("50%", "", m).how == "50% of total 16.0GiB = 8.0GiB");
}

TEST_CASE("vram budget: auto is the free memory minus the default headroom, max(512MiB, 5% of total)") {
  // 5% of 16 GiB is 819.2 MiB: above the 512 MiB floor.
  const Memory big{10 * GiB, 16 * GiB};
  const uint64_t five_percent = static_cast<uint64_t>(16 * GiB) / 20;
  CHECK(resolve("auto", "", big) == static_cast<uint64_t>(10 * GiB) - five_percent);
  CHECK(resolve(" AUTO ", "", big) == static_cast<uint64_t>(10 * GiB) - five_percent);
  const ResolvedVramBudget r = resolve_vram_budget("auto", "", big);
  INFO(r.how);
  CHECK(r.how.rfind("auto: free 10.0GiB - headroom 819.2MiB", 0) == 0);
  CHECK(r.how.find("default") != std::string::npos);
  CHECK(r.how.find("= 9.2GiB") != std::string::npos);
  // 5% of 4 GiB is 204.8 MiB: the 512 MiB floor applies.
  CHECK(resolve("auto", "", Memory{3 * GiB, 4 * GiB}) == static_cast<uint64_t>(3 * GiB - 512 * MiB));
  CHECK(kDefaultVramHeadroomMin == static_cast<uint64_t>(512 * MiB));
}

TEST_CASE("vram budget: an explicit headroom is a size or a percentage of the total") {
  const Memory m{10 * GiB, 16 * GiB};
  CHECK(resolve("auto", "1GiB", m) == static_cast<uint64_t>(9 * GiB));
  CHECK(resolve("auto", "0", m) == static_cast<uint64_t>(10 * GiB));
  CHECK(resolve("auto", "25%", m) == static_cast<uint64_t>(6 * GiB));  // 25% of 16, not of 10
  const ResolvedVramBudget r = resolve_vram_budget("auto", "25%", m);
  CHECK(r.how == "auto: free 10.0GiB - headroom 4.0GiB (25% of total) = 6.0GiB");
}

TEST_CASE("vram budget: impossible values are one-line errors naming the flag") {
  const Memory m{2 * GiB, 16 * GiB};
  // A headroom that leaves nothing of the free memory.
  std::string e = error_of("auto", "2GiB", m);
  CHECK(e.find("--vram-budget auto") != std::string::npos);
  CHECK(e.find("--vram-headroom '2GiB'") != std::string::npos);
  CHECK(e.find("2.0GiB free") != std::string::npos);
  CHECK(e.find('\n') == std::string::npos);
  e = error_of("auto", "", Memory{300 * MiB, 4 * GiB});  // the default headroom is 512 MiB
  CHECK(e.find("the default; set --vram-headroom") != std::string::npos);
  CHECK(error_of("auto", "100%", m).find("--vram-headroom") != std::string::npos);
  // Malformed values name their flag and value.
  e = error_of("auto", "lots", m);
  CHECK(e.find("--vram-headroom") != std::string::npos);
  CHECK(e.find("lots") != std::string::npos);
  CHECK(error_of("automatic", "", m).find("--vram-budget: invalid size 'automatic'") != std::string::npos);
  CHECK(error_of("150%", "", m).find("more than 100%") != std::string::npos);
  CHECK(error_of("auto", "101%", m).find("--vram-headroom") != std::string::npos);
  // Zero and headroom without auto.
  CHECK(error_of("0", "", m) == "--vram-budget: must be positive, got '0'");
  CHECK(error_of("0%", "", m).find("must be positive") != std::string::npos);
  CHECK(error_of("6GiB", "1GiB", m).find("--vram-headroom: only applies to --vram-budget auto") != std::string::npos);
  // A device whose memory is unknown: percentages and auto cannot be resolved, sizes can.
  const Memory unknown{0, 0};
  CHECK(error_of("auto", "", unknown).find("memory of the device is unknown") != std::string::npos);
  CHECK(error_of("50%", "", unknown).find("percentage needs a known total") != std::string::npos);
  CHECK(resolve("1GiB", "", unknown) == static_cast<uint64_t>(GiB));
  // Other flag names (the API's option names) are used as given.
  CHECK(error_of("auto", "", unknown).rfind("--vram-budget", 0) == 0);
  try {
    resolve_vram_budget("auto", "9GiB", m, "vram_budget", "vram_headroom");
    FAIL("no error");
  } catch (const sluice::InvalidArgument& ex) {
    CHECK(std::string(ex.what()).find("vram_headroom '9GiB'") != std::string::npos);
  }
}

TEST_CASE("vram budget: cpu device: memory_info comes from the memory source when one is given") {
  Memory now{3 * GiB, 8 * GiB};
  CpuDeviceOptions o;
  o.total_memory = 123;  // ignored: the source decides
  o.memory_source = [&] { return now; };
  auto dev = make_cpu_device(o);
  CHECK(dev->memory_info().free_bytes == 3 * GiB);
  CHECK(dev->memory_info().total_bytes == 8 * GiB);
  CHECK(dev->total_memory() == static_cast<uint64_t>(8 * GiB));
  now.free_bytes = 1 * GiB;  // another process took memory
  CHECK(dev->memory_info().free_bytes == 1 * GiB);
  // "auto" on the device reads it now; with nothing held by sluice, free is the source's.
  CHECK(resolve_vram_budget(*dev, "auto", "256MiB").bytes == static_cast<uint64_t>(GiB - 256 * MiB));
  // A percentage is of the total, clamped to the free memory plus what sluice holds.
  CHECK(resolve_vram_budget(*dev, "10%", "").bytes == static_cast<uint64_t>(8 * GiB / 10));
  const ResolvedVramBudget half = resolve_vram_budget(*dev, "50%", "");
  CHECK(half.bytes == static_cast<uint64_t>(GiB));
  CHECK(half.how.find("clamped to the free") != std::string::npos);
  // What sluice already holds on the device counts as free for its own budget.
  at::Tensor held = dev->allocate({64 * MiB}, at::kByte, MemoryKind::resident, "held");
  CHECK(resolve_vram_budget(*dev, "50%", "").bytes == static_cast<uint64_t>(GiB + 64 * MiB));
  const ResolvedVramBudget r = resolve_vram_budget(*dev, "auto", "256MiB");
  CHECK(r.bytes == static_cast<uint64_t>(GiB + 64 * MiB - 256 * MiB));
  CHECK(r.how.find("64.0MiB sluice holds") != std::string::npos);
  CHECK(r.how.find("on cpu") != std::string::npos);
  // The CPU device counts what it hands out (here: `held`).
  CHECK(dev->allocator_stats().available);
  CHECK(dev->allocator_stats().current_bytes == 64 * MiB);
}

TEST_CASE("vram budget: cpu device: without a memory source, free memory is the total minus what its ledger holds") {
  CpuDeviceOptions o;
  o.total_memory = 100 * MiB;
  auto dev = make_cpu_device(o);
  CHECK(dev->memory_info().total_bytes == 100 * MiB);
  CHECK(dev->memory_info().free_bytes == 100 * MiB);
  at::Tensor t = dev->allocate({10 * MiB}, at::kByte, MemoryKind::ring, "slot");
  CHECK(dev->memory_info().free_bytes == 90 * MiB);
  // The held bytes are added back for auto: the budget does not shrink by what it holds.
  CHECK(resolve_vram_budget(*dev, "auto", "10%").bytes == static_cast<uint64_t>(90 * MiB));
  t = at::Tensor();
  CHECK(dev->memory_info().free_bytes == 100 * MiB);
  // Defaults to RAM as the process's container sees it (Note [host memory limit]).
  CHECK(make_cpu_device()->memory_info().total_bytes ==
        static_cast<int64_t>(sluice::host_memory_limit().capacity_bytes()));
  // An empty budget is "all of the device", and refuses a headroom.
  CHECK(resolve_vram_budget(*dev, "", "").bytes == 0);
  CHECK_THROWS_AS(resolve_vram_budget(*dev, "", "1GiB"), sluice::InvalidArgument);
}

TEST_CASE("vram budget: a size above the device's memory is refused naming the flag and the budget and the memory") {
  CpuDeviceOptions o;
  o.total_memory = 100 * MiB + 12345;
  auto dev = make_cpu_device(o);
  std::string e;
  try {
    resolve_vram_budget(*dev, "1GiB", "");
  } catch (const sluice::InvalidArgument& ex) {
    e = ex.what();
  }
  CHECK(e == "--vram-budget 1GiB (1.0GiB) is more than the 100.1MiB of memory of cpu: give at most 100.1MiB, a "
             "percentage of it or auto");
  // The memory as printed (rounded up) is the whole device; below it, a size is taken as given.
  const ResolvedVramBudget all = resolve_vram_budget(*dev, "100.1MiB", "");
  CHECK(all.bytes == static_cast<uint64_t>(100 * MiB + 12345));
  CHECK(all.how == "100.1MiB = all 100.1MiB of cpu");
  CHECK(resolve_vram_budget(*dev, "100MiB", "").bytes == static_cast<uint64_t>(100 * MiB));
  CHECK_THROWS_AS(resolve_vram_budget(*dev, "100.2MiB", ""), sluice::InvalidArgument);
}

TEST_CASE("vram budget: stats json: the device reports the ledger peak and the allocator's numbers only where it has them") {
  EngineStats s;
  s.device_memory.total.increase(1000);
  s.device_memory.total.decrease(400);
  auto j = nlohmann::json::parse(s.to_json());
  CHECK(j["device"]["ledger_peak_bytes"].get<int64_t>() == 1000);
  CHECK(j["device"]["peak_bytes"].get<int64_t>() == 1000);  // the older name, kept
  CHECK(j["device"]["current_bytes"].get<int64_t>() == 600);
  CHECK(j["device"]["allocator_stats"] == "unavailable");
  for (const char* k : {"allocator_current_bytes", "allocator_peak_bytes", "allocator_reserved_bytes"}) {
    REQUIRE(j["device"].contains(k));
    CHECK(j["device"][k].is_null());
  }
  s.allocator_stats_available = true;
  s.allocator_current_bytes = 700;
  s.allocator_peak_bytes = 1200;
  s.allocator_reserved_bytes = 2048;
  j = nlohmann::json::parse(s.to_json());
  CHECK(j["device"]["allocator_stats"] == "available");
  CHECK(j["device"]["allocator_current_bytes"].get<int64_t>() == 700);
  CHECK(j["device"]["allocator_peak_bytes"].get<int64_t>() == 1200);
  CHECK(j["device"]["allocator_reserved_bytes"].get<int64_t>() == 2048);
}
