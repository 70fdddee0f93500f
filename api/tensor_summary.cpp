#include "api/tensor_summary.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace sluice::api {
namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s) {
    if (c == '.') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

bool is_index(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

std::string mib(uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

std::string group_of(const std::string& name) {
  const auto p = split(name);
  if (p.size() >= 3 && p[0] == "blocks" && is_index(p[1])) {
    std::string sub = p[2];
    if (sub.rfind("adaln_modulation", 0) == 0) sub = "adaln_modulation";
    if (sub.rfind("layer_norm", 0) == 0) sub = "layer_norm";
    return "blocks.*." + sub;
  }
  return p[0];
}

void TensorSummary::add(const std::string& name, const std::string& dtype_name, int64_t numel, uint64_t nbytes) {
  tensors += 1;
  parameters += numel;
  bytes += nbytes;
  bytes_by_dtype[dtype_name] += nbytes;
  const std::string g = group_of(name);
  GroupStats* stats = nullptr;
  for (auto& existing : groups)
    if (existing.name == g) stats = &existing;
  if (stats == nullptr) {
    groups.push_back(GroupStats{g});
    stats = &groups.back();
  }
  stats->tensors += 1;
  stats->parameters += numel;
  stats->bytes += nbytes;
  const auto p = split(name);
  if (p.size() >= 2 && p[0] == "blocks" && is_index(p[1])) blocks = std::max<int64_t>(blocks, std::stoll(p[1]) + 1);
}

nlohmann::json to_json(const TensorSummary& s) {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& g : s.groups)
    groups.push_back({{"name", g.name}, {"tensors", g.tensors}, {"parameters", g.parameters}, {"bytes", g.bytes}});
  return {{"tensors", s.tensors}, {"parameters", s.parameters}, {"bytes", s.bytes},
          {"bytes_by_dtype", s.bytes_by_dtype}, {"blocks", s.blocks}, {"groups", groups}};
}

std::string to_text(const TensorSummary& s) {
  std::ostringstream o;
  o << "tensors     " << s.tensors << "\n";
  o << "parameters  " << s.parameters << "\n";
  o << "bytes       " << s.bytes << " (" << mib(s.bytes) << ")\n";
  for (const auto& [dtype, b] : s.bytes_by_dtype) o << "  " << dtype << std::string(10 - std::min<size_t>(dtype.size(), 9), ' ') << b << " (" << mib(b) << ")\n";
  if (s.blocks > 0) o << "blocks      " << s.blocks << "\n";
  o << "groups:\n";
  char line[256];
  std::snprintf(line, sizeof(line), "  %-30s %8s %14s %14s\n", "name", "tensors", "parameters", "MiB");
  o << line;
  for (const auto& g : s.groups) {
    std::snprintf(line, sizeof(line), "  %-30s %8lld %14lld %14.2f\n", g.name.c_str(), static_cast<long long>(g.tensors),
                  static_cast<long long>(g.parameters), static_cast<double>(g.bytes) / (1024.0 * 1024.0));
    o << line;
  }
  return o.str();
}

}  // namespace sluice::api
