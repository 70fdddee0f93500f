#pragma once
// Rotary position embeddings of the Anima model, computed on the fly (the reference keeps
// them in non-persistent buffers, never in checkpoints).
//
// Note [Cosmos 3D RoPE]
// ~~~~~~~~~~~~~~~~~~~~~
// The DiT's self-attention rotates q and k per head. The head dim D is split into a
// temporal part dim_t and two spatial parts dim_h = dim_w = (D / 6) * 2, dim_t = D - 2 dim_h
// (128 -> 44/42/42). Each part of width d has d/2 frequencies freq_i = theta'^(-2i/d), where
// theta' = theta * ratio^(d / (d - 2)) (NTK-aware extrapolation; ratios 1/4/4 for t/h/w on
// anima-2b). The D/2 angles of a token at integer position (t, h, w) are
// [t * freq_t | h * freq_h | w * freq_w]; tokens are ordered (t, h, w). Element k of the
// head is paired with element k + D/2 and the pair is rotated by the 2x2 matrix
// [cos -sin; sin cos] of angle k, in fp32:
//   out[k]       = cos_k * x[k] - sin_k * x[k + D/2]
//   out[k + D/2] = sin_k * x[k] + cos_k * x[k + D/2]
//
// Note [adapter RoPE]
// ~~~~~~~~~~~~~~~~~~~
// The LLM adapter uses the "rotate half" layout: inv_freq_i = 1 / theta^(2i/D) for
// i < D/2, angle table [pos * inv_freq | pos * inv_freq] (D wide), and
//   out = x * cos + rotate_half(x) * sin,  rotate_half([a, b]) = [-b, a].
// cos and sin are computed in fp32, then cast to the activation dtype, and the rotation
// runs in that dtype, as in the reference.
#include <ATen/ATen.h>

#include <cstdint>

namespace sluice::anima::rope {

// Widths of the temporal/height/width parts of a head for 3D RoPE (Note [Cosmos 3D RoPE]).
struct Split3D {
  int64_t dim_t = 0;
  int64_t dim_h = 0;
  int64_t dim_w = 0;
};
// Throws InvalidArgument when head_dim is odd or too small for every part to have at least
// two frequencies (head_dim < 12), where the NTK exponent d/(d-2) is undefined.
Split3D split_3d(int64_t head_dim);

// Parameters of the DiT's 3D RoPE.
struct Params3D {
  int64_t head_dim = 128;  // per-head width
  double theta = 10000.0;  // base before the NTK factor
  double t_ratio = 1.0;    // extrapolation ratios per axis
  double h_ratio = 4.0;
  double w_ratio = 4.0;
};

// Angle tables, fp32.
struct Tables {
  at::Tensor cos;
  at::Tensor sin;
};

// Per-part frequencies [dim/2] for one axis: freq_i = 1 / (theta * ratio^(d/(d-2)))^(2i/d).
at::Tensor axis_frequencies(int64_t dim, double theta, double ratio, at::Device device);

// cos/sin tables [T*H*W, head_dim/2] for a token grid, rows in (t, h, w) order.
Tables tables_3d(int64_t T, int64_t H, int64_t W, const Params3D& params, at::Device device);

// Rotates x [..., L, heads, head_dim] (L = T*H*W tokens) with tables from tables_3d, in
// fp32; returns x's dtype.
at::Tensor apply_3d(const at::Tensor& x, const Tables& tables);

// Adapter RoPE tables [L, head_dim] (fp32) for positions 0..L-1 (Note [adapter RoPE]).
Tables tables_1d(int64_t L, int64_t head_dim, double theta, at::Device device);

// Rotates x [B, heads, L, head_dim] with tables_1d's tables, cast to x's dtype first.
at::Tensor apply_1d(const at::Tensor& x, const Tables& tables);

}  // namespace sluice::anima::rope
