// RoPE tables and rotations checked against numbers computed here by hand (std::pow /
// std::cos in double), independent of models/anima/rope.cpp.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <cmath>

#include "models/anima/rope.h"
#include "runtime/error.h"

using namespace sluice::anima;

namespace {

// Angle of column k for token (t, h, w) per Note [Cosmos 3D RoPE], in double.
double cosmos_angle(int64_t head_dim, double theta, double rt, double rh, double rw, int64_t t, int64_t h, int64_t w,
                    int64_t k) {
  const int64_t dh = (head_dim / 6) * 2, dt = head_dim - 2 * dh;
  auto freq = [&](int64_t d, double ratio, int64_t i) {
    const double th = theta * std::pow(ratio, double(d) / double(d - 2));
    return std::pow(th, -2.0 * double(i) / double(d));
  };
  if (k < dt / 2) return double(t) * freq(dt, rt, k);
  if (k < dt / 2 + dh / 2) return double(h) * freq(dh, rh, k - dt / 2);
  return double(w) * freq(dh, rw, k - dt / 2 - dh / 2);
}

}  // namespace

TEST_CASE("rope: 3D RoPE splits the head like Cosmos") {
  auto s = rope::split_3d(128);
  CHECK(s.dim_t == 44);
  CHECK(s.dim_h == 42);
  CHECK(s.dim_w == 42);
  s = rope::split_3d(16);
  CHECK(s.dim_t == 8);
  CHECK(s.dim_h == 4);
  CHECK(s.dim_w == 4);
  s = rope::split_3d(64);
  CHECK(s.dim_t == 24);
  CHECK(s.dim_h == 20);
  CHECK_THROWS_AS(rope::split_3d(10), sluice::InvalidArgument);  // dim_h 2: NTK exponent undefined
  CHECK_THROWS_AS(rope::split_3d(13), sluice::InvalidArgument);
}

TEST_CASE("rope: 3D RoPE tables match hand-computed angles (anima-2b head)") {
  rope::Params3D p;  // head_dim 128, theta 1e4, ratios t 1, h 4, w 4
  const int64_t T = 2, H = 3, W = 5;
  const auto tables = rope::tables_3d(T, H, W, p, at::kCPU);
  REQUIRE(tables.cos.sizes() == at::IntArrayRef({T * H * W, 64}));
  REQUIRE(tables.cos.scalar_type() == at::kFloat);
  // theta_h = 1e4 * 4^(42/40): the largest spatial wavelength is stretched by ~4.3x.
  CHECK(std::pow(4.0, 42.0 / 40.0) == Approx(4.2870938501451725));
  const auto c = tables.cos.accessor<float, 2>();
  const auto s = tables.sin.accessor<float, 2>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t w = 0; w < W; ++w)
        for (int64_t k : {0, 1, 5, 21, 22, 23, 30, 42, 43, 44, 50, 63}) {
          const int64_t row = (t * H + h) * W + w;
          const double a = cosmos_angle(128, 1e4, 1.0, 4.0, 4.0, t, h, w, k);
          INFO("t=" << t << " h=" << h << " w=" << w << " k=" << k);
          CHECK(c[row][k] == Approx(std::cos(a)).margin(2e-6));
          CHECK(s[row][k] == Approx(std::sin(a)).margin(2e-6));
        }
  // Spot value: column 22 is the first height frequency (1.0), so its angle is h itself.
  CHECK(s[(0 * H + 2) * W + 0][22] == Approx(std::sin(2.0)).margin(1e-6));
  // Column 23: h * (1e4 * 4^(42/40))^(-2/42).
  const double f23 = std::pow(1e4 * std::pow(4.0, 42.0 / 40.0), -2.0 / 42.0);
  CHECK(c[(1 * H + 2) * W + 3][23] == Approx(std::cos(2.0 * f23)).margin(1e-6));
  // Column 43 is the first width frequency (after 22 t and 21 h columns): angle = w.
  CHECK(s[(1 * H + 1) * W + 3][43] == Approx(std::sin(3.0)).margin(1e-6));
}

TEST_CASE("rope: 3D RoPE tables with a small head and other ratios") {
  rope::Params3D p;
  p.head_dim = 16;
  p.theta = 500.0;
  p.t_ratio = 2.0;
  p.h_ratio = 1.0;
  p.w_ratio = 3.0;
  const auto tables = rope::tables_3d(3, 2, 2, p, at::kCPU);
  REQUIRE(tables.sin.sizes() == at::IntArrayRef({12, 8}));
  const auto s = tables.sin.accessor<float, 2>();
  for (int64_t row = 0; row < 12; ++row)
    for (int64_t k = 0; k < 8; ++k) {
      const int64_t t = row / 4, h = (row / 2) % 2, w = row % 2;
      CHECK(s[row][k] == Approx(std::sin(cosmos_angle(16, 500.0, 2.0, 1.0, 3.0, t, h, w, k))).margin(2e-6));
    }
}

TEST_CASE("rope: 3D RoPE rotation pairs element k with k + head_dim/2") {
  rope::Params3D p;
  p.head_dim = 24;
  const int64_t T = 1, H = 2, W = 3, heads = 2, D = 24;
  const auto tables = rope::tables_3d(T, H, W, p, at::kCPU);
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, T * H * W, heads, D});
  const at::Tensor y = rope::apply_3d(x, tables);
  REQUIRE(y.sizes() == x.sizes());
  const auto xa = x.accessor<float, 4>();
  const auto ya = y.accessor<float, 4>();
  for (int64_t row = 0; row < T * H * W; ++row)
    for (int64_t k : {0, 3, 7, 8, 11}) {
      const int64_t h = row / W, w = row % W;
      const double a = cosmos_angle(D, 1e4, 1.0, 4.0, 4.0, 0, h, w, k);
      const double x1 = xa[1][row][1][k], x2 = xa[1][row][1][k + D / 2];
      CHECK(ya[1][row][1][k] == Approx(std::cos(a) * x1 - std::sin(a) * x2).margin(1e-5));
      CHECK(ya[1][row][1][k + D / 2] == Approx(std::sin(a) * x1 + std::cos(a) * x2).margin(1e-5));
    }
  // Position (0,0,0) is the identity; every rotation preserves the per-head norm.
  CHECK(at::equal(y.select(1, 0), x.select(1, 0)));
  CHECK(at::allclose(y.norm(2, -1), x.norm(2, -1), 1e-5, 1e-5));
  // The result keeps the input dtype (computed in fp32 inside).
  CHECK(rope::apply_3d(x.to(at::kBFloat16), tables).scalar_type() == at::kBFloat16);
}

TEST_CASE("rope: adapter RoPE tables and rotate-half rotation match hand-computed values") {
  const int64_t L = 6, D = 8;
  const double theta = 10000.0;
  const auto tables = rope::tables_1d(L, D, theta, at::kCPU);
  REQUIRE(tables.cos.sizes() == at::IntArrayRef({L, D}));
  const auto c = tables.cos.accessor<float, 2>();
  const auto s = tables.sin.accessor<float, 2>();
  for (int64_t pos = 0; pos < L; ++pos)
    for (int64_t k = 0; k < D; ++k) {
      const double a = double(pos) * std::pow(theta, -2.0 * double(k % (D / 2)) / double(D));
      CHECK(c[pos][k] == Approx(std::cos(a)).margin(1e-6));
      CHECK(s[pos][k] == Approx(std::sin(a)).margin(1e-6));
    }
  at::manual_seed(5);
  const at::Tensor x = at::randn({1, 2, L, D});  // [B, heads, L, D]
  const at::Tensor y = rope::apply_1d(x, tables);
  const auto xa = x.accessor<float, 4>();
  const auto ya = y.accessor<float, 4>();
  for (int64_t pos = 0; pos < L; ++pos)
    for (int64_t k = 0; k < D / 2; ++k) {
      const double a = double(pos) * std::pow(theta, -2.0 * double(k) / double(D));
      const double x1 = xa[0][1][pos][k], x2 = xa[0][1][pos][k + D / 2];
      CHECK(ya[0][1][pos][k] == Approx(x1 * std::cos(a) - x2 * std::sin(a)).margin(1e-5));
      CHECK(ya[0][1][pos][k + D / 2] == Approx(x2 * std::cos(a) + x1 * std::sin(a)).margin(1e-5));
    }
  CHECK(at::equal(y.select(2, 0), x.select(2, 0)));
  CHECK(at::allclose(y.norm(2, -1), x.norm(2, -1), 1e-5, 1e-5));
}

TEST_CASE("rope: adapter RoPE scores depend only on the relative position") {
  const int64_t L = 9, D = 16;
  const auto tables = rope::tables_1d(L, D, 10000.0, at::kCPU);
  at::manual_seed(7);
  const at::Tensor q = at::randn({1, 1, 1, D}).expand({1, 1, L, D}).contiguous();
  const at::Tensor k = at::randn({1, 1, 1, D}).expand({1, 1, L, D}).contiguous();
  const at::Tensor rq = rope::apply_1d(q, tables), rk = rope::apply_1d(k, tables);
  const at::Tensor scores = at::matmul(rq, rk.transpose(-1, -2))[0][0];  // [L, L]
  for (int64_t m = 0; m + 3 < L; ++m) {
    CHECK(scores[m][m + 3].item<float>() == Approx(scores[0][3].item<float>()).margin(1e-4));
  }
  // ...and do depend on it.
  CHECK(std::abs(scores[0][3].item<float>() - scores[0][1].item<float>()) > 1e-3);
}
