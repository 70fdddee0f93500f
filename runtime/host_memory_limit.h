#pragma once
// How much host memory this process may count on: the one place every default host-memory
// limit comes from (the RAM tier's default limit, the pinned arena's default cap, the CPU
// device's memory and so its `auto` budget).
//
// Note [host memory limit]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The limit is the smallest of three numbers, each read afresh on every call:
//  - physical RAM (sysconf; MemTotal of a fake meminfo, below);
//  - the cgroup memory limit of the process's own cgroup, the one a container runtime
//    (Docker, Kubernetes, systemd) sets and the kernel's OOM killer enforces. The cgroup is
//    named by /proc/self/cgroup: the "0::<path>" line for cgroup v2, the line whose
//    controllers include "memory" for v1. The hierarchy's mount point comes from
//    /proc/self/mountinfo (default /sys/fs/cgroup for v2, /sys/fs/cgroup/memory for v1).
//    v2 reads <mount>/<path>/memory.max ("max": no limit), v1 memory.limit_in_bytes (a
//    value of 2^62 or more, such as 9223372036854771712, is the kernel's "no limit"), in
//    that cgroup and in each of its ancestors up to the mount point: a container's limit is
//    often set on a parent, and every ancestor's limit applies. The smallest wins. Both
//    versions are read where both are mounted (a hybrid host);
//  - what MemAvailable (/proc/meminfo) allows: MemAvailable plus the host memory sluice's
//    own allocator holds now (host_memory_stats().current_bytes()). MemAvailable does not
//    count what this process already holds, which is what the limit is spent on, so the
//    limit does not shrink as sluice's own models are read in (the `auto` VRAM budget counts
//    what sluice holds as free in the same way, Note [vram budget]).
// MemAvailable caps the DEFAULTS on purpose: a default that exceeds what is available now
// (other processes, the page cache the kernel cannot drop) ends in swapping or the OOM
// killer, whatever the machine's RAM or the container's limit. It is a reading of one
// moment: a default taken when a cache is created does not follow it afterwards. A limit
// given explicitly (--pin-memory-limit, ram_limit) is never capped; a percentage in one is
// of capacity_bytes() (the machine's RAM as the container sees it, not what is free now).
// A file that is there but malformed (a value that is not a byte count, a cgroup line
// without its fields) is logged once, as one warning naming the file, and ignored: the
// limit falls back to the other sources. A file that is not there (no cgroup, the
// controller not enabled, no /proc) is not an error. A value of 0 is ignored as malformed
// (a process cannot run under it). Nothing here throws.
//
// SLUICE_CGROUP_ROOT (a test hook, not a setting for users): a folder that stands for the
// filesystem root for these reads, so that tests can build a fake cgroup tree:
// <dir>/proc/self/cgroup, <dir>/proc/self/mountinfo (if present; its mount points are then
// taken under <dir>), <dir>/sys/fs/cgroup/..., and <dir>/proc/meminfo if present (then its
// MemTotal is physical RAM and its MemAvailable is read; otherwise the real /proc/meminfo
// and sysconf are).
#include <cstdint>
#include <optional>
#include <string>

namespace sluice {

struct HostMemoryLimit {
  uint64_t bytes = 0;   // the smallest of the known sources below; 0 only when none is known
  std::string source;   // where `bytes` came from: "physical RAM", "cgroup v2 memory.max (/sys/fs/cgroup/a/b)",
                        // "cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory/a)",
                        // "MemAvailable (/proc/meminfo)" (+ " plus the 1.2GiB sluice holds")
  uint64_t physical_bytes = 0;                // 0: unknown
  std::optional<uint64_t> cgroup_bytes;       // none: no cgroup limit (or none readable)
  std::string cgroup_source;                  // as `source` names it
  std::optional<uint64_t> mem_available_bytes;  // MemAvailable as read; none: unknown
  std::string mem_available_source;           // "MemAvailable (/proc/meminfo)"
  uint64_t sluice_host_bytes = 0;             // host_empty() bytes held when it was read (counted as available)

  // min(physical RAM, cgroup limit): the memory the process could ever have, as the
  // container sees it (the "RAM" of a percentage, the CPU device's total memory).
  uint64_t capacity_bytes() const;
  std::string capacity_source() const;
  // "3.0GiB from cgroup v2 memory.max (/sys/fs/cgroup/a)"; "unknown" when bytes is 0.
  std::string describe() const;
};

// Note [host memory limit], read now.
HostMemoryLimit host_memory_limit();

// Physical RAM of this machine (sysconf), 0 if unknown. Not a limit: host_memory_limit()
// is what defaults are taken from.
uint64_t physical_ram_bytes();

}  // namespace sluice
