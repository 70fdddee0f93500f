#pragma once
// The byte loops of the fused read (runtime/fused_read.h) that run over every weight byte
// of a load. No torch here: plain integers and floats. On x86-64 each loop exists once per
// instruction set (hand-written SSE2, AVX2 and AVX-512BW intrinsics, plus the portable
// loop); the best one this CPU runs is picked once, at the first call. Elsewhere the
// portable loop is the only variant. This file is compiled at -O3 -fno-trapping-math
// (runtime/CMakeLists.txt) while the rest of sluice stays at the build type's flags.
//
// Note [vectorized fp8 loops]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The variants (Isa below), fastest first:
//   avx512   AVX-512F + AVX-512BW, 32 elements per register, masked tail
//   avx2     AVX2, 16 elements per register
//   sse2     SSE2 (every x86-64 CPU), 8 elements per register
//   generic  the plain C++ loops below, vectorized by the compiler for the build's baseline
//            ISA: the only variant off x86-64 (aarch64 gets NEON from it), and on x86-64
//            the reference the others are tested beside.
// SLUICE_FP8_ISA=avx512|avx2|sse2|generic|baseline (baseline: sse2 on x86-64, generic
// elsewhere), read once at the first call, forces a variant for tests and benchmarks; a
// name that is unknown or that this CPU cannot run is warned about and the best variant is
// used. available_isas() lists what this CPU runs, so tests loop over every variant.
//
// Why hand-written (issue 28, item 5). Until 2026-12-06 the loops were plain C++ compiled as
// GCC target_clones for x86-64-v4, x86-64-v3 and the baseline, and only the v4 clone was
// vectorized. GCC 12 moves the denormal's float add of the generic loop below into the
// branch that uses it; with -ftrapping-math (GCC's default) it may then not compute that add
// for every lane unless the ISA has masked float arithmetic, which only AVX-512 has ("not
// vectorized: control flow in loop" for v3 and the baseline). So the AVX2 and baseline
// clones were scalar, with a branch on |v| < 2^-6 that randn * 0.02 weights (56% below
// 2^-6) mispredict about every other element: 0.5 GB/s of bf16 per core (1.9 GB/s on
// randn * 10) on the AVX-512 EPYC named below, against 23 GB/s for its v4 clone (the GCC 12
// code built with -march=x86-64-v3 / v4). A 2-core AVX2-only AMD EPYC loaded anima-2b
// bf16 -> fp8 in 5.18 s against 1.47 s for safetensors + torch; forcing that clone on the
// AVX-512 EPYC took 4.2-9.0 s. -fno-trapping-math alone gets the generic loop vectorized
// (AVX2 9.9 GB/s, SSE2 4.9 GB/s), but widened to one element per 32-bit lane. The
// intrinsics stay in 16-bit lanes: the float add runs on the two bf16 halves of each 32-bit
// lane in place (shifted up, masked), and the sign and the narrowing to bytes are one pack
// per two registers. One core of a 2-core AMD EPYC (family 26, model 2; avx avx2 fma3 f16c
// avx512_f/bw/cd/dq/vl/vnni/bf16), bf16 GB/s, 1 MiB chunk in L2 / 64 MiB from memory:
// avx512 46 / 28, avx2 24 / 21, sse2 9.3 / 9.0, generic 4.8 / 4.7; the same for randn * 0.02
// and randn * 10 inputs. avx2 is half of avx512 in cache (half the register width) and
// within 1.3x of it from memory. In a whole anima-2b bf16 -> fp8 load on that EPYC the cast
// is now a small share (the rest is pread and page faults): forced to avx2 the load took
// 1.02-1.07x the avx512 one and beat safetensors + torch (docs/BENCHMARKS.md, "Load"). stats_16 and count_masked were vectorized in every clone
// (49 and 30 GB/s for v3); they are written the same way for one code path per variant.
//
// cast_bf16_e4m3fn is c10::Float8_e4m3fn's conversion (fp8e4m3fn_from_fp32_value) written
// without branches, for values already clamped to +-448 (the saturating cast sluice does).
// With m the magnitude bits of the bf16 (exponent in bits 14..7, mantissa in 6..0):
//  - |v| >= 2^-6 (normal in e4m3fn): (m - (120 << 7) + 7 + bit 4 of m) >> 4 rounds the
//    mantissa to 3 bits, nearest even, and rebiases the exponent from 127 to 7;
//  - |v| < 2^-6: add 2^14 in fp32, whose ulp is 2^-9, the e4m3fn denormal step, so the FPU
//    rounds to nearest even; the low bits of the sum are then the denormal's byte (0..8;
//    8 is 2^-6, the smallest normal);
//  - magnitudes beyond max_bits give 0x7E (448), the sign bit moves from bit 15 to bit 7.
// Every finite bf16 pattern gives c10's byte in every variant
// (tests/runtime/test_fp8_kernels.cpp checks all 65536, at odd lengths and offsets). The
// float add assumes the default rounding mode, as c10's conversion does.
#include <cstdint>
#include <vector>

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

// ---- plain loops (one variant, vectorized by the compiler at -O3 for the baseline ISA) --
// The checks and conversions of loads into a non-fp8 dtype (Note [fused read]).

// What a scan of fp32 bits saw.
struct Scan32Stats {
  int64_t over = 0;    // elements whose magnitude bits exceed `max_bits` (inf/NaN included)
  uint32_t worst = 0;  // largest magnitude bits (sign cleared) seen
};
Scan32Stats stats_32(const uint32_t* in, int64_t n, uint32_t max_bits);

// fp32 -> bf16 rounded to nearest even: c10::BFloat16's conversion for every non-NaN value
// (NaN inputs give unspecified bits, which the caller refuses; finite values beyond bf16's
// largest finite value round to inf, which the caller saturates).
void f32_to_bf16(const uint32_t* in, uint16_t* out, int64_t n);

// bf16 -> fp32 (exact).
void bf16_to_f32(const uint16_t* in, uint32_t* out, int64_t n);

// ---- the variants (Note [vectorized fp8 loops]) -------------------------------------

enum class Isa { generic, sse2, avx2, avx512 };

// "generic", "sse2", "avx2", "avx512".
const char* isa_name(Isa isa);

// The variants this build has and this CPU runs, slowest first (generic first, the one
// picked by default last).
std::vector<Isa> available_isas();

// The variant the three functions above run: SLUICE_FP8_ISA if set to one this CPU runs,
// else the last of available_isas(). Decided at the first call.
Isa active_isa();

// One variant's loops, callable whatever active_isa() is. `isa` must be in
// available_isas() (checked: std::invalid_argument otherwise).
struct Kernels {
  Isa isa;
  Cast16Stats (*cast_bf16_e4m3fn)(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits);
  Cast16Stats (*stats_16)(const uint16_t* in, int64_t n, uint16_t max_bits);
  int64_t (*count_masked)(const uint8_t* b, int64_t n, uint8_t mask, uint8_t value);
};
const Kernels& kernels(Isa isa);

}  // namespace sluice::fp8_kernels
