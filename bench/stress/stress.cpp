// sluice_stress: several models in one ModelCache, driven by concurrent callers under a
// budget that keeps changing, with LoRA sidecars, residency caps, drops/reloads, LRU
// evictions and exceptions injected at random layers. After every forward it checks the
// invariants; at the end it checks that host RSS and device memory returned to their
// steady level. See Note [stress invariants].
//
// Note [stress invariants]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// After every forward (inside the model's run mutex, so no other caller can change the
// model between the forward and the checks):
//  1. every parameter of every managed layer is in its stored dtype (fp8 for cast layers,
//     the compute dtype for skipped ones), also after a forward that threw;
//  2. the cache's device total is within vram budget - working memory;
//  3. the output equals, bit for bit, the reference output for the same model, inputs and
//     LoRA set, computed once up front at full residency in a separate cache;
//  4. the forward's bytes_streamed equals the model's non-resident stored bytes.
// At the end, with every model dropped, the device ledger is back to 0 bytes and host RSS
// over the last half of the run grew by less than the drift threshold.
// Outputs are compared bit for bit because on the CPU device residency, prefetch depth and
// budget never change the arithmetic (the engine's tests prove that separately).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "cache/model_cache.h"
#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "models/lora.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "offload/layer/layer.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/hardware.h"
#include "runtime/logging.h"

namespace {

using namespace sluice;
using Clock = std::chrono::steady_clock;

struct Args {
  double seconds = 60;          // wall-clock bound
  uint64_t max_forwards = 0;    // count bound; 0: none
  int threads = 3;              // concurrent callers
  int models = 3;               // distinct models in the cache
  std::string preset = "anima-tiny";
  uint64_t seed = 1;            // drives every random choice (per thread: seed + thread index)
  double fault_rate = 0.005;    // probability that a layer's forward throws (injected)
  double drift_mib = 64;        // RSS growth over the last half above which the run fails
};

// Host resident set size from /proc (bytes).
uint64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

struct Inputs {
  at::Tensor x, t, ctx;
};

// One model of the run: how it is loaded, its inputs, its LoRA and reference outputs.
struct ModelCase {
  cache::LoadSpec spec;
  Inputs in;
  LoraAdapter lora;      // mapped onto a model built from the same config (names only matter)
  at::Tensor ref_plain;  // full residency, no LoRA
  at::Tensor ref_lora;   // full residency, LoRA at strength 0.5
  std::map<std::string, at::ScalarType> dtypes;  // every parameter's stored dtype, from the reference load
};

constexpr double kLoraStrength = 0.5;

Inputs make_inputs(const anima::AnimaConfig& c, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {at::randn({1, c.in_channels, 1, 8, 8}, gen), at::full({1}, 0.6),
          at::randn({1, 6, c.crossattn_emb_channels}, gen)};
}

// A rank-4 LoRA on block 0's self- and cross-attention query projections ([D, D] both).
std::vector<std::pair<std::string, at::Tensor>> lora_tensors(const anima::AnimaConfig& c, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t d = c.model_channels, r = 4;
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (const char* m : {"blocks.0.self_attn.q_proj", "blocks.0.cross_attn.q_proj"}) {
    t.emplace_back(std::string("diffusion_model.") + m + ".lora_A.weight", at::randn({r, d}, gen) * 0.1);
    t.emplace_back(std::string("diffusion_model.") + m + ".lora_B.weight", at::randn({d, r}, gen) * 0.1);
  }
  return t;
}

// The forward the API's LockedModel::forward runs, plus the checks of Note [stress
// invariants] 1 and 4, inside the model's run mutex. Returns the output.
struct ForwardResult {
  at::Tensor out;
  std::string violation;  // empty when invariants 1 and 4 hold
};

ForwardResult checked_forward(cache::ModelCache& cache, const cache::Lock& lock, const ModelCase& mc, bool with_lora) {
  ForwardResult r;
  cache.run(lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode inference;
    const at::ScalarType dt = m.compute_dtype();
    const at::Device dev = engine.device().device();
    std::optional<LoraScope> lora;
    // Placed by the engine: charged to the model's budget, which may stream more layers.
    if (with_lora) lora.emplace(m, mc.lora, kLoraStrength, std::nullopt, &engine);
    // The plan this forward runs under (a plan from measurements may follow it).
    const offload::ResidencyPlan& plan = engine.plan();
    uint64_t expected = 0;
    for (size_t i = 0; i < plan.layers.size(); ++i)
      if (!plan.resident[i] && plan.layers[i].name.rfind("llm_adapter.", 0) != 0) expected += plan.layers[i].stored_bytes;
    std::string error;
    try {
      offload::ForwardScope scope(engine, "dit");
      r.out = m.forward(mc.in.x.to(dev, dt), mc.in.t.to(dev), mc.in.ctx.to(dev, dt)).to(at::kCPU);
    } catch (const std::exception& e) {
      error = e.what();
    }
    lora.reset();
    // 1. Stored dtypes, after a forward that threw too.
    for (const auto& p : m.named_parameters(/*recurse=*/true)) {
      const auto it = mc.dtypes.find(p.key());
      if (it == mc.dtypes.end() || p.value().scalar_type() != it->second)
        r.violation = "parameter " + p.key() + " is " + std::string(c10::toString(p.value().scalar_type())) +
                      " after a forward, expected its stored dtype";
    }
    if (!error.empty()) {
      if (r.violation.empty()) throw std::runtime_error(error);  // rethrown to the caller as the forward's error
      return;
    }
    // 4. Bytes streamed == non-resident bytes of the DiT (a DiT forward never touches the
    // LLM adapter's layers, which are streamed by encode_text only).
    const offload::EngineStats s = engine.stats();
    if (!s.forward_records.empty()) {
      const uint64_t streamed = s.forward_records.back().bytes_streamed;
      if (streamed != expected && r.violation.empty())
        r.violation = s.model_name + ": bytes_streamed " + std::to_string(streamed) + " != non-resident DiT bytes " +
                      std::to_string(expected);
    }
  });
  return r;
}

struct Totals {
  std::atomic<uint64_t> forwards{0}, faults{0}, violations{0}, budget_changes{0}, budget_refusals{0}, drops{0},
      lora_forwards{0};
  std::mutex mutex;
  std::vector<std::string> messages;  // first violations, for the report

  void violation(const std::string& what) {
    violations += 1;
    std::lock_guard<std::mutex> g(mutex);
    if (messages.size() < 10) messages.push_back(what);
  }
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"sluice_stress: several models, concurrent callers, changing budgets, LoRA, evictions and injected faults"};
  app.add_option("--seconds", a.seconds, "Wall-clock bound")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-forwards", a.max_forwards, "Stop after this many forwards (0: no count bound)")->capture_default_str();
  app.add_option("--threads", a.threads, "Concurrent callers")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--models", a.models, "Models in the cache")->check(CLI::Range(1, 16))->capture_default_str();
  app.add_option("--preset", a.preset, "Model preset")->capture_default_str();
  app.add_option("--seed", a.seed, "Seed of every random choice")->capture_default_str();
  app.add_option("--fault-rate", a.fault_rate, "Probability that a layer's forward throws")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--drift-mib", a.drift_mib, "Allowed RSS growth over the last half (MiB)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    at::set_num_threads(1);  // the CPU device's copy worker needs a core (offload/device/cpu_device.h)
    log::set_level(log::Level::error);
    std::printf("hardware: %s\n", hardware_summary(at::kCPU).c_str());
    const anima::AnimaConfig config = anima::config_from_name_or_file(a.preset);

    // The models: fp8 storage, one of them bf16 storage (no fp8), different seeds.
    std::vector<ModelCase> cases(static_cast<size_t>(a.models));
    for (int i = 0; i < a.models; ++i) {
      ModelCase& mc = cases[static_cast<size_t>(i)];
      mc.spec.source = a.preset;
      mc.spec.seed = a.seed * 100 + static_cast<uint64_t>(i);
      mc.spec.name = a.preset + "#" + std::to_string(i);
      if (i == a.models - 1 && a.models > 1) mc.spec.storage.storage = at::kBFloat16;
      mc.in = make_inputs(config, mc.spec.seed + 7);
    }

    // References at full residency in a cache of their own (no budget, no faults).
    {
      cache::CacheOptions ro;
      ro.device = std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device());
      ro.ram_limit = 0;
      auto ref = cache::ModelCache::create(ro);
      for (auto& mc : cases) {
        cache::LoadSpec full = mc.spec;
        full.max_resident = 1.0;
        auto entry = ref->load(full);
        cache::Lock lock = ref->lock(entry);
        ref->run(lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine&) {
          mc.lora = lora_from_tensors(lora_tensors(config, mc.spec.seed), m, "stress-lora");
          for (const auto& p : m.named_parameters(/*recurse=*/true)) mc.dtypes[p.key()] = p.value().scalar_type();
        });
        mc.ref_plain = checked_forward(*ref, lock, mc, false).out;
        mc.ref_lora = checked_forward(*ref, lock, mc, true).out;
        if (at::equal(mc.ref_plain, mc.ref_lora)) throw std::runtime_error("the stress LoRA does not change the output");
      }
    }

    // The stressed cache: a RAM limit that holds all but one model (so LRU evicts), and a
    // device budget that keeps changing between half and all of the models' full residency.
    const uint64_t model_bytes = cache::estimate_model_bytes(cases[0].spec, at::kCPU);
    cache::CacheOptions co;
    co.device = std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device());
    co.working_memory = 8ull << 20;
    co.ram_limit = a.models > 1 ? model_bytes * static_cast<uint64_t>(a.models - 1) + model_bytes / 2 : 0;
    const uint64_t budget_hi = model_bytes * static_cast<uint64_t>(a.models) * 2 + *co.working_memory;
    const uint64_t budget_lo = model_bytes * static_cast<uint64_t>(a.threads) / 2 + *co.working_memory;
    co.vram_budget = budget_hi;
    auto cache = cache::ModelCache::create(co);

    std::vector<std::shared_ptr<cache::Entry>> entries;
    std::mutex entries_mutex;  // entries are replaced on drop/reload
    for (auto& mc : cases) entries.push_back(cache->load(mc.spec));

    fault::Trigger trig;
    trig.probability = a.fault_rate;
    trig.seed = a.seed;
    if (a.fault_rate > 0) fault::arm("layer.forward", trig);

    Totals totals;
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration<double>(a.seconds);
    std::vector<std::pair<double, uint64_t>> rss_samples;  // (seconds, bytes)
    std::atomic<bool> stop{false};
    auto done = [&] {
      return stop.load() || Clock::now() >= deadline || (a.max_forwards > 0 && totals.forwards.load() >= a.max_forwards);
    };

    auto worker = [&](int index) {
      std::mt19937_64 rng(a.seed * 7919 + static_cast<uint64_t>(index));
      std::uniform_real_distribution<double> u(0.0, 1.0);
      while (!done()) {
        const size_t k = static_cast<size_t>(rng() % cases.size());
        const ModelCase& mc = cases[k];
        std::shared_ptr<cache::Entry> entry;
        {
          std::lock_guard<std::mutex> g(entries_mutex);
          entry = entries[k];
        }
        const double action = u(rng);
        try {
          if (action < 0.08) {  // a new budget for the whole cache
            const uint64_t b = budget_lo + static_cast<uint64_t>(u(rng) * static_cast<double>(budget_hi - budget_lo));
            try {
              cache->set_vram_budget(b);
              totals.budget_changes += 1;
            } catch (const ResourceError&) {
              totals.budget_refusals += 1;  // locked models' minimum does not fit: nothing changed
            }
            continue;
          }
          if (action < 0.16) {  // a new residency cap for this model
            cache->set_max_resident(entry, u(rng) < 0.2 ? std::nullopt : std::optional<double>(u(rng)));
            continue;
          }
          if (action < 0.19) {  // drop and load again (a fresh RAM copy, a miss)
            cache->drop(entry);
            auto fresh = cache->load(mc.spec);
            std::lock_guard<std::mutex> g(entries_mutex);
            entries[k] = fresh;
            totals.drops += 1;
            continue;
          }
          cache::Lock lock = cache->lock(entry);
          const bool with_lora = u(rng) < 0.3;
          ForwardResult r;
          try {
            r = checked_forward(*cache, lock, mc, with_lora);
          } catch (const std::exception& e) {
            if (std::string(e.what()).find("injected fault") == std::string::npos) throw;
            totals.faults += 1;
            continue;
          }
          totals.forwards += 1;
          totals.lora_forwards += with_lora ? 1 : 0;
          if (!r.violation.empty()) totals.violation(r.violation);
          const at::Tensor& ref = with_lora ? mc.ref_lora : mc.ref_plain;
          if (!at::equal(r.out, ref)) totals.violation(mc.spec.name + (with_lora ? " with LoRA" : "") + ": output differs from the reference");
          // Held against the allocator's own count of device bytes alive, not against the
          // ledger that refuses allocations past the limit (that check could never fail).
          // The peak is since the last budget change: compare it with a limit read on both
          // sides of it, skipping the check when another thread changed the budget meanwhile.
          const cache::CacheStats s = cache->stats();
          const auto alive = cache->device().allocator_stats();
          const bool same_budget = cache->stats().vram_budget_bytes == s.vram_budget_bytes;
          if (same_budget && alive.available && static_cast<uint64_t>(alive.peak_bytes) > s.vram_limit_bytes)
            totals.violation("device bytes alive peaked at " + std::to_string(alive.peak_bytes) + " > limit " +
                             std::to_string(s.vram_limit_bytes));
        } catch (const InvalidArgument& e) {
          // Locking a model another thread just dropped: expected; take the fresh entry next time.
          if (std::string(e.what()).find("dropped") == std::string::npos) {
            totals.violation(std::string("unexpected error: ") + e.what());
          }
        } catch (const ResourceError&) {
          totals.budget_refusals += 1;  // the budget is too small for this lock right now
        } catch (const std::exception& e) {
          totals.violation(std::string("unexpected error: ") + e.what());
        }
      }
    };

    std::vector<std::thread> threads;
    for (int i = 0; i < a.threads; ++i) threads.emplace_back(worker, i);
    while (!done()) {
      rss_samples.emplace_back(std::chrono::duration<double>(Clock::now() - start).count(), rss_bytes());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    stop = true;
    for (auto& t : threads) t.join();
    fault::disarm_all();

    // End state: drop everything; the device ledger must be back to zero.
    for (auto& e : entries) cache->drop(e);
    const cache::CacheStats end = cache->stats();
    if (end.vram.current != 0) totals.violation("device memory after dropping every model: " + std::to_string(end.vram.current) + " bytes");
    const auto alive_end = cache->device().allocator_stats();
    if (alive_end.available && alive_end.current_bytes != 0)
      totals.violation("device bytes still alive after dropping every model: " + std::to_string(alive_end.current_bytes));

    // RSS drift: median of the last tenth minus median around the middle of the run.
    double drift_mib = 0;
    if (rss_samples.size() >= 10) {
      auto median_of = [&](size_t from, size_t to) {
        std::vector<uint64_t> v;
        for (size_t i = from; i < to; ++i) v.push_back(rss_samples[i].second);
        std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
        return static_cast<double>(v[v.size() / 2]);
      };
      const size_t n = rss_samples.size();
      const double mid = median_of(n / 2 - n / 20, n / 2 + n / 20 + 1);
      const double tail = median_of(n - n / 10, n);
      drift_mib = (tail - mid) / (1024.0 * 1024.0);
      if (drift_mib > a.drift_mib) totals.violation("host RSS grew by " + std::to_string(drift_mib) + " MiB over the last half");
    }

    for (const auto& m : totals.messages) std::cerr << "stress: violation: " << m << "\n";
    char line[512];
    std::snprintf(line, sizeof line,
                  "stress: %llu forwards, %d models, %d threads, %llu injected faults, %llu invariant violations, RSS drift "
                  "%.1f MiB",
                  static_cast<unsigned long long>(totals.forwards.load()), a.models, a.threads,
                  static_cast<unsigned long long>(totals.faults.load()),
                  static_cast<unsigned long long>(totals.violations.load()), drift_mib);
    std::cout << line << "\n";
    std::cout << "stress: " << totals.lora_forwards.load() << " forwards with LoRA, " << totals.budget_changes.load()
              << " budget changes (" << totals.budget_refusals.load() << " refused), " << totals.drops.load()
              << " drops, cache hits " << end.hits << " misses " << end.misses << " evictions " << end.evictions
              << " device unloads " << end.device_unloads << " device drops " << end.device_drops << "\n";
    const bool ok = totals.violations.load() == 0 && totals.forwards.load() > 0 &&
                    (a.fault_rate == 0 || totals.faults.load() > 0);
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "stress: error: " << e.what() << "\n";
    return 2;
  }
}
