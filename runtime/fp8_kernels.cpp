#include "runtime/fp8_kernels.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "runtime/logging.h"

// The x86-64 variants need GCC's or clang's target attributes and __builtin_cpu_supports.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SLUICE_FP8_X86 1
#include <immintrin.h>
#define SLUICE_TARGET_AVX2 __attribute__((target("avx2")))
#define SLUICE_TARGET_AVX512 __attribute__((target("avx2,avx512f,avx512bw,popcnt")))
#else
#define SLUICE_FP8_X86 0
#endif

namespace sluice::fp8_kernels {
namespace {

// ---- generic: plain loops for the compiler's vectorizer ------------------------------

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Counts are summed in 32-bit lanes over blocks of this many elements, then into 64 bits:
// a 64-bit sum per element made the vectorizer widen every byte eightfold (11 GB/s against
// 25 GB/s for count_masked).
constexpr int64_t kBlock = 4096;

// The magnitude statistics of 16-bit floats, with `each(i, p, m)` called for element i (bits
// p, magnitude bits m) in the same loop, so that a cast and its range check are one pass.
template <typename Each>
__attribute__((always_inline)) inline Cast16Stats scan_16(const uint16_t* __restrict in, int64_t n,
                                                          uint16_t max_bits, Each&& each) {
  int64_t over = 0;
  uint16_t worst = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = n - start < kBlock ? n : start + kBlock;
    uint32_t block_over = 0;
    for (int64_t i = start; i < end; ++i) {
      const uint16_t p = in[i];
      const uint16_t m = p & 0x7FFF;
      block_over += m > max_bits;
      worst = worst > m ? worst : m;
      each(i, p, m);
    }
    over += block_over;
  }
  return {over, worst};
}

// The denormal's float add is only vectorized for every lane with -fno-trapping-math (set
// for this file) or an ISA with masked float arithmetic (Note [vectorized fp8 loops]).
Cast16Stats cast_generic(const uint16_t* __restrict in, uint8_t* __restrict out, int64_t n, uint16_t max_bits) {
  constexpr uint32_t kRebias = static_cast<uint32_t>(7 - 127) << 23;  // exponent bias 127 -> 7
  constexpr uint32_t kMinNormal = 121u << 23;                          // 2^-6, e4m3fn's smallest normal
  constexpr uint32_t kDenormAdd = 141u << 23;                          // 2^14: its fp32 ulp is 2^-9
  return scan_16(in, n, max_bits, [&](int64_t i, uint16_t p, uint16_t m) {
    const uint32_t a = static_cast<uint32_t>(m) << 16;  // |v| as fp32 bits
    const uint32_t normal = (a + kRebias + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    const uint32_t denormal = bits_of(float_of(a) + float_of(kDenormAdd)) - kDenormAdd;
    uint32_t r = a < kMinNormal ? denormal : normal;
    r = m > max_bits ? 0x7Eu : r;  // saturate: 0x7E is 448
    out[i] = static_cast<uint8_t>(r | ((p >> 8) & 0x80u));
  });
}

Cast16Stats stats_generic(const uint16_t* __restrict in, int64_t n, uint16_t max_bits) {
  return scan_16(in, n, max_bits, [](int64_t, uint16_t, uint16_t) {});
}

int64_t count_generic(const uint8_t* __restrict b, int64_t n, uint8_t mask, uint8_t value) {
  int64_t count = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = n - start < kBlock ? n : start + kBlock;
    uint32_t block_count = 0;
    for (int64_t i = start; i < end; ++i) block_count += (b[i] & mask) == value;
    count += block_count;
  }
  return count;
}

#if SLUICE_FP8_X86

// The constants of the 16-bit-lane conversion (Note [vectorized fp8 loops]).
constexpr short kNormalAdd = static_cast<short>(7 - (120 << 7));  // rebias 127 -> 7, plus 7 of the rounding
constexpr short kMinNormal16 = 121 << 7;                          // 2^-6 as bf16 magnitude bits
constexpr float kDenormAddF = 16384.0f;                           // 2^14: its fp32 ulp is 2^-9
// A 16-bit lane counter takes at most 2 per iteration; flushed before it can pass 32767.
constexpr int kFlushIters = 8192;

// ---- sse2 ------------------------------------------------------------------------------

// The e4m3fn byte (sign not included) of each magnitude m, 0x7E where `gt` (m > max_bits).
inline __m128i byte16_sse2(__m128i m, __m128i gt) {
  const __m128i odd = _mm_and_si128(_mm_srli_epi16(m, 4), _mm_set1_epi16(1));
  const __m128i normal = _mm_srli_epi16(_mm_add_epi16(_mm_add_epi16(m, _mm_set1_epi16(kNormalAdd)), odd), 4);
  const __m128 add = _mm_set1_ps(kDenormAddF);
  const __m128 lo = _mm_add_ps(_mm_castsi128_ps(_mm_slli_epi32(m, 16)), add);  // even elements as fp32
  const __m128 hi = _mm_add_ps(_mm_castsi128_ps(_mm_and_si128(m, _mm_set1_epi32(static_cast<int>(0xFFFF0000u)))), add);
  const __m128i den = _mm_or_si128(_mm_and_si128(_mm_castps_si128(lo), _mm_set1_epi32(0xFFFF)),
                                   _mm_slli_epi32(_mm_castps_si128(hi), 16));
  const __m128i is_normal = _mm_cmpgt_epi16(m, _mm_set1_epi16(kMinNormal16 - 1));
  __m128i r = _mm_or_si128(_mm_and_si128(is_normal, normal), _mm_andnot_si128(is_normal, den));
  return _mm_or_si128(_mm_andnot_si128(gt, r), _mm_and_si128(gt, _mm_set1_epi16(0x7E)));
}

inline int64_t hsum_epi16_sse2(__m128i v) {  // lanes are counts <= 32767
  const __m128i s = _mm_madd_epi16(v, _mm_set1_epi16(1));
  alignas(16) int32_t t[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), s);
  return int64_t{t[0]} + t[1] + t[2] + t[3];
}

inline uint16_t hmax_epi16_sse2(__m128i v) {  // lanes are 0..0x7FFF
  v = _mm_max_epi16(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_max_epi16(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm_max_epi16(v, _mm_shufflelo_epi16(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint16_t>(_mm_cvtsi128_si32(v) & 0xFFFF);
}

template <bool kCast>
Cast16Stats scan16_sse2(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  const __m128i maxv = _mm_set1_epi16(static_cast<short>(max_bits));
  const __m128i mag = _mm_set1_epi16(0x7FFF);
  __m128i worst = _mm_setzero_si128(), over16 = _mm_setzero_si128();
  int64_t over = 0;
  int iters = 0;
  auto step = [&](const uint16_t* src, uint8_t* dst) {
    const __m128i p0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i p1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8));
    const __m128i m0 = _mm_and_si128(p0, mag), m1 = _mm_and_si128(p1, mag);
    const __m128i gt0 = _mm_cmpgt_epi16(m0, maxv), gt1 = _mm_cmpgt_epi16(m1, maxv);  // m <= 0x7FFF: signed is fine
    over16 = _mm_sub_epi16(_mm_sub_epi16(over16, gt0), gt1);
    worst = _mm_max_epi16(worst, _mm_max_epi16(m0, m1));
    if constexpr (kCast) {
      const __m128i sign = _mm_and_si128(_mm_packus_epi16(_mm_srli_epi16(p0, 8), _mm_srli_epi16(p1, 8)),
                                         _mm_set1_epi8(static_cast<char>(0x80)));
      const __m128i r = _mm_packus_epi16(byte16_sse2(m0, gt0), byte16_sse2(m1, gt1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_or_si128(r, sign));
    }
    if (++iters == kFlushIters) {
      over += hsum_epi16_sse2(over16);
      over16 = _mm_setzero_si128();
      iters = 0;
    }
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) step(in + i, out + i);
  if (i < n) {  // the tail, through zero-padded copies (zeros count nowhere)
    alignas(16) uint16_t src[16] = {};
    alignas(16) uint8_t dst[16];
    std::memcpy(src, in + i, static_cast<size_t>(n - i) * 2);
    step(src, dst);
    if constexpr (kCast) std::memcpy(out + i, dst, static_cast<size_t>(n - i));
  }
  return {over + hsum_epi16_sse2(over16), hmax_epi16_sse2(worst)};
}

Cast16Stats cast_sse2(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  return scan16_sse2<true>(in, out, n, max_bits);
}

Cast16Stats stats_sse2(const uint16_t* in, int64_t n, uint16_t max_bits) {
  return scan16_sse2<false>(in, nullptr, n, max_bits);
}

inline int64_t hsum_epu8_sse2(__m128i v) {
  const __m128i s = _mm_sad_epu8(v, _mm_setzero_si128());
  return _mm_cvtsi128_si32(s) + _mm_cvtsi128_si32(_mm_unpackhi_epi64(s, s));
}

int64_t count_sse2(const uint8_t* b, int64_t n, uint8_t mask, uint8_t value) {
  const __m128i maskv = _mm_set1_epi8(static_cast<char>(mask)), valuev = _mm_set1_epi8(static_cast<char>(value));
  int64_t count = 0;
  int64_t i = 0;
  while (i + 16 <= n) {
    // Byte counters take 1 per iteration: at most 255 iterations per block.
    __m128i acc = _mm_setzero_si128();
    const int64_t end = i + 255 * 16 <= n ? i + 255 * 16 : n - 15;
    for (; i < end; i += 16) {
      const __m128i x = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)), maskv);
      acc = _mm_sub_epi8(acc, _mm_cmpeq_epi8(x, valuev));
    }
    count += hsum_epu8_sse2(acc);
  }
  for (; i < n; ++i) count += (b[i] & mask) == value;
  return count;
}

// ---- avx2 ------------------------------------------------------------------------------

SLUICE_TARGET_AVX2 inline __m256i byte16_avx2(__m256i m, __m256i gt) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(m, 4), _mm256_set1_epi16(1));
  const __m256i normal =
      _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(m, _mm256_set1_epi16(kNormalAdd)), odd), 4);
  const __m256 add = _mm256_set1_ps(kDenormAddF);
  const __m256 lo = _mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(m, 16)), add);  // even elements as fp32
  const __m256 hi = _mm256_add_ps(
      _mm256_castsi256_ps(_mm256_and_si256(m, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))), add);
  const __m256i den = _mm256_blend_epi16(_mm256_castps_si256(lo), _mm256_slli_epi32(_mm256_castps_si256(hi), 16), 0xAA);
  // m > 2^-6 - 1 ulp, with m in the first operand: GCC makes constant > m a min and a compare.
  const __m256i is_normal = _mm256_cmpgt_epi16(m, _mm256_set1_epi16(kMinNormal16 - 1));
  const __m256i r = _mm256_blendv_epi8(den, normal, is_normal);
  return _mm256_blendv_epi8(r, _mm256_set1_epi16(0x7E), gt);
}

SLUICE_TARGET_AVX2 inline int64_t hsum_epi16_avx2(__m256i v) {  // lanes are counts <= 32767
  const __m256i s = _mm256_madd_epi16(v, _mm256_set1_epi16(1));
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), s);
  int64_t sum = 0;
  for (const int32_t x : t) sum += x;
  return sum;
}

template <bool kCast>
SLUICE_TARGET_AVX2 Cast16Stats scan16_avx2(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  const __m256i maxv = _mm256_set1_epi16(static_cast<short>(max_bits));
  const __m256i mag = _mm256_set1_epi16(0x7FFF);
  __m256i worst = _mm256_setzero_si256(), over16 = _mm256_setzero_si256();
  int64_t over = 0;
  int iters = 0;
  // 32 elements per step: two registers of 16, packed into one of 32 bytes.
  auto step = [&](const uint16_t* src, uint8_t* dst) SLUICE_TARGET_AVX2 {
    const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16));
    const __m256i m0 = _mm256_and_si256(p0, mag), m1 = _mm256_and_si256(p1, mag);
    const __m256i gt0 = _mm256_cmpgt_epi16(m0, maxv), gt1 = _mm256_cmpgt_epi16(m1, maxv);  // m <= 0x7FFF
    over16 = _mm256_sub_epi16(_mm256_sub_epi16(over16, gt0), gt1);
    worst = _mm256_max_epi16(worst, _mm256_max_epi16(m0, m1));
    if constexpr (kCast) {
      // packus interleaves the 128-bit halves: bytes 0-7 of p0, 0-7 of p1, 8-15 of p0, 8-15 of
      // p1; the permute puts them back in order.
      const __m256i sign = _mm256_and_si256(_mm256_packus_epi16(_mm256_srli_epi16(p0, 8), _mm256_srli_epi16(p1, 8)),
                                            _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i r = _mm256_or_si256(_mm256_packus_epi16(byte16_avx2(m0, gt0), byte16_avx2(m1, gt1)), sign);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(r, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    if (++iters == kFlushIters) {
      over += hsum_epi16_avx2(over16);
      over16 = _mm256_setzero_si256();
      iters = 0;
    }
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) step(in + i, out + i);
  if (i < n) {  // the tail, through zero-padded copies (zeros count nowhere)
    alignas(32) uint16_t src[32] = {};
    alignas(32) uint8_t dst[32];
    std::memcpy(src, in + i, static_cast<size_t>(n - i) * 2);
    step(src, dst);
    if constexpr (kCast) std::memcpy(out + i, dst, static_cast<size_t>(n - i));
  }
  const __m128i w = _mm_max_epi16(_mm256_castsi256_si128(worst), _mm256_extracti128_si256(worst, 1));
  return {over + hsum_epi16_avx2(over16), hmax_epi16_sse2(w)};
}

SLUICE_TARGET_AVX2 Cast16Stats cast_avx2(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  return scan16_avx2<true>(in, out, n, max_bits);
}

SLUICE_TARGET_AVX2 Cast16Stats stats_avx2(const uint16_t* in, int64_t n, uint16_t max_bits) {
  return scan16_avx2<false>(in, nullptr, n, max_bits);
}

SLUICE_TARGET_AVX2 int64_t count_avx2(const uint8_t* b, int64_t n, uint8_t mask, uint8_t value) {
  const __m256i maskv = _mm256_set1_epi8(static_cast<char>(mask));
  const __m256i valuev = _mm256_set1_epi8(static_cast<char>(value));
  __m256i total = _mm256_setzero_si256();  // 4 x 64-bit sums
  int64_t i = 0;
  while (i + 32 <= n) {
    // Byte counters take 1 per iteration: at most 255 iterations per block.
    __m256i acc = _mm256_setzero_si256();
    const int64_t end = i + 255 * 32 <= n ? i + 255 * 32 : n - 31;
    for (; i < end; i += 32) {
      const __m256i x = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)), maskv);
      acc = _mm256_sub_epi8(acc, _mm256_cmpeq_epi8(x, valuev));
    }
    total = _mm256_add_epi64(total, _mm256_sad_epu8(acc, _mm256_setzero_si256()));
  }
  alignas(32) int64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), total);
  int64_t count = t[0] + t[1] + t[2] + t[3];
  for (; i < n; ++i) count += (b[i] & mask) == value;
  return count;
}

// ---- avx512 (F + BW) -------------------------------------------------------------------

// GCC 12 warns of _mm512_undefined_epi32() inside its own _mm512_slli_epi32 (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

template <bool kCast>
SLUICE_TARGET_AVX512 Cast16Stats scan16_avx512(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  const __m512i maxv = _mm512_set1_epi16(static_cast<short>(max_bits));
  const __m512i mag = _mm512_set1_epi16(0x7FFF);
  const __m512i one = _mm512_set1_epi16(1);
  __m512i worst = _mm512_setzero_si512(), over16 = _mm512_setzero_si512();
  int64_t over = 0;
  int iters = 0;
  // 32 elements per step; `live` masks the tail's loads and stores.
  auto step = [&](int64_t at, __mmask32 live) SLUICE_TARGET_AVX512 {
    const __m512i p = live == ~__mmask32{0} ? _mm512_loadu_si512(in + at) : _mm512_maskz_loadu_epi16(live, in + at);
    const __m512i m = _mm512_and_si512(p, mag);
    const __mmask32 gt = _mm512_cmpgt_epu16_mask(m, maxv);
    over16 = _mm512_mask_add_epi16(over16, gt, over16, one);
    worst = _mm512_max_epu16(worst, m);
    if constexpr (kCast) {
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(m, 4), one);
      const __m512i normal =
          _mm512_srli_epi16(_mm512_add_epi16(_mm512_add_epi16(m, _mm512_set1_epi16(kNormalAdd)), odd), 4);
      const __m512 add = _mm512_set1_ps(kDenormAddF);
      const __m512 lo = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(m, 16)), add);
      const __m512 hi = _mm512_add_ps(
          _mm512_castsi512_ps(_mm512_and_si512(m, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))), add);
      const __m512i den = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_castps_si512(lo),
                                                  _mm512_slli_epi32(_mm512_castps_si512(hi), 16));
      const __mmask32 is_den = _mm512_cmplt_epu16_mask(m, _mm512_set1_epi16(kMinNormal16));
      __m512i r = _mm512_mask_blend_epi16(is_den, normal, den);
      r = _mm512_mask_blend_epi16(gt, r, _mm512_set1_epi16(0x7E));
      // r | ((p >> 8) & 0x80): ternary logic A | (B & C) is 0xF8.
      r = _mm512_ternarylogic_epi32(r, _mm512_srli_epi16(p, 8), _mm512_set1_epi16(0x80), 0xF8);
      if (live == ~__mmask32{0}) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + at), _mm512_cvtepi16_epi8(r));
      } else {
        _mm512_mask_cvtepi16_storeu_epi8(out + at, live, r);
      }
    }
    if (++iters == kFlushIters) {
      over += _mm512_reduce_add_epi32(_mm512_madd_epi16(over16, one));
      over16 = _mm512_setzero_si512();
      iters = 0;
    }
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) step(i, ~__mmask32{0});
  if (i < n) step(i, static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1));
  over += _mm512_reduce_add_epi32(_mm512_madd_epi16(over16, one));
  const __m256i w256 = _mm256_max_epu16(_mm512_castsi512_si256(worst), _mm512_extracti64x4_epi64(worst, 1));
  const __m128i w = _mm_max_epi16(_mm256_castsi256_si128(w256), _mm256_extracti128_si256(w256, 1));
  return {over, hmax_epi16_sse2(w)};
}

SLUICE_TARGET_AVX512 Cast16Stats cast_avx512(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  return scan16_avx512<true>(in, out, n, max_bits);
}

SLUICE_TARGET_AVX512 Cast16Stats stats_avx512(const uint16_t* in, int64_t n, uint16_t max_bits) {
  return scan16_avx512<false>(in, nullptr, n, max_bits);
}

SLUICE_TARGET_AVX512 int64_t count_avx512(const uint8_t* b, int64_t n, uint8_t mask, uint8_t value) {
  const __m512i maskv = _mm512_set1_epi8(static_cast<char>(mask));
  const __m512i valuev = _mm512_set1_epi8(static_cast<char>(value));
  int64_t count = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i x = _mm512_and_si512(_mm512_loadu_si512(b + i), maskv);
    count += _mm_popcnt_u64(_mm512_cmpeq_epi8_mask(x, valuev));
  }
  if (i < n) {
    const __mmask64 live = (__mmask64{1} << (n - i)) - 1;  // n - i < 64
    const __m512i x = _mm512_and_si512(_mm512_maskz_loadu_epi8(live, b + i), maskv);
    count += _mm_popcnt_u64(_mm512_mask_cmpeq_epi8_mask(live, x, valuev));
  }
  return count;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // SLUICE_FP8_X86

constexpr Kernels kGeneric{Isa::generic, cast_generic, stats_generic, count_generic};
#if SLUICE_FP8_X86
constexpr Kernels kSse2{Isa::sse2, cast_sse2, stats_sse2, count_sse2};
constexpr Kernels kAvx2{Isa::avx2, cast_avx2, stats_avx2, count_avx2};
constexpr Kernels kAvx512{Isa::avx512, cast_avx512, stats_avx512, count_avx512};
#endif

bool runs(Isa isa) {
  switch (isa) {
    case Isa::generic: return true;
#if SLUICE_FP8_X86
    case Isa::sse2: return true;
    case Isa::avx2: __builtin_cpu_init(); return __builtin_cpu_supports("avx2");
    case Isa::avx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#endif
    default: return false;
  }
}

const Kernels& pick() {
  const std::vector<Isa> isas = available_isas();
  const Isa best = isas.back();
  const char* env = std::getenv("SLUICE_FP8_ISA");
  if (env == nullptr || *env == 0 || std::strcmp(env, "auto") == 0) return kernels(best);
  std::string want = env;
  if (want == "baseline") want = SLUICE_FP8_X86 ? "sse2" : "generic";
  for (const Isa isa : {Isa::generic, Isa::sse2, Isa::avx2, Isa::avx512}) {
    if (want != isa_name(isa)) continue;
    if (runs(isa)) return kernels(isa);
    log::warn(std::string("SLUICE_FP8_ISA=") + env + ": this CPU or build cannot run it; using " + isa_name(best));
    return kernels(best);
  }
  log::warn(std::string("SLUICE_FP8_ISA=") + env + " is none of avx512, avx2, sse2, generic, baseline, auto; using " +
            isa_name(best));
  return kernels(best);
}

const Kernels& active() {
  static const Kernels& k = pick();
  return k;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::generic: return "generic";
    case Isa::sse2: return "sse2";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

std::vector<Isa> available_isas() {
  std::vector<Isa> out;
  for (const Isa isa : {Isa::generic, Isa::sse2, Isa::avx2, Isa::avx512}) {
    if (runs(isa)) out.push_back(isa);
  }
  return out;
}

Isa active_isa() { return active().isa; }

const Kernels& kernels(Isa isa) {
  if (!runs(isa)) {
    throw std::invalid_argument(std::string("fp8 kernels: this CPU or build cannot run ") + isa_name(isa));
  }
  switch (isa) {
#if SLUICE_FP8_X86
    case Isa::sse2: return kSse2;
    case Isa::avx2: return kAvx2;
    case Isa::avx512: return kAvx512;
#endif
    default: return kGeneric;
  }
}

Cast16Stats cast_bf16_e4m3fn(const uint16_t* in, uint8_t* out, int64_t n, uint16_t max_bits) {
  return active().cast_bf16_e4m3fn(in, out, n, max_bits);
}

Scan32Stats stats_32(const uint32_t* __restrict in, int64_t n, uint32_t max_bits) {
  Scan32Stats s;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = n - start < kBlock ? n : start + kBlock;
    uint32_t block_over = 0;
    uint32_t worst = s.worst;
    for (int64_t i = start; i < end; ++i) {
      const uint32_t m = in[i] & 0x7FFFFFFFu;
      block_over += m > max_bits;
      worst = worst > m ? worst : m;
    }
    s.over += block_over;
    s.worst = worst;
  }
  return s;
}

void f32_to_bf16(const uint32_t* __restrict in, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = in[i];
    out[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

void bf16_to_f32(const uint16_t* __restrict in, uint32_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
}

Cast16Stats stats_16(const uint16_t* in, int64_t n, uint16_t max_bits) { return active().stats_16(in, n, max_bits); }

int64_t count_masked(const uint8_t* b, int64_t n, uint8_t mask, uint8_t value) {
  return active().count_masked(b, n, mask, value);
}

}  // namespace sluice::fp8_kernels
