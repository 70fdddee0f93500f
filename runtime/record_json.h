#pragma once
// The JSON of sluice's reported records (include/sluice/stats.hpp), written from their field
// lists (Note [field lists] in sluice/stats.hpp): one key per field, named as the field.
// nlohmann finds these to_json by argument-dependent lookup, so a record, or a vector of
// records, converts with `json j = record`. What a record's JSON writes differently from its
// fields is done where that JSON is made (offload/report/stats.cpp, cache/cache_queries.cpp).
//
// Tested by tests/cache/test_cache_queries.cpp ("cache_queries: the cache stats JSON has one key
// per CacheStats field and the older keys") and, through the stats JSON, the cases
// offload/report/stats.h names.
#include <nlohmann/json.hpp>

#include "sluice/stats.hpp"

namespace sluice {

#define SLUICE_JSON_FIELD(type, name) j[#name] = r.name;

inline void to_json(nlohmann::json& j, const Counter& r) {
  j = nlohmann::json::object();
  SLUICE_COUNTER_FIELDS(SLUICE_JSON_FIELD)
}

inline void to_json(nlohmann::json& j, const ForwardStats& r) {
  j = nlohmann::json::object();
  SLUICE_FORWARD_STATS_FIELDS(SLUICE_JSON_FIELD)
}

inline void to_json(nlohmann::json& j, const NonFiniteReport& r) {
  j = nlohmann::json::object();
  SLUICE_NONFINITE_REPORT_FIELDS(SLUICE_JSON_FIELD)
}

inline void to_json(nlohmann::json& j, const HeldModel& r) {
  j = nlohmann::json::object();
  SLUICE_HELD_MODEL_FIELDS(SLUICE_JSON_FIELD)
}

inline void to_json(nlohmann::json& j, const CacheStats& r) {
  j = nlohmann::json::object();
  SLUICE_CACHE_STATS_FIELDS(SLUICE_JSON_FIELD)
}

#undef SLUICE_JSON_FIELD

}  // namespace sluice
