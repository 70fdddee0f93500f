#pragma once
// How much an Anima checkpoint loses under fp8 storage, per module group and per candidate
// skip list: the analysis behind `sluice fp8-report`. See Note [fp8 report].
//
// Note [fp8 report]
// ~~~~~~~~~~~~~~~~~
// Only tensors apply_storage would cast are measured: weights and biases of the Linears
// and Embeddings (norms are never cast). Per group, over all its tensors together:
//  - flush fraction: elements that are nonzero in the checkpoint and zero after the cast,
//    divided by all elements of the group;
//  - round-trip relative error ||w - up(cast(w))|| / ||w|| (Frobenius over the group);
//  - the same two with per-channel scaled storage (one fp32 scale per output row, as
//    cast_to_storage with ScaleMode::per_channel; 1-d tensors stay unscaled there too).
// The unscaled cast saturates at +-max finite like cast_to_storage's default. Values are
// compared in fp32 (an fp8 value is exact in bf16, so unscaled equals the bf16 upcast).
// Tensors are read one at a time from the mapped file and processed in row chunks, so
// memory stays at one chunk's temporaries whatever the model size.
// Candidates are explicit skip lists applied with the default and the model's patterns off:
//   none {}, t_embedder {t_embedder}, declared {t_embedder, x_embedder, final_layer},
//   declared+adaln_modulation {..., adaln_modulation\w*}
// (the in-block modules are adaln_modulation_{self_attn,cross_attn,mlp}; whole-component
// matching needs the regex, see Note [skip pattern matching]). param_size is for bf16
// compute. With `forward`, each candidate's single-forward velocity on fixed seeded
// inputs is compared (relative L2) with the checkpoint loaded in plain bf16.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace sluice::anima {

struct Fp8ReportOptions {
  at::ScalarType storage = at::kFloat8_e4m3fn;  // fp8 dtype to measure
  bool forward = false;                         // also run the single-forward comparison
  int64_t chunk_elements = int64_t{1} << 22;    // elements per processing chunk
  uint64_t seed = 0;                            // seed of the forward inputs
  int64_t latent_size = 16;                     // latent H = W of the forward input
  int64_t context_tokens = 16;                  // S of the forward's context
  double sigma = 0.7;                           // timestep of the forward
};

// Statistics of one module group.
struct Fp8GroupStats {
  std::string group;                     // t_embedder, x_embedder, final_layer, adaln_modulation, ...
  int64_t tensors = 0;                   // tensors measured
  int64_t parameters = 0;                // elements measured
  double flush_fraction = 0;             // nonzero -> zero under the unscaled cast, / parameters
  double roundtrip_rel_error = 0;        // unscaled ||w - up(cast(w))|| / ||w||
  double scaled_flush_fraction = 0;      // same, per-channel scaled storage
  double scaled_roundtrip_rel_error = 0;
};

// One candidate skip list.
struct Fp8Candidate {
  std::string name;                        // none, t_embedder, declared, declared+adaln_modulation
  std::vector<std::string> patterns;       // the skip patterns
  int64_t skipped_modules = 0;             // Linears/Embeddings kept in bf16
  double param_size_mib = 0;               // bytes of all parameters / 2^20
  std::optional<double> velocity_rel_l2;   // set with Fp8ReportOptions::forward
};

struct Fp8Report {
  std::string checkpoint;
  std::string config_name;
  at::ScalarType storage = at::kFloat8_e4m3fn;
  std::vector<Fp8GroupStats> groups;  // in the order of fp8_report_groups(), empty groups dropped
  std::vector<Fp8Candidate> candidates;
  bool forward = false;               // velocity_rel_l2 is set on every candidate
  Fp8ReportOptions options;
};

// The group names, in report order ("other" collects anything unmatched).
const std::vector<std::string>& fp8_report_groups();
// The group of a Linear/Embedding's dotted module name.
std::string fp8_report_group(const std::string& module_name);

// Runs the analysis on a checkpoint. Throws FileError/CheckpointError as load_anima, and
// InvalidArgument for a non-fp8 storage dtype or bad options.
Fp8Report fp8_report(const std::string& checkpoint, const Fp8ReportOptions& options = {});

nlohmann::json fp8_report_to_json(const Fp8Report& report);
// Human-readable tables.
std::string fp8_report_to_text(const Fp8Report& report);

}  // namespace sluice::anima
