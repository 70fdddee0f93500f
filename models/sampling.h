#pragma once
// Flow-matching sampling: Euler steps over sigma from 1 to 0 with classifier-free
// guidance, around any model that predicts a velocity. See Note [flow-matching Euler].
//
// Note [flow-matching Euler]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rectified-flow models (Anima, like Cosmos-Predict2, SD3, Flux) are trained on the
// straight path x_sigma = (1 - sigma) * data + sigma * noise and predict its velocity
// v = dx/dsigma = noise - data, with sigma (in [0, 1]) given to the model as its timestep.
// Sampling integrates dx/dsigma = v(x, sigma) from sigma = 1 (pure noise) to 0 with Euler:
//   x <- x + (sigma_next - sigma) * v(x, sigma).
// The model is never called at sigma = 0. With the ideal velocity (x - data) / sigma, Euler
// stays on the straight line and lands on `data` exactly, for any schedule.
//
// Schedule: sigma_i = shift(1 - i/N), i = 0..N, with the SD3-style time shift
// shift(t) = s*t / (1 + (s-1)*t), which keeps more steps at high noise for s > 1.
// The model's authors publish no schedule for Anima; the default s = 3.0 is the shift ComfyUI
// ships for the Anima/Cosmos-Predict2 flow models (not verified against the authors'
// code); s = 1 is the plain linear schedule.
//
// Guidance: v = v_uncond + cfg * (v_cond - v_uncond). By default the two are one model
// call on a batch of 2 (uncond rows first), so a streamed model moves its weights over
// the bus once per step, not twice. cfg == 1 skips the unconditional call entirely (it
// would cancel), so cfg 1 is exactly cond-only.
//
// Determinism: the sampler's own arithmetic is a fixed sequence of elementwise ops on the
// latent, and initial_noise() draws from a seeded CPU generator whatever the device, so
// the same seed and the same velocities give bit-identical results.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace sluice::sampling {

// Which conditioning one model call evaluates.
enum class Guidance {
  cond,    // x has B rows: the positive context
  uncond,  // x has B rows: the negative (unconditional) context
  both,    // x has 2B rows: rows [0, B) unconditional, rows [B, 2B) conditional
};

// The model's velocity at noise level `sigma` for latent `x` (any shape with the batch
// first); must return a tensor of x's shape (any floating dtype: it is cast to x's).
using VelocityFn = std::function<at::Tensor(const at::Tensor& x, double sigma, Guidance which)>;

// What a finished step reports.
struct StepInfo {
  int step = 0;             // 0-based
  int steps = 0;            // total
  double sigma = 0;         // where the velocity was evaluated
  double sigma_next = 0;    // where the step landed
  int model_calls = 0;      // model calls this step (1 or 2)
  double ms = 0;            // wall time of the step, velocity included
  at::Tensor latent;        // the latent after the step (not a copy: read, never write it)
};
using StepCallback = std::function<void(const StepInfo&)>;

struct SamplerOptions {
  int steps = 30;         // Euler steps (model evaluations per guidance branch); >= 1
  double cfg = 4.5;       // guidance scale; 1 = conditional only (one call of B rows per step)
  double shift = 3.0;     // time shift s of the schedule (Note [flow-matching Euler]); > 0
  bool batch_cfg = true;  // cond + uncond as one call on a batch of 2; false: two calls
};

// Throws InvalidArgument (one line naming the field) when steps < 1, or cfg / shift is not
// finite, or shift <= 0.
void validate(const SamplerOptions& options);

// The N+1 sigmas from 1 down to 0 (Note [flow-matching Euler]).
std::vector<double> flow_sigmas(int steps, double shift);

// Standard normal noise of `sizes` from a CPU generator seeded with `seed` (fp32), the same
// on every machine and device; moved to `options` (device, dtype) afterwards.
at::Tensor initial_noise(at::IntArrayRef sizes, uint64_t seed, at::TensorOptions options = {});

// Integrates from `noise` (sigma = 1) to sigma = 0 and returns the final latent in
// noise's dtype and device. `noise` itself is not modified. Throws InvalidArgument for bad
// options or a velocity of the wrong shape; exceptions from `velocity` propagate.
at::Tensor sample_euler(const at::Tensor& noise, const VelocityFn& velocity, const SamplerOptions& options,
                        const StepCallback& on_step = {});

}  // namespace sluice::sampling
