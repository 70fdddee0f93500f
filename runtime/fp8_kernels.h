#pragma once
// The byte loops of the fused read (runtime/fused_read.h) that run over every weight byte
// of a load, written so that the compiler vectorizes them. No torch here: plain integers
// and floats, so that this file is compiled on its own at -O3 with AVX2 and AVX-512 clones
// (runtime/CMakeLists.txt) while the rest of sluice stays at the build type's flags.
//
// Note [vectorized fp8 loops]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the 2-core development VM a bf16 -> fp8 load spent most of its user time in a
// 65536-entry table lookup per element (3.5 GB/s of bf16 per core), and an fp8 -> fp8 load
// in the per-byte NaN test, which -O2 leaves scalar (about 3 GB/s). The loops below are
// branch-free over lanes, so GCC's -O3 vectorizer turns them into AVX-512 code: the bf16
// -> e4m3fn cast measured 8.2 GB/s of bf16 per core (docs/BENCHMARKS.md, "Load").
//
// cast_bf16_e4m3fn is c10::Float8_e4m3fn's conversion (fp8e4m3fn_from_fp32_value) written
// without branches, for values already clamped to +-448 (the saturating cast sluice does):
//  - |v| >= 2^-6 (normal in e4m3fn): round the fp32 bits to 3 mantissa bits, nearest even,
//    and rebias the exponent from 127 to 7, in one integer add;
//  - |v| < 2^-6: add 2^14 in fp32, whose ulp is 2^-9, the e4m3fn denormal step, so the FPU
//    rounds to nearest even; the low bits are then the denormal's byte;
//  - the sign bit moves from bit 15 of the bf16 to bit 7.
// Every finite bf16 pattern gives c10's byte (tests/test_fp8_kernels.cpp checks all 65536).
#include <cstdint>

namespace sluice::fp8_kernels {

// What a cast of 16-bit floats saw.
struct Cast16Stats {
  int64_t over = 0;      // elements whose magnitude bits exceed `max_bits` (inf/NaN included)
  uint16_t worst = 0;    // largest magnitude bits (sign cleared) seen
};

// bf16 -> float8_e4m3fn, saturating at +-448: out[i] is the byte of clamp(in[i], -448, 448)
// for every finite in[i] (Note [vectorized fp8 loops]); inf/NaN inputs give unspecified
// bytes, which the caller refuses from `worst`. `max_bits` is the bf16 magnitude of 448.
Cast16Stats cast_bf16_e4m3fn(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits);

// Magnitude statistics of 16-bit floats without casting (the table path of other dtypes).
Cast16Stats stats_16(const uint16_t* in, int64_t n, uint16_t max_bits);

// How many of `n` bytes b satisfy (b & mask) == value: NaN bytes of e4m3fn (0x7F, 0x7F),
// inf/NaN bytes of e5m2 (0x7C, 0x7C), the NaN byte of the fnuz types (0xFF, 0x80).
int64_t count_masked(const uint8_t* b, int64_t n, uint8_t mask, uint8_t value);

}  // namespace sluice::fp8_kernels
