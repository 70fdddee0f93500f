// sluice_bench_predict: what the cost model (Note [cost model] in offload/plan/cost_model.h)
// predicts for anima-2b under the residency policies (Note [balanced plan]), on devices
// described by published throughput figures. Nothing here runs a model or touches a
// device: every number printed is a model prediction from those figures, not a
// measurement (bench_pipeline measures).
//
// The layer list is anima-2b's DiT (Cosmos-Predict2 2B): 28 blocks of model dim 2048,
// 16 heads, MLP 4x, in execution order
//   adaLN self-attn (2048->256->6144), self-attn q k v (2048x2048), o (2048x2048),
//   adaLN cross-attn, cross-attn q (2048x2048), k v (1024->2048, on the text context),
//   o (2048x2048), adaLN MLP, fc1 (2048->8192), fc2 (8192->2048),
// stored fp8 (1 byte per parameter), plus the skip-listed embedders and final layer
// (bf16, always resident). Per-layer compute is FLOPs / (peak TFLOPS x efficiency), with
// 2 x rows x in x out FLOPs per linear (rows: image tokens, the 512 context tokens for
// cross-attn k v, one row per sample for adaLN and the embedders' timestep path) and the
// attention (self 4 x tokens^2 x dim, cross 4 x tokens x 512 x dim) charged to the o
// projection after which it runs. Tokens = (H/16) x (W/16): 1024 at 512^2, 4096 at 1024^2.
//
// Devices (flags override):
//   h200   H200 SXM: bf16 dense 989 TFLOPS peak; PCIe Gen5 x16, ~55 GB/s pinned H2D.
//   12gb   a 12 GB PCIe 4.0 card (RTX 3060/4070 class): bf16 dense ~80 TFLOPS tensor peak;
//          ~25 GB/s pinned H2D.
// Rows per device and resolution: weight budgets (h200: one that keeps ~50% of the
// streamable bytes resident; 12gb: its real budget, 10 GiB of the 12 for weights, which
// holds all of anima-2b's ~2 GB, then 1 GiB and 0.5 GiB), and max_resident fractions
// 0.75, 0.5, 0.25, 0 under the device's real budget (h200: 120 GiB).
//
//   sluice_bench_predict [--efficiency F] [--h200-tflops T] [--h200-gbps G] [--card-tflops T]
//                        [--card-gbps G] [--copy-overhead-ms MS] [--batch N] [--resolutions 512,1024]
//                        [--ring-slots N] [--prefetch N] [--quick]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "offload/plan/cost_model.h"
#include "offload/plan/residency_plan.h"
#include "runtime/error.h"

using namespace sluice;
using namespace sluice::offload;

namespace {

constexpr uint64_t MiB = 1ull << 20;
constexpr uint64_t GiB = 1ull << 30;
constexpr int64_t kBlocks = 28, kDim = 2048, kContextDim = 1024, kMlp = 8192, kLora = 256, kContextTokens = 512;

struct Linear {
  std::string name;
  int64_t in = 0, out = 0;
  int64_t rows = 0;          // rows it multiplies per forward
  double extra_flops = 0;    // attention charged to this layer
  int64_t bytes_per_param = 1;
  bool required = false;
};

std::vector<Linear> anima_2b(int64_t tokens, int64_t batch) {
  const int64_t t = tokens * batch, ctx = kContextTokens * batch;
  std::vector<Linear> l;
  // Skip-listed (declared_fp8_skips): bf16 and always resident.
  l.push_back({"x_embedder.proj.1", (16 + 1) * 4, kDim, t, 0, 2, true});  // 2x2 patches of 16 latent + 1 mask channels
  l.push_back({"t_embedder.1.linear_1", kDim, kDim, batch, 0, 2, true});
  l.push_back({"t_embedder.1.linear_2", kDim, 3 * kDim, batch, 0, 2, true});
  for (int64_t b = 0; b < kBlocks; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    auto adaln = [&](const std::string& which) {
      l.push_back({p + "adaln_modulation_" + which + ".1", kDim, kLora, batch});
      l.push_back({p + "adaln_modulation_" + which + ".2", kLora, 3 * kDim, batch});
    };
    adaln("self_attn");
    for (const char* n : {"q_proj", "k_proj", "v_proj"}) l.push_back({p + "self_attn." + n, kDim, kDim, t});
    l.push_back({p + "self_attn.output_proj", kDim, kDim, t, 4.0 * double(tokens) * double(tokens) * kDim * batch});
    adaln("cross_attn");
    l.push_back({p + "cross_attn.q_proj", kDim, kDim, t});
    l.push_back({p + "cross_attn.k_proj", kContextDim, kDim, ctx});
    l.push_back({p + "cross_attn.v_proj", kContextDim, kDim, ctx});
    l.push_back({p + "cross_attn.output_proj", kDim, kDim, t, 4.0 * double(tokens) * kContextTokens * kDim * batch});
    adaln("mlp");
    l.push_back({p + "mlp.layer1", kDim, kMlp, t});
    l.push_back({p + "mlp.layer2", kMlp, kDim, t});
  }
  l.push_back({"final_layer.adaln_modulation.1", kDim, kLora, batch, 0, 2, true});
  l.push_back({"final_layer.adaln_modulation.2", kLora, 2 * kDim, batch, 0, 2, true});
  l.push_back({"final_layer.linear", kDim, 4 * 16, t, 0, 2, true});
  return l;
}

struct Device {
  std::string name;
  double tflops = 0;  // bf16 dense peak
  double gbps = 0;    // pinned H2D, GB/s
  uint64_t real_budget = 0;
  std::vector<uint64_t> budgets;  // extra budget rows (0: "half the streamable bytes")
};

struct Row {
  std::string label;
  uint64_t budget = 0;
  std::optional<double> max_resident;
};

// The plan input for `linears` on `device`: one forward kind, every layer once in order.
PlanInput make_input(const std::vector<Linear>& linears, double tflops_effective, double gbps, double overhead_ms,
                     uint32_t ring_slots, uint32_t prefetch) {
  PlanInput in;
  KindProfile dit;
  dit.kind = "dit";
  uint64_t largest_bf16 = 0;
  for (size_t i = 0; i < linears.size(); ++i) {
    const Linear& s = linears[i];
    PlanLayer pl;
    pl.name = s.name;
    pl.stored_bytes = static_cast<uint64_t>(s.in * s.out * s.bytes_per_param);
    pl.required = s.required;
    if (s.name.rfind("blocks.", 0) == 0) {
      pl.group = "blocks";
      pl.block = std::stoll(s.name.substr(7, s.name.find('.', 7) - 7));
    }
    in.layers.push_back(pl);
    const double flops = 2.0 * double(s.rows) * double(s.in) * double(s.out) + s.extra_flops;
    dit.order.push_back(i);
    dit.compute_ms.push_back(flops / (tflops_effective * 1e9));  // TFLOP/s = 1e9 FLOP per ms
    largest_bf16 = std::max(largest_bf16, static_cast<uint64_t>(s.in * s.out * 2));
  }
  in.costs.kinds.push_back(dit);
  in.costs.copy_gbps = gbps;
  in.costs.copy_overhead_ms = overhead_ms;
  in.scratch_bytes = 2 * largest_bf16;  // upcast scratch: two of the largest bf16 weight
  in.ring_slots = ring_slots;
  in.max_ahead = prefetch;
  return in;
}

struct Outcome {
  double step = 0, floor = 0;
  uint64_t ring = 0, resident = 0;
};

Outcome plan_and_predict(PlanInput in, ResidencyPolicy policy, double* plan_ms = nullptr) {
  in.policy = policy;
  const auto t0 = std::chrono::steady_clock::now();
  const ResidencyPlan p = plan_residency(in);
  if (plan_ms) *plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  Outcome o;
  o.step = weighted_step_ms(p.predictions, in.costs);
  o.floor = p.predictions.at(0).floor_ms;
  o.ring = p.ring_bytes;
  o.resident = p.resident_bytes;
  return o;
}

std::vector<int64_t> split_ints(const std::string& text) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(std::stoll(item));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  double efficiency = 0.5, h200_tflops = 989, h200_gbps = 55, card_tflops = 80, card_gbps = 25;
  double overhead_ms = 0.01;
  int64_t batch = 1;
  uint32_t ring_slots = 3;
  int64_t prefetch = -1;
  std::string resolutions = "512,1024";
  bool quick = false;
  CLI::App app{"sluice_bench_predict: cost-model predictions for anima-2b from published throughput figures"};
  app.add_option("--efficiency", efficiency, "Fraction of the bf16 dense peak that layers reach")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  app.add_option("--h200-tflops", h200_tflops, "H200 bf16 dense peak, TFLOPS")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--h200-gbps", h200_gbps, "H200 pinned H2D rate (PCIe Gen5 x16), GB/s")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--card-tflops", card_tflops, "12 GB card bf16 dense tensor peak, TFLOPS")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--card-gbps", card_gbps, "12 GB card pinned H2D rate (PCIe 4.0 x16), GB/s")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--copy-overhead-ms", overhead_ms, "Fixed cost per streamed copy, ms")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--batch", batch, "Samples per forward (2: classifier-free guidance in one batch)")
      ->check(CLI::Range(int64_t{1}, int64_t{64}))
      ->capture_default_str();
  app.add_option("--resolutions", resolutions, "Square image sizes, multiples of 16, comma-separated")->capture_default_str();
  app.add_option("--ring-slots", ring_slots, "The ring's minimum, in largest streamed slots")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--prefetch", prefetch, "Prefetch bound in streamed layers (-1: auto, the ring's bytes only)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_flag("--quick", quick, "One resolution and a few rows (the ctest smoke run)");
  CLI11_PARSE(app, argc, argv);

  std::vector<int64_t> sizes;
  try {
    sizes = split_ints(resolutions);
  } catch (const std::exception&) {
    std::fprintf(stderr, "--resolutions: expected comma-separated integers, got '%s'\n", resolutions.c_str());
    return 2;
  }
  if (sizes.empty() || std::any_of(sizes.begin(), sizes.end(), [](int64_t s) { return s < 16 || s % 16 != 0; })) {
    std::fprintf(stderr, "--resolutions: every size must be a positive multiple of 16, got '%s'\n", resolutions.c_str());
    return 2;
  }
  if (quick) sizes.resize(1);
  const uint32_t max_ahead = prefetch < 0 ? kPrefetchAuto : static_cast<uint32_t>(prefetch);

  std::vector<Device> devices{
      {"h200", h200_tflops, h200_gbps, 120 * GiB, {0}},
      {"12gb", card_tflops, card_gbps, 10 * GiB, {10 * GiB, 1 * GiB, GiB / 2}},
  };
  std::printf("MODEL PREDICTIONS from published throughput figures (Note [cost model]), not measurements.\n");
  std::printf("anima-2b DiT, fp8 storage, batch %lld, efficiency %.2f of bf16 dense peak, copy overhead %.3f ms, "
              "ring >= %u slots, prefetch %s\n",
              static_cast<long long>(batch), efficiency, overhead_ms, ring_slots,
              prefetch < 0 ? "auto" : std::to_string(prefetch).c_str());
  std::printf("devices: h200 %.0f TFLOPS, %.1f GB/s H2D; 12gb %.0f TFLOPS, %.1f GB/s H2D\n", h200_tflops, h200_gbps,
              card_tflops, card_gbps);
  std::printf("%-5s %5s %-16s %9s %9s %9s %9s %7s %7s %7s %9s %9s\n", "dev", "res", "row", "floor_ms", "balanced",
              "spread", "front", "b/flr", "s/flr", "f/flr", "ring_MiB", "res_MiB");
  double worst_plan_ms = 0;
  size_t layer_count = 0;
  try {
    for (const Device& d : devices) {
      for (const int64_t res : sizes) {
        const int64_t tokens = (res / 16) * (res / 16);
        const std::vector<Linear> linears = anima_2b(tokens, batch);
        PlanInput base = make_input(linears, d.tflops * efficiency, d.gbps, overhead_ms, ring_slots, max_ahead);
        layer_count = base.layers.size();
        uint64_t streamable = 0;
        for (const auto& l : base.layers) streamable += l.required ? 0 : l.stored_bytes;
        std::vector<Row> rows;
        for (const uint64_t b : d.budgets) {
          if (b == 0) {
            // ~50% of the streamable bytes resident: the minimum (everything streamed
            // through the smallest ring) plus half of what is streamable.
            PlanInput probe = base;
            probe.max_resident = 0.0;
            rows.push_back({"budget ~50%", minimum_weight_budget(probe) + streamable / 2, std::nullopt});
          } else {
            char label[32];
            std::snprintf(label, sizeof label, "budget %.1f GiB", static_cast<double>(b) / GiB);
            rows.push_back({label, b, std::nullopt});
          }
        }
        for (const double f : {0.75, 0.5, 0.25, 0.0}) {
          char label[32];
          std::snprintf(label, sizeof label, "max_res %.2f", f);
          rows.push_back({label, d.real_budget, f});
        }
        if (quick) rows.resize(std::min<size_t>(rows.size(), 2));
        for (const Row& r : rows) {
          PlanInput in = base;
          in.weight_budget = r.budget;
          in.max_resident = r.max_resident;
          double plan_ms = 0;
          const Outcome b = plan_and_predict(in, ResidencyPolicy::balanced, &plan_ms);
          worst_plan_ms = std::max(worst_plan_ms, plan_ms);
          const Outcome s = plan_and_predict(in, ResidencyPolicy::spread);
          const Outcome f = plan_and_predict(in, ResidencyPolicy::front_first);
          std::printf("%-5s %5lld %-16s %9.2f %9.2f %9.2f %9.2f %7.3f %7.3f %7.3f %9.1f %9.1f\n", d.name.c_str(),
                      static_cast<long long>(res), r.label.c_str(), b.floor, b.step, s.step, f.step, b.step / b.floor,
                      s.step / b.floor, f.step / b.floor, static_cast<double>(b.ring) / MiB,
                      static_cast<double>(b.resident) / MiB);
        }
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "sluice_bench_predict: %s\n", e.what());
    return 1;
  }
  std::printf("floor = max(compute, streamed copies); x/flr = predicted step / floor; ring and resident bytes of the "
              "balanced plan.\n");
  std::printf("slowest balanced plan_residency: %.2f ms for %zu layers\n", worst_plan_ms, layer_count);
  return 0;
}
