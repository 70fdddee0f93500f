#include "runtime/fused_read.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <c10/util/Half.h>
#include <c10/util/StringUtil.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/fp8_kernels.h"
#include "runtime/host_memory.h"
#include "runtime/safetensors.h"

namespace sluice::safetensors {
namespace {

// ---- element conversions ----------------------------------------------------------

bool is_16bit_float(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }
// The dtypes the fused read reads and writes: what a weight may be stored as.
bool is_float_storage(at::ScalarType t) { return is_fp8(t) || is_16bit_float(t) || t == at::kFloat; }

float to_float(at::ScalarType t, uint16_t bits) {
  return t == at::kBFloat16 ? static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()))
                            : static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The fp8 byte of a finite float already clamped to +-max finite (c10's conversion: round
// to nearest even, what ATen's .to() does).
template <typename F8>
uint8_t encode(float v) {
  return F8(v).x;
}

using EncodeFn = uint8_t (*)(float);
EncodeFn encoder(at::ScalarType fp8) {
  switch (fp8) {
    case at::kFloat8_e4m3fn: return encode<c10::Float8_e4m3fn>;
    case at::kFloat8_e5m2: return encode<c10::Float8_e5m2>;
    case at::kFloat8_e4m3fnuz: return encode<c10::Float8_e4m3fnuz>;
    case at::kFloat8_e5m2fnuz: return encode<c10::Float8_e5m2fnuz>;
    default: TORCH_INTERNAL_ASSERT(false, "fused read: ", fp8, " is not fp8");
  }
}

// The magnitude bit pattern of +inf in a 16-bit float dtype; anything at or above it is inf/NaN.
uint16_t inf_bits(at::ScalarType t) { return t == at::kBFloat16 ? 0x7F80 : 0x7C00; }
// The magnitude bit pattern of +max finite of `fp8` in 16-bit dtype `t` (exact in both).
uint16_t max_bits(at::ScalarType t, at::ScalarType fp8) {
  const auto m = static_cast<float>(fp8_max_finite(fp8));
  return t == at::kBFloat16 ? c10::BFloat16(m).x : c10::Half(m).x;
}

// A 65536-entry table: the fp8 byte of each 16-bit pattern, saturated to +-max finite
// (NaN/Inf entries are 0; such values are refused before the bytes are used).
struct CastTable {
  uint8_t byte[65536];
};

const CastTable& cast_table(at::ScalarType src, at::ScalarType fp8) {
  static constexpr at::ScalarType kFp8[] = {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz,
                                            at::kFloat8_e5m2fnuz};
  static std::array<std::once_flag, 8> once;
  static std::array<std::unique_ptr<CastTable>, 8> tables;
  const size_t f = static_cast<size_t>(std::find(std::begin(kFp8), std::end(kFp8), fp8) - std::begin(kFp8));
  TORCH_INTERNAL_ASSERT(f < 4 && is_16bit_float(src), "cast_table: ", src, " -> ", fp8);
  const size_t i = f * 2 + (src == at::kHalf ? 1 : 0);
  std::call_once(once[i], [&] {
    auto t = std::make_unique<CastTable>();
    const EncodeFn enc = encoder(fp8);
    const auto maxf = static_cast<float>(fp8_max_finite(fp8));
    for (uint32_t p = 0; p < 65536; ++p) {
      const float v = to_float(src, static_cast<uint16_t>(p));
      t->byte[p] = std::isfinite(v) ? enc(std::clamp(v, -maxf, maxf)) : 0;
    }
    tables[i] = std::move(t);
  });
  return *tables[i];
}

// What a chunk found.
struct ChunkResult {
  int64_t over = 0;  // |v| > max finite, finite
  int64_t nans = 0;
  int64_t infs = 0;
  float amax = 0;    // max |v| over finite values
};

// bf16/fp16 -> fp8: bf16 -> e4m3fn by the vectorized conversion, the rest through the
// table (Note [vectorized fp8 loops]); counts and the amax from the magnitude bits.
void cast_16(const uint16_t* in, uint8_t* out, int64_t n, at::ScalarType src, at::ScalarType fp8, ChunkResult& r) {
  const uint16_t maxb = max_bits(src, fp8);
  const uint16_t infb = inf_bits(src);
  fp8_kernels::Cast16Stats s;
  if (src == at::kBFloat16 && fp8 == at::kFloat8_e4m3fn) {
    s = fp8_kernels::cast_bf16_e4m3fn(in, out, n, maxb);
  } else {
    const CastTable& tab = cast_table(src, fp8);
    for (int64_t i = 0; i < n; ++i) out[i] = tab.byte[in[i]];
    s = fp8_kernels::stats_16(in, n, maxb);
  }
  int64_t over = s.over;
  uint16_t worst = s.worst;
  if (worst >= infb) {  // the error path: count what is not finite, and the finite amax
    worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const auto m = static_cast<uint16_t>(in[i] & 0x7FFF);
      if (m > infb) {
        ++r.nans;
      } else if (m == infb) {
        ++r.infs;
      } else {
        worst = std::max(worst, m);
      }
    }
    over -= r.nans + r.infs;
  }
  r.over += over;
  r.amax = std::max(r.amax, to_float(src, worst));
}

// Loads element i of a bf16/fp16/fp32 buffer as float.
float load(at::ScalarType t, const uint8_t* p, int64_t i) {
  if (t == at::kFloat) {
    float v;
    std::memcpy(&v, p + i * 4, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, p + i * 2, 2);
  return to_float(t, b);
}

// Counts NaN/Inf among values [0, n) of a float buffer and returns the finite amax.
float scan(at::ScalarType t, const uint8_t* in, int64_t n, ChunkResult& r) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(t, in, i);
    if (std::isnan(v)) {
      ++r.nans;
    } else if (std::isinf(v)) {
      ++r.infs;
    } else {
      amax = std::max(amax, std::fabs(v));
    }
  }
  r.amax = std::max(r.amax, amax);
  return amax;
}

// fp32 -> fp8 unscaled, or any float -> fp8 divided by `scale` (a value, or 0 for none).
void cast_float(at::ScalarType t, const uint8_t* in, uint8_t* out, int64_t n, float scale, float maxf, EncodeFn enc,
                ChunkResult& r) {
  for (int64_t i = 0; i < n; ++i) {
    float v = load(t, in, i);
    if (!std::isfinite(v)) {
      std::isnan(v) ? ++r.nans : ++r.infs;
      out[i] = 0;
      continue;
    }
    r.amax = std::max(r.amax, std::fabs(v));
    if (scale != 0) {
      v = v / scale;
    } else if (std::fabs(v) > maxf) {
      ++r.over;
    }
    out[i] = enc(std::min(std::max(v, -maxf), maxf));
  }
}

// Stores `v` (finite, within dtype t's range) as element i of a bf16/fp16/fp32 buffer,
// rounded to nearest even as ATen's .to() does.
void store(at::ScalarType t, uint8_t* p, int64_t i, float v) {
  if (t == at::kFloat) {
    std::memcpy(p + i * 4, &v, 4);
    return;
  }
  const uint16_t b = t == at::kBFloat16 ? c10::BFloat16(v).x : c10::Half(v).x;
  std::memcpy(p + i * 2, &b, 2);
}

// Any float storage dtype -> bfloat16/float16/float32 (not equal): NaN/Inf counted in the same
// pass (count_non_finite's vectorized scan), finite values beyond the destination's largest
// finite value (float16 from bfloat16/float32, bfloat16 from float32) counted and saturated.
// fp8 sources go through the exact tables; bf16 <-> fp32 through the vectorized loops of
// runtime/fp8_kernels.h; pairs with float16 one element at a time (c10's conversions, what
// ATen's .to() computes).
void convert(at::ScalarType src, at::ScalarType dst, const uint8_t* in, uint8_t* out, int64_t n, ChunkResult& r) {
  if (src == at::kFloat && dst == at::kBFloat16) {
    // One scan for both: magnitudes beyond bfloat16's largest finite value (0x7F7F0000 as
    // fp32 bits) are the non-finite ones and the finite ones to saturate (counted, as for
    // fp8, even where they round down to it).
    const auto* in32 = reinterpret_cast<const uint32_t*>(in);
    auto* o = reinterpret_cast<uint16_t*>(out);
    const fp8_kernels::Scan32Stats s = fp8_kernels::stats_32(in32, n, 0x7F7F0000u);
    fp8_kernels::f32_to_bf16(in32, o, n);
    if (s.over == 0) return;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t m = in32[i] & 0x7FFFFFFFu;
      if (m <= 0x7F7F0000u) continue;
      if (m > 0x7F800000u) {
        ++r.nans;
      } else if (m == 0x7F800000u) {
        ++r.infs;
      } else {
        ++r.over;
        r.amax = std::max(r.amax, std::fabs(load(src, in, i)));
        o[i] = static_cast<uint16_t>(((in32[i] >> 16) & 0x8000u) | 0x7F7Fu);
      }
    }
    return;
  }
  const Fp8NonFinite bad = count_non_finite(src, in, n);
  r.nans += bad.nans;
  r.infs += bad.infs;
  if (is_fp8(src)) {  // exact: every fp8 value is a bfloat16, float16 and float32 value
    const Fp8Tables& tab = fp8_tables(src);
    if (dst == at::kFloat) {
      auto* o = reinterpret_cast<float*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = tab.f32[in[i]];
    } else {
      const uint16_t* table = dst == at::kBFloat16 ? tab.bf16 : tab.f16;
      auto* o = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = table[in[i]];
    }
    return;
  }
  if (src == at::kBFloat16 && dst == at::kFloat) {
    fp8_kernels::bf16_to_f32(reinterpret_cast<const uint16_t*>(in), reinterpret_cast<uint32_t*>(out), n);
    return;
  }
  const auto maxf = static_cast<float>(storage_max_finite(dst));
  for (int64_t i = 0; i < n; ++i) {
    float v = load(src, in, i);
    if (!std::isfinite(v)) {  // counted above; refused before the bytes are used
      store(dst, out, i, 0.0f);
      continue;
    }
    if (std::fabs(v) > maxf) {
      ++r.over;
      r.amax = std::max(r.amax, std::fabs(v));
      v = std::copysign(maxf, v);
    }
    store(dst, out, i, v);
  }
}

// ---- the work ---------------------------------------------------------------------

enum class Kind { copy, cast16, cast_float, scaled_rows, scaled_tensor, convert };

struct Plan {
  Kind kind;
  at::ScalarType src, dst;
  int64_t elem_src = 0;  // source element size
  int64_t rows = 1, row_len = 0;
};

struct Chunk {
  size_t target;
  int64_t begin, end;  // elements
};

Plan plan_of(const ReadTarget& t) {
  Plan p;
  p.src = t.source->dtype;
  p.dst = t.dst.scalar_type();
  p.elem_src = static_cast<int64_t>(c10::elementSize(p.src));
  const int64_t n = t.dst.numel();
  p.row_len = n;
  if (p.src == p.dst) {
    p.kind = Kind::copy;
  } else if (!is_fp8(p.dst)) {
    p.kind = Kind::convert;
  } else if (t.scale_mode != ScaleMode::none && t.dst.dim() >= 2 && n > 0) {
    p.kind = t.scale_mode == ScaleMode::per_tensor ? Kind::scaled_tensor : Kind::scaled_rows;
    if (p.kind == Kind::scaled_rows) {
      p.rows = t.dst.size(0);
      p.row_len = n / p.rows;
    }
  } else {
    p.kind = is_16bit_float(p.src) ? Kind::cast16 : Kind::cast_float;
  }
  return p;
}

void check_target(const File& file, const ReadTarget& t) {
  const std::string where = "fused read of '" + file.path() + "': tensor '" + t.name + "'";
  if (t.source == nullptr || !t.dst.defined()) throw InvalidArgument(where + ": no source or no destination");
  if (!t.dst.device().is_cpu() || !t.dst.is_contiguous() || t.dst.numel() != t.source->numel()) {
    throw InvalidArgument(where + ": the destination must be a contiguous CPU tensor of " +
                          std::to_string(t.source->numel()) + " elements");
  }
  if (!is_float_storage(t.source->dtype)) {
    throw InvalidArgument(where + " has dtype " + sluice::dtype_name(t.source->dtype) +
                          ", expected a floating-point tensor (float8, bfloat16, float16 or float32)");
  }
  if (!can_fuse(t.source->dtype, t.dst.scalar_type())) {
    throw InvalidArgument(where + ": cannot read " + sluice::dtype_name(t.source->dtype) + " into " +
                          sluice::dtype_name(t.dst.scalar_type()));
  }
}

}  // namespace

bool can_fuse(at::ScalarType source_dtype, at::ScalarType dst_dtype) {
  if (!is_float_storage(source_dtype) || !is_float_storage(dst_dtype)) return false;
  if (source_dtype == dst_dtype) return true;
  if (is_fp8(dst_dtype)) return !is_fp8(source_dtype);  // bf16/fp16/fp32 -> fp8, checked and saturated
  return true;                                           // any -> bf16/fp16/fp32
}

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

FusedReadStats read_tensors(const File& file, std::vector<ReadTarget>& targets, const FusedReadOptions& options) {
  FusedReadStats stats;
  std::vector<Plan> plans;
  plans.reserve(targets.size());
  for (auto& t : targets) {
    check_target(file, t);
    plans.push_back(plan_of(t));
    t.scale = at::Tensor();
    t.clipped = 0;
    t.cast = plans.back().kind != Kind::copy;
    if (plans.back().kind == Kind::scaled_rows) t.scale = at::empty({plans.back().rows}, at::kFloat);
  }
  // Chunks in file order, so that the workers read the file front to back.
  std::vector<size_t> order(targets.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return targets[a].source->begin < targets[b].source->begin; });
  const uint64_t chunk_bytes = std::max<uint64_t>(options.chunk_bytes, 64);
  std::vector<Chunk> chunks[2];  // [0]: the amax pass of per-tensor scaled targets; [1]: everything
  int64_t buffer_bytes = 0;  // a worker's buffer: the largest chunk that is cast from one
  for (size_t i : order) {
    const Plan& p = plans[i];
    const int64_t n = targets[i].dst.numel();
    if (n == 0) continue;
    // Elements per chunk: whole rows for a per-channel scale, else any count.
    const int64_t unit = p.kind == Kind::scaled_rows ? p.row_len : 1;
    const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes) / (p.elem_src * unit)) * unit;
    for (int64_t b = 0; b < n; b += per) {
      const int64_t e = std::min(n, b + per);
      if (p.kind == Kind::scaled_tensor) chunks[0].push_back({i, b, e});
      chunks[1].push_back({i, b, e});
      if (p.kind != Kind::copy) buffer_bytes = std::max(buffer_bytes, (e - b) * p.elem_src);
    }
  }
  const int threads = resolve_threads(options.threads);
  stats.threads = threads;
  std::atomic<uint64_t> done{0};
  std::vector<float> tensor_scale(targets.size(), 0.0f);  // per-tensor scales, between the passes

  auto run_phase = [&](int phase, std::vector<ChunkResult>& results) {
    const std::vector<Chunk>& list = chunks[phase];
    results.assign(list.size(), ChunkResult{});
    std::atomic<size_t> next{0};
    std::atomic<bool> stop{false};
    std::mutex err_mu;
    std::exception_ptr err;
    auto work = [&](bool caller) {
      std::unique_ptr<uint8_t[]> buf;
      if (buffer_bytes > 0) buf.reset(new uint8_t[static_cast<size_t>(buffer_bytes)]);
      while (!stop.load(std::memory_order_relaxed)) {
        const size_t k = next.fetch_add(1);
        if (k >= list.size()) break;
        const Chunk& c = list[k];
        ReadTarget& t = targets[c.target];
        const Plan& p = plans[c.target];
        ChunkResult& r = results[k];
        const int64_t n = c.end - c.begin;
        const uint64_t nbytes = static_cast<uint64_t>(n * p.elem_src);
        try {
          auto* dst = static_cast<uint8_t*>(t.dst.data_ptr());
          populate_pages(dst + c.begin * static_cast<int64_t>(t.dst.element_size()),
                   static_cast<uint64_t>(n * static_cast<int64_t>(t.dst.element_size())));
          if (p.kind == Kind::copy) {
            // Straight into `dst`, whose pages populate_pages() has just faulted in.
            uint8_t* at = dst + c.begin * p.elem_src;
            file.read_range(*t.source, static_cast<uint64_t>(c.begin * p.elem_src), nbytes, at);
            // Checked while the chunk is in cache (Note [fused read]).
            const Fp8NonFinite bad = count_non_finite(p.dst, at, n);
            r.nans += bad.nans;
            r.infs += bad.infs;
          } else if (p.kind == Kind::convert) {
            file.read_range(*t.source, static_cast<uint64_t>(c.begin * p.elem_src), nbytes, buf.get());
            convert(p.src, p.dst, buf.get(), dst + c.begin * static_cast<int64_t>(t.dst.element_size()), n, r);
          } else {
            file.read_range(*t.source, static_cast<uint64_t>(c.begin * p.elem_src), nbytes, buf.get());
            const auto maxf = static_cast<float>(fp8_max_finite(p.dst));
            uint8_t* out = dst + c.begin;
            switch (p.kind) {
              case Kind::cast16:
                cast_16(reinterpret_cast<const uint16_t*>(buf.get()), out, n, p.src, p.dst, r);
                break;
              case Kind::cast_float: cast_float(p.src, buf.get(), out, n, 0.0f, maxf, encoder(p.dst), r); break;
              case Kind::scaled_tensor:
                if (phase == 0) {
                  scan(p.src, buf.get(), n, r);
                } else {
                  cast_float(p.src, buf.get(), out, n, tensor_scale[c.target], maxf, encoder(p.dst), r);
                }
                break;
              case Kind::scaled_rows: {
                float* scales = t.scale.data_ptr<float>();
                for (int64_t row = c.begin / p.row_len; row * p.row_len < c.end; ++row) {
                  const uint8_t* in = buf.get() + (row * p.row_len - c.begin) * p.elem_src;
                  ChunkResult rr;
                  const float amax = scan(p.src, in, p.row_len, rr);
                  // As cast_to_storage: 1 for an all-zero row, else amax / max finite (fp32),
                  // floored at FLT_MIN.
                  const float s = amax == 0.0f ? 1.0f : std::max(amax / maxf, FLT_MIN);
                  scales[row] = s;
                  cast_float(p.src, in, out + (row * p.row_len - c.begin), p.row_len, s, maxf, encoder(p.dst), r);
                }
                break;
              }
              case Kind::copy:
              case Kind::convert: break;
            }
          }
        } catch (...) {
          std::lock_guard<std::mutex> lock(err_mu);
          if (!err) err = std::current_exception();
          stop.store(true);
        }
        const uint64_t now = done.fetch_add(nbytes) + nbytes;
        if (caller && options.progress) options.progress(now);
      }
    };
    std::vector<std::thread> pool;
    const size_t extra = std::min<size_t>(static_cast<size_t>(threads) - 1, list.empty() ? 0 : list.size() - 1);
    pool.reserve(extra);
    try {
      for (size_t i = 0; i < extra; ++i) pool.emplace_back(work, false);
    } catch (const std::system_error&) {
      // No more threads to be had: the ones started (and this one) do the work.
    }
    work(true);
    for (auto& th : pool) th.join();
    if (options.progress) options.progress(done.load());
    if (err) std::rethrow_exception(err);
    stats.chunks += static_cast<int64_t>(list.size());
  };

  // Per-target totals of one phase.
  auto totals = [&](const std::vector<Chunk>& list, const std::vector<ChunkResult>& results) {
    std::vector<ChunkResult> sum(targets.size());
    for (size_t k = 0; k < list.size(); ++k) {
      ChunkResult& s = sum[list[k].target];
      s.over += results[k].over;
      s.nans += results[k].nans;
      s.infs += results[k].infs;
      s.amax = std::max(s.amax, results[k].amax);
    }
    return sum;
  };
  const std::string where = "file '" + file.path() + "'";
  auto refuse_any_non_finite = [&](const std::vector<ChunkResult>& sum) {
    for (size_t i : order) {
      refuse_non_finite(targets[i].name, sum[i].nans, sum[i].infs, targets[i].dst.scalar_type(), where);
    }
  };

  std::vector<ChunkResult> results;
  if (!chunks[0].empty()) {
    run_phase(0, results);
    const auto sum = totals(chunks[0], results);
    refuse_any_non_finite(sum);
    for (const Chunk& c : chunks[0]) {
      tensor_scale[c.target] = fp8_tensor_scale(sum[c.target].amax, targets[c.target].dst.scalar_type());
    }
  }
  run_phase(1, results);
  const auto sum = totals(chunks[1], results);
  refuse_any_non_finite(sum);
  for (size_t i : order) {
    ReadTarget& t = targets[i];
    const Plan& p = plans[i];
    if (p.kind == Kind::scaled_tensor) t.scale = at::full({}, tensor_scale[i], at::kFloat);
    if (t.cast) ++stats.cast;
    if (sum[i].over == 0) continue;
    report_out_of_range(t.name, sum[i].over, t.dst.numel(), sum[i].amax, t.dst.scalar_type(), options.out_of_range);
    t.clipped = sum[i].over;
    stats.clipped += t.clipped;
  }
  stats.bytes_read = done.load();
  return stats;
}

}  // namespace sluice::safetensors
