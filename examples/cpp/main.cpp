// The smallest useful sluice host: load a model under a budget, run a forward, print the
// residency and the stats. Usage: embed_example [checkpoint.safetensors | preset]
#include <sluice/sluice.hpp>

#include <iostream>

int main(int argc, char** argv) {
  try {
    sluice::RuntimeOptions options;
    options.device = "cpu";               // "cuda" on a GPU machine
    options.device_memory = 256ull << 20;  // the CPU device pretends to have 256 MiB ...
    options.vram_budget = "50%";           // ... of which half is ours
    sluice::ModelCache cache(options);

    sluice::LoadOptions load;
    load.max_resident = 0.5;  // keep half the weights resident, stream the rest
    sluice::Model model = cache.load(argc > 1 ? argv[1] : "anima-tiny", load);
    const sluice::ModelInfo& info = model.info();

    at::Tensor x = at::randn({1, info.in_channels, 1, 16, 16});
    at::Tensor t = at::full({1}, 0.5);
    at::Tensor context = at::randn({1, 8, info.context_dim});
    at::Tensor v;
    {
      sluice::LockedModel m = model.lock();
      v = m(x, t, context);
    }
    std::cout << "velocity " << v.sizes() << " " << v.dtype() << "\n"
              << "residency " << model.residency_map() << "\n"
              << model.stats_json() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "embed_example: error: " << e.what() << "\n";
    return 1;
  }
}
