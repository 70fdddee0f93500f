// Fused fp8 -> bf16/fp16 upcast with an optional per-tensor or per-row fp32 scale.
//
// Note [cuda upcast kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The upcast is memory-bound (1 byte read, 2 written per element), so each thread moves
// 16-byte vectors: one uint4 load of 16 fp8 bytes, two uint4 stores of 16 outputs. The decode
// is sluice::fp8::decode (runtime/fp8_format.h), the same bit-exact function the CPU tests
// check against ATen for all 256 patterns, so the four encodings (fnuz included, which the
// __nv_fp8 intrinsics do not cover) share one verified path. Scaled values are rounded to
// nearest even by __float2bfloat16_rn / __float2half_rn, as ATen's .to() does on the host.
// When either pointer is not 16-byte aligned the vector loop is skipped and the grid-stride
// scalar loop (which also covers the < 16 element tail) does all the work.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "offload/device/cuda/upcast_cuda.h"
#include "runtime/fp8_format.h"

namespace sluice::offload::cuda {
namespace {

constexpr int kThreads = 256;

template <Fp8Kind K>
__device__ __forceinline__ float decode(uint32_t b) {
  if constexpr (K == Fp8Kind::e4m3fn) return fp8::decode_e4m3fn(b);
  else if constexpr (K == Fp8Kind::e5m2) return fp8::decode_e5m2(b);
  else if constexpr (K == Fp8Kind::e4m3fnuz) return fp8::decode_e4m3fnuz(b);
  else return fp8::decode_e5m2fnuz(b);
}

template <OutKind O>
__device__ __forceinline__ uint32_t to_bits(float v) {
  if constexpr (O == OutKind::bf16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else return __half_as_ushort(__float2half_rn(v));
}

// Walks the scale rows alongside a run of consecutive elements; one 64-bit division per run.
struct RowCursor {
  const float* scale;
  int64_t row_len;
  int64_t row;
  int64_t col;
  float s;
  __device__ __forceinline__ RowCursor(const float* scale_, int64_t row_len_, int64_t first)
      : scale(scale_), row_len(row_len_) {
    row = first / row_len;
    col = first - row * row_len;
    s = scale[row];
  }
  // The scale of the next element.
  __device__ __forceinline__ float next() {
    if (col == row_len) {
      ++row;
      col = 0;
      s = scale[row];
    }
    ++col;
    return s;
  }
};

template <Fp8Kind K, OutKind O, bool Scaled>
__global__ void __launch_bounds__(kThreads)
    upcast_kernel(const uint8_t* __restrict__ in, uint16_t* __restrict__ out, int64_t n, int64_t nvec,
                  const float* __restrict__ scale, int64_t row_len) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  const uint4* in4 = reinterpret_cast<const uint4*>(in);
  uint4* out4 = reinterpret_cast<uint4*>(out);
  for (int64_t v = tid; v < nvec; v += stride) {
    const uint4 x = __ldg(in4 + v);
    const uint32_t words[4] = {x.x, x.y, x.z, x.w};
    uint32_t packed[8];
    if constexpr (Scaled) {
      RowCursor cur(scale, row_len, v * 16);
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const float lo = decode<K>((words[j / 4] >> (8 * (j % 4))) & 0xFFu) * cur.next();
        const float hi = decode<K>((words[j / 4] >> (8 * (j % 4 + 1))) & 0xFFu) * cur.next();
        packed[j / 2] = to_bits<O>(lo) | (to_bits<O>(hi) << 16);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const float lo = decode<K>((words[j / 4] >> (8 * (j % 4))) & 0xFFu);
        const float hi = decode<K>((words[j / 4] >> (8 * (j % 4 + 1))) & 0xFFu);
        packed[j / 2] = to_bits<O>(lo) | (to_bits<O>(hi) << 16);
      }
    }
    out4[2 * v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    out4[2 * v + 1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }

  // Scalar remainder: the tail after the vectors, or everything when unaligned.
  for (int64_t i = nvec * 16 + tid; i < n; i += stride) {
    float f = decode<K>(in[i]);
    if constexpr (Scaled) f *= scale[i / row_len];
    out[i] = static_cast<uint16_t>(to_bits<O>(f));
  }
}

template <Fp8Kind K, OutKind O>
void launch_typed(const UpcastLaunch& a, int64_t nvec, int blocks, cudaStream_t stream) {
  const auto* in = static_cast<const uint8_t*>(a.in);
  auto* out = static_cast<uint16_t*>(a.out);
  if (a.scale) {
    upcast_kernel<K, O, true><<<blocks, kThreads, 0, stream>>>(in, out, a.n, nvec, a.scale, a.row_len);
  } else {
    upcast_kernel<K, O, false><<<blocks, kThreads, 0, stream>>>(in, out, a.n, nvec, nullptr, 1);
  }
}

template <Fp8Kind K>
void launch_out(const UpcastLaunch& a, int64_t nvec, int blocks, cudaStream_t stream) {
  if (a.out_kind == OutKind::bf16) launch_typed<K, OutKind::bf16>(a, nvec, blocks, stream);
  else launch_typed<K, OutKind::f16>(a, nvec, blocks, stream);
}

}  // namespace

int launch_fp8_upcast(const UpcastLaunch& a) {
  if (a.n <= 0) return static_cast<int>(cudaSuccess);
  if (a.scale && a.row_len <= 0) return static_cast<int>(cudaErrorInvalidValue);
  const bool aligned =
      reinterpret_cast<uintptr_t>(a.in) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  const int64_t nvec = aligned ? a.n / 16 : 0;
  const int64_t work = std::max<int64_t>(nvec, a.n - nvec * 16);
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (a.max_blocks > 0) blocks = std::min<int64_t>(blocks, a.max_blocks);
  blocks = std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535);
  auto stream = static_cast<cudaStream_t>(a.stream);
  switch (a.fp8) {
    case Fp8Kind::e4m3fn: launch_out<Fp8Kind::e4m3fn>(a, nvec, static_cast<int>(blocks), stream); break;
    case Fp8Kind::e5m2: launch_out<Fp8Kind::e5m2>(a, nvec, static_cast<int>(blocks), stream); break;
    case Fp8Kind::e4m3fnuz: launch_out<Fp8Kind::e4m3fnuz>(a, nvec, static_cast<int>(blocks), stream); break;
    case Fp8Kind::e5m2fnuz: launch_out<Fp8Kind::e5m2fnuz>(a, nvec, static_cast<int>(blocks), stream); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sluice::offload::cuda
