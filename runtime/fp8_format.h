#pragma once
// Bit-level decode of the four fp8 encodings, written once for host and device.
//
// The CUDA upcast kernel (offload/device/cuda/upcast_cuda.cu) decodes with these functions, and the
// CPU tests check them against ATen's own conversion for all 256 byte patterns of every
// format, so the device decode is verified on a machine without a GPU. This header includes
// neither torch nor CUDA headers, so nvcc compiles it without torch's flags.
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SLUICE_HD __host__ __device__ __forceinline__
#else
#define SLUICE_HD inline
#endif

namespace sluice::fp8 {

// The encodings, in the same order as the Fp8Format enum used by the CUDA launcher.
enum class Format : int {
  e4m3fn = 0,    // bias 7, no inf, NaN = S.1111.111, max 448
  e5m2 = 1,      // bias 15, IEEE-like: inf = S.11111.00, NaN = S.11111.xx, max 57344
  e4m3fnuz = 2,  // bias 8, no inf, no -0, NaN = 0x80, max 240
  e5m2fnuz = 3,  // bias 16, no inf, no -0, NaN = 0x80, max 57344
};

SLUICE_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Decodes one fp8 byte of encoding <E exponent bits, M mantissa bits, Bias>. Exact: every
// fp8 value is a float. Subnormals are built from an integer times a power of two so that
// no float denormal is involved (device code may flush those).
template <int E, int M, int Bias, Format F>
SLUICE_HD float decode(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t e = (b >> M) & ((1u << E) - 1u);
  const uint32_t m = b & ((1u << M) - 1u);
  if constexpr (F == Format::e4m3fnuz || F == Format::e5m2fnuz) {
    if (b == 0x80u) return bits_to_float(0x7FC00000u);
  } else if constexpr (F == Format::e4m3fn) {
    if ((b & 0x7Fu) == 0x7Fu) return bits_to_float(sign | 0x7FC00000u);
  } else {  // e5m2
    if (e == (1u << E) - 1u) return bits_to_float(sign | (m ? 0x7FC00000u : 0x7F800000u));
  }
  if (e == 0) {
    // m * 2^(1 - Bias - M); the power of two is a normal float for every format here.
    const float unit = bits_to_float(static_cast<uint32_t>(127 + 1 - Bias - M) << 23);
    const float v = static_cast<float>(m) * unit;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((e + 127u - Bias) << 23) | (m << (23 - M)));
}

SLUICE_HD float decode_e4m3fn(uint32_t b) { return decode<4, 3, 7, Format::e4m3fn>(b); }
SLUICE_HD float decode_e5m2(uint32_t b) { return decode<5, 2, 15, Format::e5m2>(b); }
SLUICE_HD float decode_e4m3fnuz(uint32_t b) { return decode<4, 3, 8, Format::e4m3fnuz>(b); }
SLUICE_HD float decode_e5m2fnuz(uint32_t b) { return decode<5, 2, 16, Format::e5m2fnuz>(b); }

// Runtime-dispatched decode, for host code and tests.
inline float decode(Format f, uint8_t b) {
  switch (f) {
    case Format::e4m3fn: return decode_e4m3fn(b);
    case Format::e5m2: return decode_e5m2(b);
    case Format::e4m3fnuz: return decode_e4m3fnuz(b);
    case Format::e5m2fnuz: return decode_e5m2fnuz(b);
  }
  return 0.0f;
}

}  // namespace sluice::fp8
