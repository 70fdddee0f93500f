#pragma once
// LayerRecord: what the runtime keeps about one managed layer while its model is attached:
// the host copies of its stored tensors (kept in RAM for as long as the model is attached),
// its device copies while resident, and the sizes and layout the residency plan, the
// staging ring and the upcast need. The residency applier (residency_applier.h) moves
// records between host and device; ModelRecords (model_records.h) holds them for an
// attached model, and a forward (forward_pass.h) reads them to stream and upcast. Leases
// are the forward's own and are kept beside the records, by index.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "offload/layer/layer.h"

namespace sluice::offload {

struct LayerRecord {
  ManagedLayerImpl* layer = nullptr;
  std::string name;
  at::Tensor host_w, host_b, host_s;  // host copies, kept while attached
  at::Tensor dev_w, dev_b, dev_s;     // device copies while resident
  bool resident = false;
  bool required = false;
  bool pinned = false;                // host copies are pinned (and counted)
  at::ScalarType stored_dtype = at::kFloat;
  at::ScalarType compute = at::kFloat;
  bool upcast_w = false, upcast_b = false;
  uint64_t stored_bytes = 0;
  uint64_t slot_bytes = 0, off_b = 0, off_s = 0;  // packed layout in a staging slot
  uint64_t scratch_bytes = 0, scratch_off_b = 0;  // upcast outputs
  std::string group;
  int64_t block = -1;
};

// The record of `layer` (named `name` in its model) as it is now: host aliases of its
// stored tensors (contiguous), its slot and scratch layout, its block. Reads only; the
// record is streamed, unpinned and not required (the engine decides `required`).
LayerRecord describe_layer(const std::string& name, ManagedLayerImpl& layer);

}  // namespace sluice::offload
