// Fault injection on anima-tiny (fp8 storage) with the CPU-as-device backend: one test per
// fault of Note [engine faults] (offload/engine/engine.h), plus checkpoint and LoRA reads. After
// each fault: every parameter keeps its storage dtype and its bytes equal a pre-fault
// snapshot, the device accounting is back to its pre-fault level (or, for a degraded mode,
// exactly what the engine holds), and the next forward equals the reference bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"
#include "models/lora.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"
#include "tests/support/temp_dir.h"

using namespace sluice;
using namespace sluice::anima;
using namespace sluice::offload;

namespace {

constexpr uint64_t MiB = 1ull << 20;

Fp8Options fp8() {
  Fp8Options o;
  o.storage = at::kFloat8_e4m3fn;
  o.compute = at::kBFloat16;
  return o;
}

AnimaModel fp8_tiny(uint64_t seed = 5) {
  const AnimaConfig c = preset("anima-tiny");
  AnimaModel model(c, BuildOptions{at::kBFloat16, at::kCPU});
  auto params = model->named_parameters();
  for (const auto& [name, t] : random_weights(c, seed, at::kBFloat16)) params[name].set_data(t);
  apply_storage(*model, c.name, fp8(), declared_fp8_skips());
  return model;
}

struct Inputs {
  at::Tensor x, t, ctx, qwen, ids;
};
Inputs inputs() {
  at::manual_seed(11);
  return {at::randn({1, 16, 1, 8, 8}).to(at::kBFloat16), at::full({1}, 0.7), at::randn({1, 6, 32}).to(at::kBFloat16),
          at::randn({1, 7, 32}).to(at::kBFloat16), at::randint(0, 128, {1, 5}, at::kLong)};
}

// One adapter pass and one DiT forward (each its own engine forward when `engine` is set).
at::Tensor step(AnimaModelImpl& m, const Inputs& in, StreamingEngine* engine = nullptr) {
  at::Tensor ctx, v;
  // Inputs on the engine's device (any SLUICE_TEST_DEVICE), results back on the host.
  const c10::Device d = engine ? engine->device().device() : c10::Device(c10::kCPU);
  {
    std::optional<ForwardScope> s;
    if (engine) s.emplace(*engine, "adapter");
    ctx = m.encode_text(in.qwen.to(d), in.ids.to(d)).cpu();
  }
  {
    std::optional<ForwardScope> s;
    if (engine) s.emplace(*engine, "dit");
    v = m.forward(in.x.to(d), in.t.to(d), in.ctx.to(d)).cpu();
  }
  return at::cat({v.flatten(), ctx.flatten()});
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

using Snapshot = std::map<std::string, at::Tensor>;

Snapshot snapshot(torch::nn::Module& m) {
  Snapshot s;
  for (const auto& p : m.named_parameters()) s[p.key()] = p.value().clone();
  return s;
}

// Every parameter: same storage dtype, same bytes as the snapshot.
void require_unchanged(torch::nn::Module& m, const Snapshot& before) {
  const auto params = m.named_parameters();
  REQUIRE(params.size() == before.size());
  for (const auto& p : params) {
    INFO(p.key());
    REQUIRE(same_bits(p.value().cpu(), before.at(p.key())));
  }
}

std::shared_ptr<DeviceBackend> cpu_device() { return sluice::testing::test_device_or_cpu(); }

EngineOptions engine_options(std::shared_ptr<DeviceBackend> dev, double max_resident = 0.5) {
  EngineOptions o;
  o.device = std::move(dev);
  o.budget_bytes = 512 * MiB;
  o.working_memory_bytes = 1 * MiB;
  o.max_resident = max_resident;
  o.plan_from_measurements = false;  // fixed plans: the tests compare bytes and ledgers before and after a fault
  return o;
}

// The engine's ledger holds exactly what it has on the device, and nothing else on the
// device is allocated: resident layers, the ring, one scratch buffer, the other parameters.
// The ring is charged at its capacity; the device holds the slots made within it.
void require_accounting_exact(StreamingEngine& e, AnimaModelImpl& m, DeviceBackend& dev) {
  const EngineStats s = e.stats();
  uint64_t resident = 0;
  for (const auto& [name, l] : managed_layers(m)) {
    if (e.is_resident(name)) resident += static_cast<uint64_t>(l->stored_bytes());
  }
  CHECK(static_cast<uint64_t>(s.device_memory.kind(MemoryKind::resident).current) == resident);
  CHECK(static_cast<uint64_t>(s.device_memory.kind(MemoryKind::ring).current) == s.ring_capacity_bytes);
  CHECK(s.ring_slot_bytes <= s.ring_capacity_bytes);
  CHECK(static_cast<uint64_t>(s.device_memory.kind(MemoryKind::params).current) ==
        s.model_resident_bytes - resident);
  CHECK(e.residency().device_allocated_bytes() == e.device_bytes() - s.ring_capacity_bytes + s.ring_slot_bytes);
  CHECK(e.residency().device_allocated_bytes() == static_cast<uint64_t>(dev.memory_stats().total.current));
  CHECK(s.slot_violations == 0);
}

uint64_t warnings() { return log::message_count(log::Level::warn); }

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception of the expected type>";
}

// One DiT forward only (one engine forward kind: after the first, every copy is a prefetch).
at::Tensor dit(AnimaModelImpl& m, const Inputs& in, StreamingEngine* engine = nullptr) {
  std::optional<ForwardScope> s;
  if (engine) s.emplace(*engine, "dit");
  const c10::Device d = engine ? engine->device().device() : c10::Device(c10::kCPU);
  return m.forward(in.x.to(d), in.t.to(d), in.ctx.to(d)).cpu();
}

// A model, its inputs, its plain (engine-less) reference outputs and parameter snapshot.
struct Rig {
  AnimaModel model = fp8_tiny();
  Inputs in = inputs();
  at::Tensor ref = step(*model, in);
  at::Tensor ref_dit = dit(*model, in);
  Snapshot before = snapshot(*model);
};

// A budget (no max_resident cap) that keeps about `fraction` of the streamable bytes resident.
uint64_t budget_for(AnimaModelImpl& m, double fraction) {
  StreamingEngine probe(engine_options(cpu_device(), 0.0));
  probe.attach(m, "probe");
  return probe.minimum_budget() + static_cast<uint64_t>(fraction * static_cast<double>(probe.plan().streamed_bytes));
}

// Each step streams every streamed layer exactly once (its adapter and DiT forwards together).
void require_streamed_once(StreamingEngine& e) {
  const auto records = e.stats().forward_records;
  REQUIRE(records.size() >= 2);
  CHECK(records[records.size() - 1].bytes_streamed + records[records.size() - 2].bytes_streamed ==
        e.plan().streamed_bytes);
}

// Disarms every point even when a REQUIRE leaves the test early.
struct DisarmAll {
  ~DisarmAll() { fault::disarm_all(); }
};

using sluice::testing::TempDir;  // tests/support/temp_dir.h

void copy_file(const std::string& from, const std::string& to) {
  REQUIRE(std::system(("cp '" + from + "' '" + to + "'").c_str()) == 0);
}

fault::Trigger nth(uint64_t n, uint64_t count = 1) {
  fault::Trigger t;
  t.nth = n;
  t.count = count;
  return t;
}

}  // namespace

TEST_CASE("faults: the engine's forward equals the plain model's before any fault", "[strict][accel]") {
  Rig rig;
  auto dev = cpu_device();
  StreamingEngine engine(engine_options(dev));
  engine.attach(*rig.model, "anima-tiny");
  REQUIRE(engine.plan().streamed_count() > 0);
  REQUIRE(engine.plan().resident_bytes > 0);
  for (int i = 0; i < 2; ++i) CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  require_accounting_exact(engine, *rig.model, *dev);
}

TEST_CASE("faults: a staging slot allocation failing at attach gives the model back", "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  auto dev = cpu_device();
  StreamingEngine engine(engine_options(dev));
  {
    fault::ScopedFault f("device.alloc.ring", nth(2));
    const std::string msg = error_of<ResourceError>([&] { engine.attach(*rig.model, "anima-tiny"); });
    CHECK_THAT(msg, Catch::Contains("staging slot") && Catch::Contains("injected fault"));
    CHECK(f.fired() == 1);
  }
  CHECK_FALSE(engine.attached());
  CHECK(dev->memory_stats().total.current == 0);
  for (const auto& [name, l] : managed_layers(*rig.model)) CHECK(l->provider() == nullptr);
  require_unchanged(*rig.model, rig.before);
  CHECK(same_bits(step(*rig.model, rig.in), rig.ref));
  engine.attach(*rig.model, "anima-tiny");
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
}

TEST_CASE("faults: a staging slot allocation failing in a residency change is an error and the ring comes back",
          "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  auto dev = cpu_device();
  EngineOptions o = engine_options(dev);
  o.max_resident.reset();
  o.budget_bytes = budget_for(*rig.model, 0.25);
  StreamingEngine engine(o);
  engine.attach(*rig.model, "anima-tiny");
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  const uint64_t pre = engine.device_bytes();
  const std::string map = engine.plan().residency_map();
  {
    // Fails the new ring and the one the failed change tries to leave behind.
    fault::ScopedFault f("device.alloc.ring", nth(1, 2));
    const std::string msg = error_of<ResourceError>([&] { engine.budget().partial_load(engine.plan().streamed_bytes / 3); });
    CHECK_THAT(msg, Catch::Contains("staging slot"));
    CHECK(f.fired() == 2);
  }
  // Nothing that full_load() promoted stays: the residency is the pre-fault one.
  CHECK(engine.plan().residency_map() == map);
  CHECK(engine.device_bytes() < pre);  // no ring yet
  require_unchanged(*rig.model, rig.before);
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));  // makes the ring again
  CHECK(engine.device_bytes() == pre);
  require_streamed_once(engine);
  require_accounting_exact(engine, *rig.model, *dev);
  require_unchanged(*rig.model, rig.before);
}

TEST_CASE("faults: out of device memory for resident weights gives a smaller residency and one warning",
          "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  auto dev = cpu_device();
  size_t planned = 0;
  {
    StreamingEngine plain(engine_options(cpu_device()));
    plain.attach(*rig.model, "anima-tiny");
    planned = managed_layers(*rig.model).size() - plain.plan().streamed_count();
  }
  StreamingEngine engine(engine_options(dev));
  const uint64_t warned = warnings();
  {
    // From the 4th resident allocation on, the device is out of memory.
    fault::ScopedFault f("device.alloc.resident", nth(4, std::numeric_limits<uint64_t>::max()));
    engine.attach(*rig.model, "anima-tiny");
    CHECK(f.fired() >= 1);
  }
  CHECK(warnings() == warned + 1);
  const size_t resident = managed_layers(*rig.model).size() - engine.plan().streamed_count();
  CHECK(resident < planned);
  CHECK(resident >= 1);
  require_accounting_exact(engine, *rig.model, *dev);
  for (int i = 0; i < 2; ++i) {
    CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
    require_streamed_once(engine);
  }
  // A later residency change with memory available reaches the full plan.
  engine.budget().full_load();
  CHECK(engine.plan().streamed_count() == 0);
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  // And one failing part way through a residency change degrades the same way.
  engine.budget().full_unload();
  const uint64_t warned2 = warnings();
  {
    fault::ScopedFault f("device.alloc.resident", nth(2));
    engine.budget().full_load();
    CHECK(f.fired() == 1);
  }
  CHECK(warnings() == warned2 + 1);
  CHECK(engine.plan().streamed_count() > 0);
  require_accounting_exact(engine, *rig.model, *dev);
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  engine.detach();
  CHECK(dev->memory_stats().total.current == 0);
  require_unchanged(*rig.model, rig.before);
}

TEST_CASE("faults: scratch or parameter allocation failing at attach gives the model back", "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  for (const char* point : {"device.alloc.scratch", "device.alloc.params"}) {
    INFO(point);
    auto dev = cpu_device();
    StreamingEngine engine(engine_options(dev));
    {
      fault::ScopedFault f(point, nth(1));
      const std::string msg = error_of<ResourceError>([&] { engine.attach(*rig.model, "anima-tiny"); });
      CHECK_THAT(msg, Catch::Contains("injected fault"));
    }
    CHECK_FALSE(engine.attached());
    CHECK(dev->memory_stats().total.current == 0);
    require_unchanged(*rig.model, rig.before);
    CHECK(same_bits(step(*rig.model, rig.in), rig.ref));
    engine.attach(*rig.model, "anima-tiny");
    CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
    engine.detach();
  }
}

TEST_CASE("faults: pinning failing falls back to pageable memory with one warning", "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  auto dev = cpu_device();
  EngineOptions o = engine_options(dev);
  o.pin = PinMode::on;
  {
    StreamingEngine pinned(o);
    pinned.attach(*rig.model, "anima-tiny");
    CHECK(pinned.stats().pinned.current > 0);  // pinning is on: the fault below is what turns it off
  }
  StreamingEngine engine(o);
  const uint64_t warned = warnings();
  {
    fault::ScopedFault f("host.pin", nth(1, std::numeric_limits<uint64_t>::max()));
    engine.attach(*rig.model, "anima-tiny");
    CHECK(f.fired() == 1);  // pinning is given up after the first failure
  }
  CHECK(warnings() == warned + 1);
  CHECK(engine.stats().pinned.current == 0);
  CHECK(engine.plan().streamed_count() > 0);
  for (int i = 0; i < 2; ++i) CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  require_accounting_exact(engine, *rig.model, *dev);
  require_unchanged(*rig.model, rig.before);
}

// [cpu-device]: only the CPU device's copy stream can fail a copy after its enqueue.
TEST_CASE("faults: a streamed copy that fails or times out fails that forward only", "[cpu-device][strict]") {
  DisarmAll guard;
  Rig rig;
  for (const char* point : {"copy.h2d", "copy.h2d.timeout"}) {
    INFO(point);
    auto dev = cpu_device();
    StreamingEngine engine(engine_options(dev));
    engine.attach(*rig.model, "anima-tiny");
    CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));  // records the orders
    const uint64_t pre = engine.device_bytes();
    std::string msg;
    {
      fault::ScopedFault f(point, nth(1));
      msg = error_of<DeviceError>([&] { step(*rig.model, rig.in, &engine); });
      CHECK(f.fired() == 1);
    }
    CHECK_THAT(msg, Catch::Contains("streaming layer '") && Catch::Contains("injected fault"));
    if (std::string(point) == "copy.h2d.timeout") CHECK_THAT(msg, Catch::Contains("timed out"));
    CHECK(msg.find('\n') == std::string::npos);
    require_unchanged(*rig.model, rig.before);
    CHECK(engine.device_bytes() == pre);
    for (int i = 0; i < 2; ++i) CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
    require_streamed_once(engine);
    require_accounting_exact(engine, *rig.model, *dev);
    engine.detach();  // no failure left unreported: detach's synchronize is clean
    CHECK(dev->memory_stats().total.current == 0);
  }
}

TEST_CASE("faults: a copy that cannot be enqueued fails a demand copy and only warns for a prefetch",
          "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  for (const uint32_t depth : {0u, 2u}) {
    INFO("prefetch depth " << depth);
    auto dev = cpu_device();
    EngineOptions o = engine_options(dev);
    o.prefetch_depth = depth;
    StreamingEngine engine(o);
    engine.attach(*rig.model, "anima-tiny");
    for (int i = 0; i < 2; ++i) CHECK(same_bits(dit(*rig.model, rig.in, &engine), rig.ref_dit));
    if (depth > 0) CHECK(engine.stats().forward_records.back().demand_copies == 0);
    const uint64_t pre = engine.device_bytes();
    const uint64_t warned = warnings();
    {
      fault::ScopedFault f("copy.h2d.enqueue", nth(1));
      if (depth == 0) {
        // Every copy is on demand: the acquire that needed it fails, naming the layer.
        const std::string msg = error_of<DeviceError>([&] { dit(*rig.model, rig.in, &engine); });
        CHECK_THAT(msg, Catch::Contains("streaming layer '") && Catch::Contains("injected fault"));
      } else {
        // Once the order is known every copy is a prefetch: a failed one is issued again
        // by the next acquire's prefetch (or on demand), and the layer is copied once.
        CHECK(same_bits(dit(*rig.model, rig.in, &engine), rig.ref_dit));
        CHECK(warnings() == warned + 1);
        const ForwardRecord r = engine.stats().forward_records.back();
        CHECK_FALSE(r.aborted);
        CHECK(r.copies == engine.stats().forward_records.front().copies);
      }
      CHECK(f.fired() == 1);
    }
    require_unchanged(*rig.model, rig.before);
    CHECK(engine.device_bytes() == pre);
    for (int i = 0; i < 2; ++i) CHECK(same_bits(dit(*rig.model, rig.in, &engine), rig.ref_dit));
    CHECK(engine.stats().forward_records.back().bytes_streamed > 0);
    require_accounting_exact(engine, *rig.model, *dev);
  }
}

TEST_CASE("faults: a failed copy while making layers resident undoes the change", "[strict][accel]") {
  DisarmAll guard;
  Rig rig;
  auto dev = cpu_device();
  StreamingEngine engine(engine_options(dev, 0.25));
  {
    // At attach the first copies are the norms and buffers, then resident layers.
    for (const uint64_t n : {1, 4}) {
      fault::ScopedFault f("copy.h2d", nth(n));
      const std::string msg = error_of<DeviceError>([&] { engine.attach(*rig.model, "anima-tiny"); });
      CHECK_THAT(msg, Catch::Contains("injected fault"));
      CHECK_FALSE(engine.attached());
      CHECK(dev->memory_stats().total.current == 0);
      require_unchanged(*rig.model, rig.before);
    }
  }
  CHECK(same_bits(step(*rig.model, rig.in), rig.ref));
  engine.attach(*rig.model, "anima-tiny");
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  const uint64_t pre = engine.device_bytes();
  const std::string map = engine.plan().residency_map();
  {
    fault::ScopedFault f("copy.h2d", nth(2));
    const std::string msg = error_of<DeviceError>([&] { engine.budget().full_load(); });
    CHECK_THAT(msg, Catch::Contains("injected fault"));
  }
  CHECK(engine.plan().residency_map() == map);
  CHECK(engine.device_bytes() == pre);
  require_accounting_exact(engine, *rig.model, *dev);
  require_unchanged(*rig.model, rig.before);
  for (int i = 0; i < 2; ++i) CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
}

// [cpu-device]: its random failures include copies failing after their enqueue.
TEST_CASE("faults: seeded random copy failures never corrupt a forward", "[cpu-device][strict]") {
  DisarmAll guard;
  Rig rig;
  auto dev = cpu_device();
  StreamingEngine engine(engine_options(dev));
  engine.attach(*rig.model, "anima-tiny");
  const uint64_t pre = engine.device_bytes();
  int failed = 0, good = 0;
  {
    fault::Trigger t;
    t.probability = 0.01;
    t.seed = 1234;
    fault::ScopedFault f("copy.h2d", t);
    for (int i = 0; i < 12; ++i) {
      try {
        const at::Tensor out = step(*rig.model, rig.in, &engine);
        CHECK(same_bits(out, rig.ref));
        ++good;
      } catch (const DeviceError& e) {
        CHECK_THAT(e.what(), Catch::Contains("streaming layer '"));
        ++failed;
      }
    }
    CHECK(f.fired() >= 1);
  }
  CHECK(failed >= 1);
  CHECK(good >= 1);
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  CHECK(engine.device_bytes() == pre);
  require_accounting_exact(engine, *rig.model, *dev);
  require_unchanged(*rig.model, rig.before);
}

TEST_CASE("faults: a checkpoint truncated between probe and load is a FileError and changes nothing",
          "[strict][accel]") {
  DisarmAll guard;
  TempDir dir;
  const AnimaConfig c = preset("anima-tiny");
  const std::string good = dir / "tiny.safetensors";
  write_random_checkpoint(c, 7, at::kBFloat16, good);
  LoadOptions lo;
  lo.storage = fp8();
  AnimaModel model = load_anima(good, lo);
  const Inputs in = inputs();
  const at::Tensor ref = step(*model, in);
  const Snapshot before = snapshot(*model);
  // A model holding other weights (seed 8), so that any tensor the failed load copied in
  // would show.
  const std::string other = dir / "other.safetensors";
  write_random_checkpoint(c, 8, at::kBFloat16, other);
  AnimaModel target(c, BuildOptions{at::kBFloat16, at::kCPU});
  {
    auto f = safetensors::File::open(other);
    load_weights(*target, *f, probe_checkpoint(*f).prefix);
  }
  const Snapshot target_before = snapshot(*target);

  const std::string cut = dir / "cut.safetensors";
  copy_file(good, cut);
  auto file = safetensors::File::open(cut);
  const CheckpointProbe probe = probe_checkpoint(*file);
  REQUIRE(probe.is_anima);
  struct stat st {};
  REQUIRE(::stat(cut.c_str(), &st) == 0);
  REQUIRE(::truncate(cut.c_str(), st.st_size / 2) == 0);  // while open and mapped
  const int64_t host_bytes = host_memory_stats().current_bytes();
  const std::string msg = error_of<FileError>([&] { load_weights(*target, *file, probe.prefix); });
  CHECK_THAT(msg, Catch::Contains(cut) && Catch::Contains("truncated"));
  CHECK(host_memory_stats().current_bytes() == host_bytes);  // what it had read is freed
  require_unchanged(*target, target_before);
  // The intact file still loads, and the engine runs it as before.
  AnimaModel again = load_anima(good, lo);
  require_unchanged(*again, before);
  auto dev = cpu_device();
  StreamingEngine engine(engine_options(dev));
  engine.attach(*again, "anima-tiny");
  CHECK(same_bits(step(*again, in, &engine), ref));
}

TEST_CASE("faults: a checkpoint read error is a FileError and changes nothing", "[strict][accel]") {
  DisarmAll guard;
  TempDir dir;
  const AnimaConfig c = preset("anima-tiny");
  const std::string path = dir / "tiny.safetensors";
  write_random_checkpoint(c, 7, at::kBFloat16, path);
  const std::string other = dir / "other.safetensors";
  write_random_checkpoint(c, 8, at::kBFloat16, other);
  AnimaModel target(c, BuildOptions{at::kBFloat16, at::kCPU});
  auto file = safetensors::File::open(path);
  const std::string prefix = probe_checkpoint(*file).prefix;
  load_weights(*target, *safetensors::File::open(other), prefix);  // other weights than `path`'s
  const Snapshot before = snapshot(*target);
  {
    fault::ScopedFault f("safetensors.read", nth(9));
    const int64_t host_bytes = host_memory_stats().current_bytes();
    const std::string msg = error_of<FileError>([&] { load_weights(*target, *file, prefix); });
    CHECK(host_memory_stats().current_bytes() == host_bytes);
    CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("injected fault"));
    CHECK(f.fired() == 1);
  }
  require_unchanged(*target, before);
  {
    fault::ScopedFault f("safetensors.read", nth(3));
    LoadOptions lo;
    lo.storage = fp8();
    CHECK_THROWS_AS(load_anima(path, lo), FileError);
  }
  load_weights(*target, *file, prefix);  // the same file loads once the fault is gone
  CHECK_FALSE(same_bits(target->named_parameters()["blocks.0.mlp.layer1.weight"],
                        before.at("blocks.0.mlp.layer1.weight")));
}

TEST_CASE("faults: a LoRA loader or patch failure leaves no sidecar and the model unchanged", "[strict][accel]") {
  DisarmAll guard;
  TempDir dir;
  Rig rig;
  auto dev = cpu_device();
  StreamingEngine engine(engine_options(dev));
  engine.attach(*rig.model, "anima-tiny");
  // A LoRA on three layers, saved in the PEFT layout.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::manual_seed(21);
  for (const char* name : {"blocks.0.self_attn.q_proj", "blocks.1.mlp.layer1", "llm_adapter.blocks.0.mlp.0"}) {
    at::IntArrayRef w;
    for (const auto& [n, l] : managed_layers(*rig.model)) {
      if (n == name) w = l->stored_weight().sizes();
    }
    REQUIRE(w.size() == 2);
    tensors.emplace_back(std::string(name) + ".lora_A.weight", at::randn({4, w[1]}) * 0.5);
    tensors.emplace_back(std::string(name) + ".lora_B.weight", at::randn({w[0], 4}) * 0.5);
  }
  const std::string path = dir / "lora.safetensors";
  safetensors::save(path, tensors);
  auto no_sidecars = [&] {
    for (const auto& [n, l] : managed_layers(*rig.model)) {
      INFO(n);
      CHECK(l->loras().empty());
    }
  };
  const uint64_t pre = engine.device_bytes();
  {
    fault::ScopedFault f("lora.read", nth(4));
    const std::string msg = error_of<FileError>([&] { load_lora(path, *rig.model); });
    CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("injected fault"));
  }
  no_sidecars();
  const LoraAdapter adapter = load_lora(path, *rig.model);
  REQUIRE(adapter.targets.size() == 3);
  {
    fault::ScopedFault f("lora.patch", nth(3));
    const std::string msg = error_of<ResourceError>([&] { LoraScope scope(*rig.model, adapter); });
    CHECK_THAT(msg, Catch::Contains("llm_adapter.blocks.0.mlp.0") && Catch::Contains("injected fault"));
  }
  no_sidecars();
  require_unchanged(*rig.model, rig.before);
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  {
    LoraScope scope(*rig.model, adapter);  // the same adapter patches fine, and has an effect
    CHECK_FALSE(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  }
  CHECK(same_bits(step(*rig.model, rig.in, &engine), rig.ref));
  CHECK(engine.device_bytes() == pre);
  require_unchanged(*rig.model, rig.before);
}

// --- On the device SLUICE_TEST_DEVICE names (tests/support/device_env.h) -------------

TEST_CASE("faults: env device: after an allocation, copy or layer fault the next forwards equal the fault-free one",
          "[env-device][strict][accel]") {
  DisarmAll guard;
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  AnimaModel model = fp8_tiny();
  const Snapshot before = snapshot(*model);
  Inputs in = inputs();
  in.x = in.x.to(dev->device());
  in.t = in.t.to(dev->device());
  in.ctx = in.ctx.to(dev->device());
  at::Tensor ref;
  {
    StreamingEngine resident(engine_options(dev, 1.0));
    resident.attach(*model, "anima-tiny");
    ref = dit(*model, in, &resident).cpu();
    resident.detach();
  }
  require_unchanged(*model, before);

  StreamingEngine engine(engine_options(dev, 0.0));
  {
    fault::ScopedFault f("device.alloc.ring", nth(1));
    CHECK_THROWS_AS(engine.attach(*model, "anima-tiny"), ResourceError);
    CHECK(f.fired() == 1);
  }
  CHECK_FALSE(engine.attached());
  dev->synchronize();
  CHECK(dev->memory_stats().total.current == 0);
  engine.attach(*model, "anima-tiny");
  REQUIRE(engine.plan().streamed_count() > 0);
  CHECK(same_bits(dit(*model, in, &engine).cpu(), ref));
  const uint64_t held = engine.device_bytes();
  for (const char* point : {"copy.h2d.enqueue", "layer.forward"}) {
    INFO(point);
    {
      fault::ScopedFault f(point, nth(2));
      // A failed prefetch is issued again (the forward succeeds); a failed on-demand copy
      // or layer throws. Either way the result, if any, is right.
      at::Tensor out;
      std::string error;
      try {
        out = dit(*model, in, &engine).cpu();
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (out.defined()) {
        CHECK(same_bits(out, ref));
      } else {
        CHECK_THAT(error, Catch::Contains("injected fault"));
      }
      CHECK(f.fired() == 1);
    }
    dev->synchronize();
    CHECK(engine.device_bytes() == held);
    for (int i = 0; i < 2; ++i) CHECK(same_bits(dit(*model, in, &engine).cpu(), ref));
  }
  CHECK(engine.stats().slot_violations == 0);
  engine.detach();
  dev->synchronize();
  CHECK(dev->memory_stats().total.current == 0);
  require_unchanged(*model, before);
}
