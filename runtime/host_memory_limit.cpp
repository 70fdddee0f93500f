#include "runtime/host_memory_limit.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice {

namespace {

// A cgroup v1 limit of this or more is the kernel's "no limit" (LONG_MAX rounded down to
// the page size: 9223372036854771712 with 4 KiB pages).
constexpr uint64_t kV1Unlimited = uint64_t{1} << 62;

// One warning per distinct message: the limit is read on every default, and a malformed
// file stays malformed.
void warn_once(const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> said;
  {
    std::lock_guard<std::mutex> g(mutex);
    if (!said.insert(message).second) return;
  }
  log::warn("host memory limit: " + message);
}

// SLUICE_CGROUP_ROOT without trailing slashes; "" for the real root.
std::string fake_root() {
  const char* env = std::getenv("SLUICE_CGROUP_ROOT");
  std::string r = env ? env : "";
  while (!r.empty() && r.back() == '/') r.pop_back();
  return r;
}

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The file's text; false when it cannot be opened (not there: not an error here).
bool read_text(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// A plain decimal count; none for anything else (signs, units, overflow, empty).
std::optional<uint64_t> parse_count(std::string_view s) {
  s = trim(s);
  if (s.empty() || s.size() > 20) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

std::string shown(std::string_view s) {
  std::string t(trim(s).substr(0, 60));
  for (char& c : t) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  return "'" + t + "'";
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string unescape_mount(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isdigit(static_cast<unsigned char>(s[i + 2])) && std::isdigit(static_cast<unsigned char>(s[i + 3]))) {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

struct Mount {
  std::string root;   // the hierarchy's folder mounted there ("/" unless a container bind-mounts its own)
  std::string point;  // where, under the (fake) root
};

struct Mounts {
  std::optional<Mount> v2, v1_memory;
};

Mounts read_mounts(const std::string& root) {
  Mounts m;
  const std::string path = root + "/proc/self/mountinfo";
  std::string text;
  if (!read_text(path, text)) return m;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (trim(line).empty()) continue;
    std::vector<std::string> f;
    {
      std::istringstream words(line);
      for (std::string w; words >> w;) f.push_back(w);
    }
    const auto dash = std::find(f.begin(), f.end(), "-");
    const size_t d = static_cast<size_t>(dash - f.begin());
    if (f.size() < 5 || dash == f.end() || d < 5 || d + 3 > f.size()) {
      warn_once(path + ": a line without its fields (" + shown(line) + "); cgroup mounts are taken from the defaults");
      return Mounts{};
    }
    const std::string& fstype = f[d + 1];
    Mount mt{unescape_mount(f[3]), unescape_mount(f[4])};
    if (fstype == "cgroup2" && !m.v2) {
      m.v2 = mt;
    } else if (fstype == "cgroup" && !m.v1_memory) {
      for (const auto& opt : split(f[d + 3], ',')) {
        if (opt == "memory") m.v1_memory = mt;
      }
    }
  }
  return m;
}

// "/a/b/" -> "/a/b"; "/" -> "".
std::string strip_slashes(std::string p) {
  while (!p.empty() && p.back() == '/') p.pop_back();
  return p;
}

// The folder of the cgroup `path` (from /proc/self/cgroup) in the hierarchy mounted as
// `mount`, under `root`; the mount point itself when the path is not below the mount's
// root or not there (a container's own cgroup mounted at the mount point).
std::string cgroup_dir(const std::string& root, const Mount& mount, const std::string& path) {
  const std::string point = strip_slashes(root + mount.point);
  const std::string mroot = strip_slashes(mount.root);
  std::string rel = strip_slashes(path);
  if (!mroot.empty()) {
    if (rel == mroot) {
      rel.clear();
    } else if (rel.rfind(mroot + "/", 0) == 0) {
      rel = rel.substr(mroot.size());
    } else {
      return point;
    }
  }
  if (rel.find("/..") != std::string::npos || (!rel.empty() && rel.front() != '/')) return point;
  const std::string dir = point + rel;
  return is_dir(dir) ? dir : point;
}

struct CgroupLimit {
  std::optional<uint64_t> bytes;
  std::string source;
};

// The smallest limit in `file` of `dir` and each ancestor up to `top`.
void walk_limits(const std::string& dir, const std::string& top, const std::string& file, bool v2, CgroupLimit& best) {
  std::string cur = dir;
  for (;;) {
    const std::string p = cur + "/" + file;
    std::string text;
    if (read_text(p, text)) {
      const std::string_view t = trim(text);
      std::optional<uint64_t> limit;  // none: no limit here ("max", v1's huge value) or ignored
      const std::optional<uint64_t> v = parse_count(t);
      if (v && *v == 0) {
        warn_once(p + ": a limit of 0 bytes, which no running process can be under; ignoring it");
      } else if (v && (v2 || *v < kV1Unlimited)) {
        limit = *v;
      } else if (!v && !(v2 && t == "max")) {
        warn_once(p + ": expected a byte count" + std::string(v2 ? " or \"max\"" : "") + ", got " + shown(t) +
                  "; ignoring it");
      }
      if (limit && (!best.bytes || *limit < *best.bytes)) {
        best.bytes = limit;
        best.source = std::string(v2 ? "cgroup v2 memory.max (" : "cgroup v1 memory.limit_in_bytes (") +
                      (cur.empty() ? "/" : cur) + ")";
      }
    }
    if (cur.size() <= top.size()) break;
    const size_t slash = cur.rfind('/');
    if (slash == std::string::npos || slash < top.size()) break;
    cur = cur.substr(0, slash);
  }
}

CgroupLimit read_cgroup_limit(const std::string& root) {
  CgroupLimit best;
  const std::string path = root + "/proc/self/cgroup";
  std::string text;
  if (!read_text(path, text)) return best;  // no cgroups (or no /proc): not an error
  std::optional<std::string> v2_path, v1_path;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (trim(line).empty()) continue;
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos || !parse_count(line.substr(0, a)) || line.size() == b + 1 || line[b + 1] != '/') {
      warn_once(path + ": expected lines 'id:controllers:/path', got " + shown(line) + "; ignoring the file");
      return best;
    }
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string cg = line.substr(b + 1);
    if (line.substr(0, a) == "0" && controllers.empty()) {
      v2_path = cg;
    } else {
      for (const auto& c : split(controllers, ',')) {
        if (c == "memory") v1_path = cg;
      }
    }
  }
  const Mounts mounts = read_mounts(root);
  if (v2_path) {
    const Mount m = mounts.v2 ? *mounts.v2 : Mount{"/", "/sys/fs/cgroup"};
    const std::string top = strip_slashes(root + m.point);
    if (is_dir(top)) walk_limits(cgroup_dir(root, m, *v2_path), top, "memory.max", /*v2=*/true, best);
  }
  if (v1_path) {
    const Mount m = mounts.v1_memory ? *mounts.v1_memory : Mount{"/", "/sys/fs/cgroup/memory"};
    const std::string top = strip_slashes(root + m.point);
    if (is_dir(top)) walk_limits(cgroup_dir(root, m, *v1_path), top, "memory.limit_in_bytes", /*v2=*/false, best);
  }
  return best;
}

struct MemInfo {
  std::optional<uint64_t> total, available;
  std::string path;
};

MemInfo read_meminfo(const std::string& path) {
  MemInfo m;
  m.path = path;
  std::string text;
  if (!read_text(path, text)) return m;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, colon);
    if (key != "MemTotal" && key != "MemAvailable") continue;
    std::string_view v = trim(std::string_view(line).substr(colon + 1));
    bool kb = false;
    if (v.size() >= 2 && v.substr(v.size() - 2) == "kB") {
      kb = true;
      v = trim(v.substr(0, v.size() - 2));
    }
    const std::optional<uint64_t> n = parse_count(v);
    if (!kb || !n || *n > UINT64_MAX / 1024) {
      warn_once(path + ": expected '" + key + ": <number> kB', got " + shown(line) + "; ignoring it");
      continue;
    }
    (key == "MemTotal" ? m.total : m.available) = *n * 1024;
  }
  return m;
}

}  // namespace

uint64_t physical_ram_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

uint64_t HostMemoryLimit::capacity_bytes() const {
  if (cgroup_bytes && (physical_bytes == 0 || *cgroup_bytes < physical_bytes)) return *cgroup_bytes;
  return physical_bytes;
}

std::string HostMemoryLimit::capacity_source() const {
  if (cgroup_bytes && (physical_bytes == 0 || *cgroup_bytes < physical_bytes)) return cgroup_source;
  return physical_bytes ? "physical RAM" : "unknown";
}

std::string HostMemoryLimit::describe() const {
  if (bytes == 0) return "unknown";
  return format_bytes(bytes) + " from " + source;
}

HostMemoryLimit host_memory_limit() {
  HostMemoryLimit l;
  const std::string root = fake_root();
  const bool fake_meminfo = !root.empty() && is_file(root + "/proc/meminfo");
  const MemInfo mi = read_meminfo(fake_meminfo ? root + "/proc/meminfo" : "/proc/meminfo");
  l.physical_bytes = fake_meminfo && mi.total ? *mi.total : physical_ram_bytes();
  const CgroupLimit cg = read_cgroup_limit(root);
  l.cgroup_bytes = cg.bytes;
  l.cgroup_source = cg.source;
  if (mi.available && *mi.available == 0) {
    warn_once(mi.path + ": MemAvailable is 0; ignoring it");
  } else {
    l.mem_available_bytes = mi.available;
  }
  l.mem_available_source = "MemAvailable (" + mi.path + ")";
  l.sluice_host_bytes = static_cast<uint64_t>(std::max<int64_t>(host_memory_stats().current_bytes(), 0));

  if (l.physical_bytes) {
    l.bytes = l.physical_bytes;
    l.source = "physical RAM";
  }
  if (l.cgroup_bytes && (l.bytes == 0 || *l.cgroup_bytes < l.bytes)) {
    l.bytes = *l.cgroup_bytes;
    l.source = l.cgroup_source;
  }
  if (l.mem_available_bytes) {
    const uint64_t allows = *l.mem_available_bytes + l.sluice_host_bytes;
    if (l.bytes == 0 || allows < l.bytes) {
      l.bytes = allows;
      l.source = l.mem_available_source;
      if (l.sluice_host_bytes) l.source += " plus the " + format_bytes(l.sluice_host_bytes) + " sluice holds";
    }
  }
  return l;
}

}  // namespace sluice
