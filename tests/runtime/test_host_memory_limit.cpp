// The host memory limit (runtime/host_memory_limit.h, Note [host memory limit]) on fake
// cgroup trees (SLUICE_CGROUP_ROOT, tests/support/fake_cgroup.h): cgroup v2 (the process's own
// cgroup, a smaller limit on a parent, "max"), cgroup v1 (a limit, the kernel's "no limit"
// value), no cgroup file at all, a container whose own cgroup is mounted at the mount point,
// mount points from mountinfo, malformed files (one warning naming the file, the next source
// used), MemAvailable below the cgroup's limit; and the defaults taken from it: the RAM
// tier's limit, the pinned arena's cap and the CPU device's memory (so its `auto` budget),
// with a cgroup limit below the model: the load goes over the RAM limit with the existing
// single warning, which names the limit and that it came from the cgroup.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "cache/model_cache.h"
#include "cache/ram_tier.h"
#include "offload/device/cpu_device.h"
#include "offload/device/pinned_arena.h"
#include "offload/engine/vram_budget.h"
#include "runtime/host_memory.h"
#include "runtime/host_memory_limit.h"
#include "runtime/size_parse.h"
#include "tests/support/fake_cgroup.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using sluice::testing::CapturedWarnings;
using sluice::testing::FakeCgroupRoot;

namespace {

constexpr uint64_t MiB = uint64_t{1} << 20;
constexpr uint64_t GiB = uint64_t{1} << 30;

// A host of 16 GiB with 12 GiB available: neither is the smallest where a test's cgroup limit is below.
void roomy_meminfo(const FakeCgroupRoot& root) { root.meminfo(16 * GiB, 12 * GiB); }

// What MemAvailable allows: it plus what sluice's allocator holds now.
uint64_t allows(uint64_t mem_available) {
  return mem_available + static_cast<uint64_t>(std::max<int64_t>(host_memory_stats().current_bytes(), 0));
}

}  // namespace

TEST_CASE("host memory limit: cgroup v2 memory.max of the process's own cgroup is the limit") {
  FakeCgroupRoot root;
  roomy_meminfo(root);
  root.write("proc/self/cgroup", "0::/app.slice/job.service\n");
  root.write("sys/fs/cgroup/app.slice/job.service/memory.max", "2147483648\n");
  root.write("sys/fs/cgroup/app.slice/memory.max", "max\n");
  const HostMemoryLimit l = host_memory_limit();
  CHECK(l.bytes == 2 * GiB);
  CHECK(l.source == "cgroup v2 memory.max (" + root / "sys/fs/cgroup/app.slice/job.service" + ")");
  CHECK(l.physical_bytes == 16 * GiB);  // the fake meminfo's MemTotal
  REQUIRE(l.cgroup_bytes);
  CHECK(*l.cgroup_bytes == 2 * GiB);
  CHECK(l.mem_available_bytes == std::optional<uint64_t>(12 * GiB));
  CHECK(l.capacity_bytes() == 2 * GiB);
  CHECK(l.capacity_source() == l.source);
  CHECK(l.describe() == "2.0GiB from " + l.source);
}

TEST_CASE("host memory limit: a smaller cgroup v2 limit on a parent wins over the process's own") {
  FakeCgroupRoot root;
  roomy_meminfo(root);
  root.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  root.write("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n");      // the container sets none
  root.write("sys/fs/cgroup/kubepods/pod1/memory.max", "1073741824\n");   // the pod does
  root.write("sys/fs/cgroup/kubepods/memory.max", "8589934592\n");        // a larger one above
  const HostMemoryLimit l = host_memory_limit();
  CHECK(l.bytes == 1 * GiB);
  CHECK(l.source == "cgroup v2 memory.max (" + root / "sys/fs/cgroup/kubepods/pod1" + ")");
}

TEST_CASE("host memory limit: cgroup v2 max everywhere is no limit: physical RAM") {
  FakeCgroupRoot root;
  root.meminfo(16 * GiB, 16 * GiB);  // all of it available: physical RAM is the smallest (ties go to it)
  root.write("proc/self/cgroup", "0::/user.slice\n");
  root.write("sys/fs/cgroup/user.slice/memory.max", "max\n");
  const HostMemoryLimit l = host_memory_limit();
  CHECK(l.bytes == 16 * GiB);
  CHECK(l.source == "physical RAM");
  CHECK_FALSE(l.cgroup_bytes);
  CHECK(l.capacity_bytes() == 16 * GiB);
}

TEST_CASE("host memory limit: cgroup v1 memory.limit_in_bytes of the memory controller's cgroup") {
  FakeCgroupRoot root;
  roomy_meminfo(root);
  // A hybrid host: v1 controllers and an empty v2 line (no memory.max there).
  root.write("proc/self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n");
  root.write("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "3221225472\n");
  root.write("sys/fs/cgroup/memory/docker/memory.limit_in_bytes", "9223372036854771712\n");
  root.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  root.mkdir("sys/fs/cgroup/unified");
  const HostMemoryLimit l = host_memory_limit();
  CHECK(l.bytes == 3 * GiB);
  CHECK(l.source == "cgroup v1 memory.limit_in_bytes (" + root / "sys/fs/cgroup/memory/docker/abc" + ")");
}

TEST_CASE("host memory limit: cgroup v1's unlimited value is no limit") {
  FakeCgroupRoot root;
  root.meminfo(16 * GiB, 16 * GiB);
  root.write("proc/self/cgroup", "4:memory:/process_api/x\n");
  root.write("sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes", "9223372036854771712\n");
  root.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  const HostMemoryLimit l = host_memory_limit();
  CHECK(l.source == "physical RAM");
  CHECK(l.bytes == 16 * GiB);
  CHECK_FALSE(l.cgroup_bytes);
}

TEST_CASE("host memory limit: no cgroup file at all leaves physical RAM and MemAvailable") {
  FakeCgroupRoot root;
  {
    root.meminfo(16 * GiB, 16 * GiB);
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.source == "physical RAM");
    CHECK(l.bytes == 16 * GiB);
    CHECK_FALSE(l.cgroup_bytes);
  }
  {
    // Nothing under the root at all: the machine's own RAM and /proc/meminfo.
    FakeCgroupRoot empty;
    CapturedWarnings warnings;
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.physical_bytes == physical_ram_bytes());
    CHECK_FALSE(l.cgroup_bytes);
    CHECK(l.bytes > 0);
    CHECK(l.bytes <= physical_ram_bytes());
    CHECK((l.source == "physical RAM" || l.source.rfind("MemAvailable (/proc/meminfo)", 0) == 0));
    CHECK(warnings.lines().empty());  // missing files are not errors
  }
}

TEST_CASE("host memory limit: a container's own cgroup mounted at the mount point, and mounts from mountinfo") {
  {
    // No cgroup namespace: /proc/self/cgroup names the host's path, but the container sees
    // only its own cgroup, mounted at /sys/fs/cgroup.
    FakeCgroupRoot root;
    roomy_meminfo(root);
    root.write("proc/self/cgroup", "0::/system.slice/docker-abc.scope\n");
    root.write("sys/fs/cgroup/memory.max", "536870912\n");
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.bytes == 512 * MiB);
    CHECK(l.source == "cgroup v2 memory.max (" + root / "sys/fs/cgroup" + ")");
  }
  {
    // A hybrid host: cgroup2 mounted at /sys/fs/cgroup/unified, as mountinfo says.
    FakeCgroupRoot root;
    roomy_meminfo(root);
    root.write("proc/self/mountinfo",
               "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
               "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
               "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n");
    root.write("proc/self/cgroup", "4:memory:/\n0::/job\n");
    root.write("sys/fs/cgroup/unified/job/memory.max", "805306368\n");
    root.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.bytes == 768 * MiB);
    CHECK(l.source == "cgroup v2 memory.max (" + root / "sys/fs/cgroup/unified/job" + ")");
  }
}

TEST_CASE("host memory limit: a malformed file is one warning naming it and the next source is used") {
  SECTION("memory.max") {
    FakeCgroupRoot root;
    root.meminfo(16 * GiB, 16 * GiB);
    root.write("proc/self/cgroup", "0::/app\n");
    root.write("sys/fs/cgroup/app/memory.max", "lots\n");
    CapturedWarnings warnings;
    HostMemoryLimit l;
    CHECK_NOTHROW(l = host_memory_limit());
    CHECK(l.source == "physical RAM");
    CHECK_FALSE(l.cgroup_bytes);
    const auto w = warnings.with(root / "sys/fs/cgroup/app/memory.max");
    REQUIRE(w.size() == 1);
    CHECK(w[0] == "host memory limit: " + root / "sys/fs/cgroup/app/memory.max" +
                      ": expected a byte count or \"max\", got 'lots'; ignoring it");
    host_memory_limit();  // read again: not said again
    CHECK(warnings.lines().size() == 1);
  }
  SECTION("memory.limit_in_bytes, and a parent's limit still applies") {
    FakeCgroupRoot root;
    roomy_meminfo(root);
    root.write("proc/self/cgroup", "4:memory:/a/b\n");
    root.write("sys/fs/cgroup/memory/a/b/memory.limit_in_bytes", "-1\n");
    root.write("sys/fs/cgroup/memory/a/memory.limit_in_bytes", "4294967296\n");
    CapturedWarnings warnings;
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.bytes == 4 * GiB);
    CHECK(l.source == "cgroup v1 memory.limit_in_bytes (" + root / "sys/fs/cgroup/memory/a" + ")");
    CHECK(warnings.with(root / "sys/fs/cgroup/memory/a/b/memory.limit_in_bytes").size() == 1);
  }
  SECTION("/proc/self/cgroup") {
    FakeCgroupRoot root;
    root.meminfo(16 * GiB, 16 * GiB);
    root.write("proc/self/cgroup", "this is not a cgroup file\n");
    root.write("sys/fs/cgroup/memory.max", "1073741824\n");
    CapturedWarnings warnings;
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.source == "physical RAM");
    CHECK(warnings.with(root / "proc/self/cgroup").size() == 1);
  }
  SECTION("MemAvailable, and a limit of 0") {
    FakeCgroupRoot root;
    root.write("proc/meminfo", "MemTotal:       16777216 kB\nMemAvailable:   plenty\n");
    root.write("proc/self/cgroup", "0::/app\n");
    root.write("sys/fs/cgroup/app/memory.max", "0\n");
    CapturedWarnings warnings;
    const HostMemoryLimit l = host_memory_limit();
    CHECK(l.source == "physical RAM");
    CHECK(l.bytes == 16 * GiB);
    CHECK_FALSE(l.mem_available_bytes);
    CHECK_FALSE(l.cgroup_bytes);
    CHECK(warnings.with(root / "proc/meminfo").size() == 1);
    CHECK(warnings.with(root / "sys/fs/cgroup/app/memory.max").size() == 1);
    CHECK(warnings.lines().size() == 2);
  }
}

TEST_CASE("host memory limit: MemAvailable below the cgroup limit caps it, with what sluice holds counted") {
  FakeCgroupRoot root;
  root.meminfo(16 * GiB, 1 * GiB);
  root.write("proc/self/cgroup", "0::/app\n");
  root.write("sys/fs/cgroup/app/memory.max", "8589934592\n");
  const at::Tensor held = host_empty({64 * static_cast<int64_t>(MiB)}, at::kByte);  // sluice's own memory
  const HostMemoryLimit l = host_memory_limit();
  CHECK(l.bytes == allows(1 * GiB));
  CHECK(l.bytes >= 1 * GiB + 64 * MiB);
  CHECK(l.sluice_host_bytes >= 64 * MiB);
  CHECK(l.source.rfind("MemAvailable (" + root / "proc/meminfo" + ") plus the ", 0) == 0);
  CHECK(l.source.find(" sluice holds") != std::string::npos);
  // The capacity (the CPU device's total, the "RAM" of a percentage) is not capped by it.
  CHECK(l.capacity_bytes() == 8 * GiB);
  CHECK(l.capacity_source() == "cgroup v2 memory.max (" + root / "sys/fs/cgroup/app" + ")");
}

TEST_CASE("host memory limit: the defaults come from it and never exceed it") {
  // The rules, on a limit L.
  CHECK(cache::default_ram_limit(64 * GiB) == 30 * GiB);  // max(4GiB, L/2 - 2GiB)
  CHECK(cache::default_ram_limit(16 * GiB) == 6 * GiB);
  CHECK(cache::default_ram_limit(8 * GiB) == 4 * GiB);   // the 4 GiB floor
  CHECK(cache::default_ram_limit(2 * GiB) == 2 * GiB);   // but never above the limit itself
  CHECK(cache::default_ram_limit(0) == 4 * GiB);         // unknown: the floor, as before
  CHECK(offload::default_pin_memory_limit(16 * GiB) == 8 * GiB);  // min(L/2, L - 4GiB)
  CHECK(offload::default_pin_memory_limit(6 * GiB) == 2 * GiB);
  CHECK(offload::default_pin_memory_limit(4 * GiB) == 0);

  // From a container's limit: the defaults, the CPU device's memory and its `auto` budget.
  FakeCgroupRoot root;
  roomy_meminfo(root);
  root.write("proc/self/cgroup", "0::/ctr\n");
  root.write("sys/fs/cgroup/ctr/memory.max", "6442450944\n");  // 6 GiB
  const std::string cg = "cgroup v2 memory.max (" + root / "sys/fs/cgroup/ctr" + ")";
  const offload::PinLimit pin = offload::default_pin_memory_limit();
  CHECK(pin.bytes == 2 * GiB);
  CHECK(pin.source == "default min(L / 2, L - 4GiB) of the host memory limit L = 6.0GiB from " + cg);
  const cache::RamLimit ram = cache::default_ram_limit(host_memory_limit());
  CHECK(ram.bytes == 4 * GiB);
  CHECK(ram.source.find("L = 6.0GiB from " + cg) != std::string::npos);

  auto dev = offload::make_cpu_device();
  CHECK(dev->memory_info().total_bytes == static_cast<int64_t>(6 * GiB));
  CHECK(dev->memory_info().free_bytes == static_cast<int64_t>(6 * GiB));
  const offload::ResolvedVramBudget b = offload::resolve_vram_budget(*dev, "auto", "");
  CHECK(b.bytes == 6 * GiB - std::max<uint64_t>(512 * MiB, 6 * GiB / 20));
  CHECK(b.how.find("free 6.0GiB") != std::string::npos);
  // MemAvailable below the container's limit: the free memory, so `auto`, follows it.
  root.meminfo(16 * GiB, 3 * GiB);
  CHECK(dev->memory_info().total_bytes == static_cast<int64_t>(6 * GiB));
  CHECK(dev->memory_info().free_bytes == static_cast<int64_t>(3 * GiB));
  CHECK(offload::resolve_vram_budget(*dev, "auto", "").bytes == 3 * GiB - std::max<uint64_t>(512 * MiB, 6 * GiB / 20));
}

TEST_CASE("host memory limit: a cgroup limit below the model goes over the RAM limit with one warning naming it") {
  cache::LoadSpec spec;
  spec.source = "anima-tiny";
  spec.seed = 1;
  spec.storage.storage = at::kFloat8_e4m3fn;
  spec.storage.compute = at::kBFloat16;
  spec.max_resident = 0.0;  // every streamable layer streams, so the pinned arena is asked too
  const uint64_t model = cache::estimate_model_bytes(spec, at::kCPU);
  const uint64_t limit = model / 2 / 4096 * 4096;
  REQUIRE(limit > 0);

  FakeCgroupRoot root;
  roomy_meminfo(root);
  root.write("proc/self/cgroup", "0::/small\n");
  root.write("sys/fs/cgroup/small/memory.max", std::to_string(limit) + "\n");
  const std::string cg = "cgroup v2 memory.max (" + root / "sys/fs/cgroup/small" + ")";

  cache::CacheOptions o;
  offload::CpuDeviceOptions d;
  d.total_memory = 1 * GiB;  // the device is not what this test is about
  o.device = offload::make_cpu_device(d);
  o.vram_budget = 512 * MiB;
  o.working_memory = 1 * MiB;
  o.pin = offload::PinMode::on;
  // ram_limit and pin_memory_limit unset: the defaults, from the host memory limit.
  CapturedWarnings warnings;
  auto cache = cache::ModelCache::create(o);
  const cache::CacheStats s0 = cache->stats();
  CHECK(s0.host_memory_limit_bytes == limit);
  CHECK(s0.host_memory_limit_source == cg);
  CHECK(s0.ram_limit_bytes == limit);  // min(L, max(4GiB, ...)): the limit itself, not InvokeAI's 4 GiB floor
  CHECK(s0.pin_limit_bytes == 0);      // L <= 4 GiB: nothing pinned unless asked

  // As with any RAM limit too small for the model: it is read all the same, over the limit,
  // with one warning, which now says where the limit came from.
  auto e = cache->load(spec);
  CHECK(cache->entry_state(e).in_ram);
  const auto ram_warn = warnings.with("RAM limit ");
  REQUIRE(ram_warn.size() == 1);
  INFO(ram_warn[0]);
  CHECK(ram_warn[0].rfind("RAM limit " + format_mib(limit) + " (default min(L, max(4GiB, L / 2 - 2GiB)) of the "
                          "host memory limit L = " + format_bytes(limit) + " from " + cg + ") exceeded: ",
                          0) == 0);
  // Its streamed layers stay pageable, with the pinned arena's one warning naming its cap's source.
  const auto pin_warn = warnings.with("pinned memory limit of ");
  REQUIRE(pin_warn.size() == 1);
  INFO(pin_warn[0]);
  CHECK(pin_warn[0].find("pinned memory limit of " + format_mib(0) + " (default min(L / 2, L - 4GiB) of the host memory limit L = " +
                         format_bytes(limit) + " from " + cg + ") reached") != std::string::npos);

  // The stats JSON names the limit and where it came from, for the cache and the model.
  const nlohmann::json c = nlohmann::json::parse(cache->stats_json());
  CHECK(c.at("host_memory_limit").at("bytes").get<uint64_t>() == limit);
  CHECK(c.at("host_memory_limit").at("source").get<std::string>() == cg);
  CHECK(c.at("host_memory_limit").at("cgroup_bytes").get<uint64_t>() == limit);
  CHECK(c.at("host_memory_limit").at("physical_bytes").get<uint64_t>() == 16 * GiB);
  CHECK(c.at("ram_limit_bytes").get<uint64_t>() == limit);
  CHECK(c.at("ram_limit_source").get<std::string>().find(cg) != std::string::npos);
  CHECK(c.at("pin_limit_source").get<std::string>().find(cg) != std::string::npos);
  const nlohmann::json m = nlohmann::json::parse(cache->model_stats_json(e));
  CHECK(m.at("host_memory_limit").at("bytes").get<uint64_t>() == limit);
  CHECK(m.at("host_memory_limit").at("source").get<std::string>() == cg);
  CHECK(m.at("cache").at("host_memory_limit") == c.at("host_memory_limit"));
}

TEST_CASE("host memory limit: limits given explicitly are not capped and say so") {
  FakeCgroupRoot root;
  roomy_meminfo(root);
  root.write("proc/self/cgroup", "0::/small\n");
  root.write("sys/fs/cgroup/small/memory.max", "1073741824\n");
  cache::CacheOptions o;
  offload::CpuDeviceOptions d;
  d.total_memory = 1 * GiB;
  o.device = offload::make_cpu_device(d);
  o.vram_budget = 512 * MiB;
  o.working_memory = 1 * MiB;
  o.ram_limit = 3 * GiB;
  o.pin_memory_limit = 2 * GiB;
  auto cache = cache::ModelCache::create(o);
  const cache::CacheStats s = cache->stats();
  CHECK(s.ram_limit_bytes == 3 * GiB);
  CHECK(s.ram_limit_source.empty());
  CHECK(s.pin_limit_bytes == 2 * GiB);
  CHECK(s.pin_limit_source.empty());
  CHECK(s.host_memory_limit_bytes == 1 * GiB);  // still reported
  const nlohmann::json c = nlohmann::json::parse(cache->stats_json());
  CHECK(c.at("ram_limit_source") == "given");
  CHECK(c.at("pin_limit_source") == "given");
}
