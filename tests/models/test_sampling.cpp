// The flow-matching Euler sampler: schedule, analytic results on known velocity fields,
// guidance arithmetic, determinism and argument errors. Model-free: velocities are closed
// forms, so every expected value is computed independently of the sampler.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "models/sampling.h"
#include "runtime/error.h"

using namespace sluice::sampling;

namespace {

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

// A nonlinear velocity that depends on x, sigma and the guidance branch, elementwise per
// row so that batching cannot change any value.
at::Tensor toy_velocity(const at::Tensor& x, double sigma, Guidance which) {
  const int64_t B = which == Guidance::both ? x.size(0) / 2 : x.size(0);
  auto branch = [&](const at::Tensor& rows, double offset) { return at::tanh(rows * (1.0 + sigma)) + offset; };
  if (which == Guidance::cond) return branch(x, 0.5);
  if (which == Guidance::uncond) return branch(x, -0.25);
  return at::cat({branch(x.narrow(0, 0, B), -0.25), branch(x.narrow(0, B, B), 0.5)}, 0);
}

}  // namespace

TEST_CASE("sampling: the schedule runs from 1 to 0 and applies the time shift") {
  const std::vector<double> linear = flow_sigmas(4, 1.0);
  REQUIRE(linear.size() == 5);
  const double want[] = {1.0, 0.75, 0.5, 0.25, 0.0};
  for (size_t i = 0; i < 5; ++i) CHECK(linear[i] == Approx(want[i]).margin(1e-15));

  const std::vector<double> shifted = flow_sigmas(2, 3.0);
  REQUIRE(shifted.size() == 3);
  CHECK(shifted[0] == 1.0);
  CHECK(shifted[1] == Approx(3.0 * 0.5 / (1.0 + 2.0 * 0.5)));  // 0.75: more time at high noise
  CHECK(shifted[2] == 0.0);
  const std::vector<double> many = flow_sigmas(30, 3.0);
  for (size_t i = 1; i < many.size(); ++i) CHECK(many[i] < many[i - 1]);
}

TEST_CASE("sampling: Euler on the linear field v = x gives the product of its steps") {
  // dx/dsigma = x. Euler: x_{i+1} = x_i * (1 + (sigma_{i+1} - sigma_i)), in closed form.
  for (const double shift : {1.0, 3.0}) {
    for (const int steps : {1, 3, 10}) {
      INFO("shift " << shift << " steps " << steps);
      const at::Tensor x0 = at::arange(1, 7, at::kDouble).view({2, 3});
      SamplerOptions o;
      o.steps = steps;
      o.shift = shift;
      o.cfg = 1.0;
      const at::Tensor out = sample_euler(x0, [](const at::Tensor& x, double, Guidance) { return x; }, o);
      const std::vector<double> s = flow_sigmas(steps, shift);
      double factor = 1.0;
      for (int i = 0; i < steps; ++i) factor *= 1.0 + (s[i + 1] - s[i]);
      CHECK(at::allclose(out, x0 * factor, 1e-12, 1e-12));
      CHECK(out.scalar_type() == at::kDouble);
    }
  }
}

TEST_CASE("sampling: the ideal flow velocity lands exactly on the data") {
  // On the straight path x = (1-s)*data + s*noise the velocity is (x - data)/s: Euler
  // follows the line for any schedule and ends at `data` (Note [flow-matching Euler]).
  const at::Tensor data = at::linspace(-2.0, 3.0, 24, at::kDouble).view({2, 3, 4});
  const at::Tensor noise = initial_noise({2, 3, 4}, 11, at::kDouble);
  for (const double shift : {1.0, 3.0}) {
    SamplerOptions o;
    o.steps = 7;
    o.shift = shift;
    o.cfg = 1.0;
    const at::Tensor out =
        sample_euler(noise, [&](const at::Tensor& x, double sigma, Guidance) { return (x - data) / sigma; }, o);
    CHECK(at::allclose(out, data, 1e-10, 1e-10));
    CHECK_FALSE(at::allclose(noise, data));
  }
}

TEST_CASE("sampling: guidance combines uncond and cond as v_u + cfg*(v_c - v_u)") {
  // Constant velocities a (cond) and b (uncond): one step from sigma 1 to 0 moves x by
  // -(b + cfg*(a - b)).
  const double a = 0.75, b = -0.5;
  auto constant = [&](const at::Tensor& x, double, Guidance which) {
    if (which == Guidance::cond) return at::full_like(x, a);
    if (which == Guidance::uncond) return at::full_like(x, b);
    const int64_t B = x.size(0) / 2;
    return at::cat({at::full_like(x.narrow(0, 0, B), b), at::full_like(x.narrow(0, B, B), a)}, 0);
  };
  const at::Tensor x0 = at::zeros({3, 2}, at::kDouble);
  for (const bool batched : {true, false}) {
    SamplerOptions o;
    o.steps = 1;
    o.cfg = 4.5;
    o.batch_cfg = batched;
    const at::Tensor out = sample_euler(x0, constant, o);
    CHECK(at::allclose(out, at::full_like(x0, -(b + 4.5 * (a - b))), 0, 1e-12));
  }
}

TEST_CASE("sampling: cfg 1 is exactly the conditional model alone") {
  const at::Tensor noise = initial_noise({2, 4, 3}, 5);
  SamplerOptions o;
  o.steps = 6;
  o.cfg = 1.0;
  int uncond_calls = 0;
  const at::Tensor guided = sample_euler(noise,
                                         [&](const at::Tensor& x, double s, Guidance which) {
                                           if (which != Guidance::cond) ++uncond_calls;
                                           return toy_velocity(x, s, which);
                                         },
                                         o);
  CHECK(uncond_calls == 0);
  // The same loop written out with the conditional velocity only.
  const std::vector<double> sig = flow_sigmas(o.steps, o.shift);
  at::Tensor x = noise.clone();
  for (int i = 0; i < o.steps; ++i) x = x + toy_velocity(x, sig[i], Guidance::cond) * (sig[i + 1] - sig[i]);
  CHECK(at::equal(guided, x));
  // And it differs from real guidance.
  o.cfg = 4.5;
  CHECK_FALSE(at::allclose(sample_euler(noise, toy_velocity, o), guided));
}

TEST_CASE("sampling: the same seed gives bit-identical results and batching does not change them") {
  SamplerOptions o;
  o.steps = 5;
  const at::Tensor n1 = initial_noise({1, 16, 1, 8, 8}, 42);
  const at::Tensor n2 = initial_noise({1, 16, 1, 8, 8}, 42);
  const at::Tensor n3 = initial_noise({1, 16, 1, 8, 8}, 43);
  CHECK(n1.scalar_type() == at::kFloat);
  CHECK(at::equal(n1, n2));
  CHECK_FALSE(at::equal(n1, n3));
  const at::Tensor a = sample_euler(n1, toy_velocity, o);
  const at::Tensor b = sample_euler(n2, toy_velocity, o);
  CHECK(at::equal(a, b));
  CHECK_FALSE(at::equal(a, sample_euler(n3, toy_velocity, o)));
  o.batch_cfg = false;
  CHECK(at::equal(a, sample_euler(n1, toy_velocity, o)));
  CHECK(at::equal(n1, n2));  // the input noise is not modified
}

TEST_CASE("sampling: progress is reported once per step with its sigmas and model calls") {
  SamplerOptions o;
  o.steps = 4;
  o.shift = 1.0;
  std::vector<StepInfo> seen;
  sample_euler(initial_noise({1, 2}, 1), toy_velocity, o, [&](const StepInfo& s) { seen.push_back(s); });
  REQUIRE(seen.size() == 4);
  for (int i = 0; i < 4; ++i) {
    CHECK(seen[i].step == i);
    CHECK(seen[i].steps == 4);
    CHECK(seen[i].sigma == Approx(1.0 - 0.25 * i));
    CHECK(seen[i].sigma_next == Approx(0.75 - 0.25 * i).margin(1e-15));
    CHECK(seen[i].model_calls == 1);
    CHECK(seen[i].ms >= 0);
  }
  o.batch_cfg = false;
  seen.clear();
  sample_euler(initial_noise({1, 2}, 1), toy_velocity, o, [&](const StepInfo& s) { seen.push_back(s); });
  REQUIRE(seen.size() == 4);
  CHECK(seen[0].model_calls == 2);
}

TEST_CASE("sampling: bad arguments throw a one-line error naming the field") {
  const at::Tensor n = initial_noise({1, 3}, 0);
  auto expect = [&](SamplerOptions o, const std::string& word) {
    try {
      sample_euler(n, toy_velocity, o);
      FAIL("no error for " << word);
    } catch (const sluice::InvalidArgument& e) {
      const std::string msg = e.what();
      CHECK(one_line(msg));
      CHECK(msg.find(word) != std::string::npos);
    }
  };
  SamplerOptions o;
  o.steps = 0;
  expect(o, "steps");
  o.steps = -3;
  expect(o, "steps");
  o = {};
  o.cfg = std::numeric_limits<double>::quiet_NaN();
  expect(o, "cfg");
  o = {};
  o.shift = 0.0;
  expect(o, "shift");
  CHECK_THROWS_AS(flow_sigmas(0, 1.0), sluice::InvalidArgument);

  // A velocity of the wrong shape is named with its step and branch.
  o = {};
  o.steps = 2;
  try {
    sample_euler(n, [](const at::Tensor& x, double, Guidance) { return x.narrow(0, 0, 1); }, o);
    FAIL("no error for a wrong velocity shape");
  } catch (const sluice::InvalidArgument& e) {
    const std::string msg = e.what();
    CHECK(one_line(msg));
    CHECK(msg.find("step 0") != std::string::npos);
    CHECK(msg.find("shape") != std::string::npos);
  }
}
