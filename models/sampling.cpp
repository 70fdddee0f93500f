#include "models/sampling.h"

#include <chrono>
#include <cmath>
#include <string>

#include "runtime/error.h"
#include "runtime/shape_str.h"

namespace sluice::sampling {
namespace {

const char* guidance_name(Guidance g) {
  switch (g) {
    case Guidance::cond: return "cond";
    case Guidance::uncond: return "uncond";
    case Guidance::both: return "cond+uncond";
  }
  return "?";
}

// Calls the model and checks what came back: `expected` rows of x's shape, cast to x's dtype.
at::Tensor call(const VelocityFn& velocity, const at::Tensor& x, double sigma, Guidance which, int step) {
  at::Tensor v = velocity(x, sigma, which);
  if (!v.defined() || v.sizes() != x.sizes()) {
    throw InvalidArgument("sampler: the " + std::string(guidance_name(which)) + " velocity at step " +
                          std::to_string(step) + " has shape " + (v.defined() ? shape_str(v.sizes()) : "undefined") +
                          ", expected " + shape_str(x.sizes()));
  }
  if (!at::isFloatingType(v.scalar_type())) {
    throw InvalidArgument("sampler: the " + std::string(guidance_name(which)) + " velocity at step " +
                          std::to_string(step) + " has dtype " + std::string(c10::toString(v.scalar_type())) +
                          ", expected a floating-point dtype");
  }
  return v.to(x.device(), x.scalar_type());
}

}  // namespace

void validate(const SamplerOptions& o) {
  if (o.steps < 1) throw InvalidArgument("sampler: steps must be at least 1, got " + std::to_string(o.steps));
  if (!std::isfinite(o.cfg)) throw InvalidArgument("sampler: cfg must be a finite number, got " + std::to_string(o.cfg));
  if (!std::isfinite(o.shift) || o.shift <= 0.0)
    throw InvalidArgument("sampler: shift must be a positive number, got " + std::to_string(o.shift));
}

std::vector<double> flow_sigmas(int steps, double shift) {
  SamplerOptions o;
  o.steps = steps;
  o.shift = shift;
  validate(o);
  std::vector<double> sigmas(static_cast<size_t>(steps) + 1);
  for (int i = 0; i <= steps; ++i) {
    const double t = 1.0 - static_cast<double>(i) / static_cast<double>(steps);
    sigmas[static_cast<size_t>(i)] = shift * t / (1.0 + (shift - 1.0) * t);
  }
  sigmas.front() = 1.0;  // exact ends whatever the rounding of the shift
  sigmas.back() = 0.0;
  return sigmas;
}

at::Tensor initial_noise(at::IntArrayRef sizes, uint64_t seed, at::TensorOptions options) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor n = at::randn(sizes, gen, at::TensorOptions().dtype(at::kFloat));
  return n.to(options.device_opt().value_or(at::kCPU), options.dtype_opt().has_value()
                                                            ? c10::typeMetaToScalarType(*options.dtype_opt())
                                                            : at::kFloat);
}

at::Tensor sample_euler(const at::Tensor& noise, const VelocityFn& velocity, const SamplerOptions& options,
                        const StepCallback& on_step) {
  validate(options);
  if (!noise.defined() || noise.dim() < 1 || noise.size(0) < 1)
    throw InvalidArgument("sampler: the initial noise must have a batch dimension of at least 1");
  if (!at::isFloatingType(noise.scalar_type()))
    throw InvalidArgument("sampler: the initial noise must be floating point, got " +
                          std::string(c10::toString(noise.scalar_type())));
  if (!velocity) throw InvalidArgument("sampler: no velocity function given");

  const std::vector<double> sigmas = flow_sigmas(options.steps, options.shift);
  const int64_t B = noise.size(0);
  const bool guided = options.cfg != 1.0;
  at::Tensor x = noise.clone();
  for (int i = 0; i < options.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const double sigma = sigmas[static_cast<size_t>(i)];
    const double sigma_next = sigmas[static_cast<size_t>(i) + 1];
    at::Tensor v;
    int calls = 1;
    if (!guided) {
      v = call(velocity, x, sigma, Guidance::cond, i);
    } else {
      at::Tensor v_u, v_c;
      if (options.batch_cfg) {
        const at::Tensor both = call(velocity, at::cat({x, x}, 0), sigma, Guidance::both, i);
        v_u = both.narrow(0, 0, B);
        v_c = both.narrow(0, B, B);
      } else {
        v_u = call(velocity, x, sigma, Guidance::uncond, i);
        v_c = call(velocity, x, sigma, Guidance::cond, i);
        calls = 2;
      }
      v = v_u + (v_c - v_u) * options.cfg;
    }
    x = x + v * (sigma_next - sigma);
    if (on_step) {
      StepInfo info;
      info.step = i;
      info.steps = options.steps;
      info.sigma = sigma;
      info.sigma_next = sigma_next;
      info.model_calls = calls;
      info.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      info.latent = x;
      on_step(info);
    }
  }
  return x;
}

}  // namespace sluice::sampling
