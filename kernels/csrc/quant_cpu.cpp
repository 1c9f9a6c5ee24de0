// CPU library of the chunkmem quantization kernels: a plain C ABI over raw pointers, loaded
// with ctypes by kernels/_native.py. OpenMP runs groups in parallel. Within a group, the AVX2
// lanes of quant_avx2.h take the elements up to a multiple of their block and the scalar loops
// below the rest (all of it on CPUs without AVX2); the scalar loops are written so that g++ -O3
// vectorises them (integer min/max statistics, no data-dependent branches).
// Per-element math lives in quant_math.h; the spec is docs/kernels.md.
#include <omp.h>

#include <new>
#include <type_traits>
#include <vector>

#include "quant_avx2.h"
#include "quant_math.h"

namespace {

using cmq::byte_of;
using cmq::ceil_div;
using cmq::F32;
using cmq::GroupParams;
using cmq::GroupSpan;
using cmq::GroupStats;
using cmq::level_value;
using cmq::valid_layout;
using cmq::with_dtype;
using cmq::with_format;

// Below this many elements the kernels run on the calling thread: waking the OpenMP team
// costs more than the work.
constexpr int64_t kParallelMinNumel = 1 << 15;

// Asks for the next group's input (the n elements after this group's n) while this group is
// being encoded, so that memory traffic overlaps the arithmetic of the second pass. Only
// quantize does this: the fused requantize encodes from its scratch, and prefetching past that
// pulls in the lines of another thread's scratch; its inputs stream in fine without help.
template <class T>
void prefetch_next(const T* x, int64_t n) {
  const char* next = reinterpret_cast<const char*>(x + n);
  const int64_t nbytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(next + b);
}

// Statistics of x[0, n); only those that a SYM group reads are complete.
template <class In, bool SYM>
GroupStats stats_of(const typename In::Raw* x, int64_t n) {
  int64_t i = 0;
  GroupStats lanes = cmq::empty_stats();
#if CMQ_HAVE_AVX2
  lanes = cmq::avx2::stats_prefix<In, SYM>(x, n, i);
#endif
  // Three separate scalar accumulators keep the loop a plain integer max/min reduction,
  // which g++ vectorises.
  uint32_t abs_bits = 0;
  int32_t min_key = INT32_MAX;
  int32_t max_key = INT32_MIN;
  for (; i < n; ++i) {
    const uint32_t u = cmq::bits_of(In::load(x[i]));
    const uint32_t a = u & 0x7FFFFFFFu;
    const int32_t k = cmq::order_key(u);
    abs_bits = a > abs_bits ? a : abs_bits;
    min_key = k < min_key ? k : min_key;
    max_key = k > max_key ? k : max_key;
  }
  return cmq::merge_stats(lanes, GroupStats{abs_bits, min_key, max_key});
}

// Encodes `valid` elements of x, then `length - valid` zeros, into q (a finite group; for
// int4, q starts on a byte).
template <class In, class Fmt>
void encode_levels(const typename In::Raw* x, int64_t valid, int64_t length, const GroupParams& p,
                   uint8_t* q) {
  constexpr int kBits = Fmt::kBits;
  constexpr bool kSym = Fmt::kSymmetric;
  const uint8_t pad = cmq::encode_level<kBits>(cmq::quantize_value<kSym>(0.0f, p));
  if (kBits == 8) {
    for (int64_t i = 0; i < valid; ++i)
      q[i] = cmq::encode_level<8>(cmq::quantize_value<kSym>(In::load(x[i]), p));
    for (int64_t i = valid; i < length; ++i) q[i] = pad;
    return;
  }
  const int64_t pairs = valid / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const int lo = cmq::quantize_value<kSym>(In::load(x[2 * k]), p);
    const int hi = cmq::quantize_value<kSym>(In::load(x[2 * k + 1]), p);
    q[k] = static_cast<uint8_t>(cmq::encode_level<4>(lo) | (cmq::encode_level<4>(hi) << 4));
  }
  for (int64_t e = 2 * pairs; e < length; e += 2) {
    // The pairs past the last full pair of valid data: real, padded or absent elements.
    const uint8_t lo = e < valid
                           ? cmq::encode_level<4>(cmq::quantize_value<kSym>(In::load(x[e]), p))
                           : pad;
    const uint8_t hi = e + 1 < length ? pad : 0;
    q[e / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// Quantizes one group with known statistics: span.valid elements of x, then zeros up to
// span.length.
template <class In, class Fmt>
void encode_group(const typename In::Raw* x, const GroupSpan& span, const GroupStats& stats,
                  uint8_t* q, float* scale, float* offset) {
  constexpr int kBits = Fmt::kBits;
  const GroupParams p = cmq::group_params<Fmt::kSymmetric>(stats, kBits);
  *scale = p.scale;
  if (!Fmt::kSymmetric) *offset = p.offset;
  if (!p.finite) {
    const int64_t nbytes = kBits == 8 ? span.length : (span.length + 1) / 2;
    for (int64_t i = 0; i < nbytes; ++i) q[i] = 0;
    return;
  }
  int64_t done = 0;
#if CMQ_HAVE_AVX2
  done = cmq::avx2::encode_prefix<In, Fmt>(x, span.valid, p, q);
#endif
  encode_levels<In, Fmt>(x + done, span.valid - done, span.length - done, p,
                         q + byte_of<kBits>(done));
}

// Quantizes one group: span.valid elements of x, then zeros up to span.length.
template <class In, class Fmt>
void quantize_group(const typename In::Raw* x, const GroupSpan& span, uint8_t* q, float* scale,
                    float* offset) {
  GroupStats stats = stats_of<In, Fmt::kSymmetric>(x, span.valid);
  if (span.valid < span.length) cmq::add_to_stats(stats, 0.0f);
  prefetch_next(x, span.length);
  encode_group<In, Fmt>(x, span, stats, q, scale, offset);
}

// Dequantizes `n` elements of one group: out[i] = Out::store(value_i), or with ADD
// out[i] = Out::store(base[i] + value_i). out may alias base.
template <class Fmt, class Out, bool ADD>
void dequantize_group(const uint8_t* q, int64_t n, float scale, float offset, const float* base,
                      typename Out::Raw* out) {
  const auto put = [&](int64_t i, float v) { out[i] = Out::store(ADD ? base[i] + v : v); };
  if (Fmt::kBits == 8) {
    for (int64_t i = 0; i < n; ++i) put(i, level_value<Fmt>(q[i], scale, offset));
    return;
  }
  const int64_t pairs = n / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t byte = q[k];
    put(2 * k, level_value<Fmt>(byte & 0xFu, scale, offset));
    put(2 * k + 1, level_value<Fmt>(byte >> 4, scale, offset));
  }
  if (n % 2) put(n - 1, level_value<Fmt>(q[pairs] & 0xFu, scale, offset));
}

// Quantizes the groups named by span_of(g), g in [0, groups), in parallel.
template <class In, class Fmt, class SpanOf>
int quantize_groups(const void* x, int64_t groups, int64_t group_size, SpanOf span_of,
                    uint8_t* q, float* scales, float* offsets) {
  const auto* xr = static_cast<const typename In::Raw*>(x);
  const bool parallel = groups * group_size >= kParallelMinNumel;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    const GroupSpan span = span_of(g);
    quantize_group<In, Fmt>(xr + span.source, span, q + byte_of<Fmt::kBits>(g * group_size),
                            scales + g, offsets ? offsets + g : nullptr);
  }
  return cmq::kOk;
}

// Inputs of the fused reductions: arrays of `count` pointers, one per quantized input.
struct Inputs {
  const uint8_t* const* q;
  const float* const* scales;
  const float* const* offsets;
  int count;
};

// reduce_group for int8 and a count known at compile time: one pass over the elements with
// the sum in registers (same additions in the same order as the general loop below).
template <class Fmt, class Out, int COUNT>
void reduce_group_fixed(const Inputs& in, int64_t g, int64_t n, int64_t at, typename Out::Raw* out) {
  const uint8_t* q[COUNT];
  float scale[COUNT], offset[COUNT];
  for (int k = 0; k < COUNT; ++k) {
    q[k] = in.q[k] + at;
    scale[k] = in.scales[k][g];
    offset[k] = Fmt::kSymmetric ? 0.0f : in.offsets[k][g];
  }
  for (int64_t i = 0; i < n; ++i) {
    float acc = level_value<Fmt>(q[0][i], scale[0], offset[0]);
#pragma GCC unroll 8
    for (int k = 1; k < COUNT; ++k) acc = acc + level_value<Fmt>(q[k][i], scale[k], offset[k]);
    out[i] = Out::store(acc);
  }
}

// out[0..n) = sum over inputs of n dequantized values of group g whose bytes start at `at`,
// added in input order in fp32 (in `acc`, n floats of scratch) and stored as Out.
template <class Fmt, class Out>
void reduce_elements(const Inputs& in, int64_t g, int64_t at, int64_t n, float* acc,
                     typename Out::Raw* out) {
  const auto offset = [&](int k) { return Fmt::kSymmetric ? 0.0f : in.offsets[k][g]; };
  if constexpr (Fmt::kBits == 8) {
    switch (in.count) {
      case 1: return reduce_group_fixed<Fmt, Out, 1>(in, g, n, at, out);
      case 2: return reduce_group_fixed<Fmt, Out, 2>(in, g, n, at, out);
      case 3: return reduce_group_fixed<Fmt, Out, 3>(in, g, n, at, out);
      case 4: return reduce_group_fixed<Fmt, Out, 4>(in, g, n, at, out);
      case 8: return reduce_group_fixed<Fmt, Out, 8>(in, g, n, at, out);
      default: break;
    }
  }
  const int last = in.count - 1;
  if (last == 0) {
    dequantize_group<Fmt, Out, false>(in.q[0] + at, n, in.scales[0][g], offset(0), nullptr, out);
    return;
  }
  dequantize_group<Fmt, F32, false>(in.q[0] + at, n, in.scales[0][g], offset(0), nullptr, acc);
  for (int k = 1; k < last; ++k)
    dequantize_group<Fmt, F32, true>(in.q[k] + at, n, in.scales[k][g], offset(k), acc, acc);
  dequantize_group<Fmt, Out, true>(in.q[last] + at, n, in.scales[last][g], offset(last), acc, out);
}

// out[0..n) = sum over inputs of group g's dequantized values, added in input order in fp32
// (acc: n floats of scratch) and stored as Out.
template <class Fmt, class Out>
void reduce_group(const Inputs& in, int64_t g, int64_t group_size, int64_t n, float* acc,
                  typename Out::Raw* out) {
  const int64_t at = byte_of<Fmt::kBits>(g * group_size);
  int64_t done = 0;
#if CMQ_HAVE_AVX2
  const auto store = [&](auto may_be_nan) {
    return cmq::avx2::reduce_prefix<Fmt>(
        in.q, in.scales, in.offsets, in.count, g, at, n, [out](int64_t i, __m256 lo, __m256 hi) {
          cmq::avx2::Lanes<Out>::template store16<decltype(may_be_nan)::value>(out + i, lo, hi);
        });
  };
  // Narrowing is cheaper for lanes known to hold no NaN; fp32 stores are the same either way.
  if constexpr (std::is_same_v<Out, F32>)
    done = store(std::true_type{});
  else if (cmq::avx2::finite_sums(in.scales, in.offsets, in.count, g, Fmt::kSymmetric))
    done = store(std::false_type{});
  else
    done = store(std::true_type{});
#endif
  reduce_elements<Fmt, Out>(in, g, at + byte_of<Fmt::kBits>(done), n - done, acc, out + done);
}

// acc[0..n) = the fp32 sums of reduce_group, and their statistics, computed in the same pass
// so that requantizing reads the sums only once more.
template <class Fmt>
GroupStats sum_group(const Inputs& in, int64_t g, int64_t group_size, int64_t n, float* acc) {
  constexpr bool kSym = Fmt::kSymmetric;
  const int64_t at = byte_of<Fmt::kBits>(g * group_size);
  int64_t done = 0;
  GroupStats stats = cmq::empty_stats();
#if CMQ_HAVE_AVX2
  cmq::avx2::StatsLanes<kSym> lanes;
  done = cmq::avx2::reduce_prefix<Fmt>(in.q, in.scales, in.offsets, in.count, g, at, n,
                                       [&](int64_t i, __m256 lo, __m256 hi) {
                                         cmq::avx2::Lanes<F32>::store16(acc + i, lo, hi);
                                         lanes.add(lo);
                                         lanes.add(hi);
                                       });
  stats = lanes.fold();
#endif
  float* rest = acc + done;
  reduce_elements<Fmt, F32>(in, g, at + byte_of<Fmt::kBits>(done), n - done, rest, rest);
  return cmq::merge_stats(stats, stats_of<F32, kSym>(rest, n - done));
}

// Whether reduce_elements needs its `acc` scratch: only to sum int4 inputs, or int8 inputs of
// a count that reduce_group_fixed does not cover. Dequantize (count 1) allocates nothing.
bool reduce_needs_scratch(int bits, int count) {
  if (count == 1) return false;
  return bits != 8 || !(count == 2 || count == 3 || count == 4 || count == 8);
}

// Runs body(g, n, scratch) for every group in parallel; with `scratch_needed`, scratch holds
// group_size floats owned by the calling thread, else it is null.
template <class Body>
int for_groups_with_scratch(int64_t numel, int64_t group_size, bool scratch_needed, Body body) {
  const int64_t groups = ceil_div(numel, group_size);
  const bool parallel = numel >= kParallelMinNumel;
  const int threads = parallel ? omp_get_max_threads() : 1;
  const int64_t width = scratch_needed ? (group_size < numel ? group_size : numel) : 0;
  std::vector<float> scratch;
  try {
    scratch.resize(static_cast<size_t>(threads) * static_cast<size_t>(width));
  } catch (const std::bad_alloc&) {
    return cmq::kOutOfMemory;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = (g + 1) * group_size <= numel ? group_size : numel - g * group_size;
    body(g, n, scratch_needed ? scratch.data() + static_cast<size_t>(omp_get_thread_num()) * width
                              : nullptr);
  }
  return cmq::kOk;
}

}  // namespace

extern "C" {

int cmq_cpu_num_threads() { return omp_get_max_threads(); }

int cmq_cpu_quantize(const void* x, int dtype, int64_t numel, int bits, int64_t group_size,
                     int symmetric, uint8_t* q, float* scales, float* offsets) {
  if (!valid_layout(numel, bits, group_size)) return cmq::kBadArgument;
  return with_dtype(dtype, [&](auto in) {
    return with_format(bits, symmetric, [&](auto fmt) {
      const auto span_of = [=](int64_t g) { return cmq::plain_group(g, numel, group_size); };
      return quantize_groups<decltype(in), decltype(fmt)>(x, ceil_div(numel, group_size),
                                                          group_size, span_of, q, scales, offsets);
    });
  });
}

int cmq_cpu_swizzled_quantize(const void* x, int dtype, int64_t numel, int64_t nodes,
                              int64_t devices_per_node, int64_t slice_numel, int bits,
                              int64_t group_size, int symmetric, uint8_t* q, float* scales,
                              float* offsets) {
  if (!valid_layout(numel, bits, group_size) || nodes < 1 || devices_per_node < 1 ||
      slice_numel < 0 || slice_numel % group_size != 0 ||
      slice_numel * nodes * devices_per_node < numel)
    return cmq::kBadArgument;
  return with_dtype(dtype, [&](auto in) {
    return with_format(bits, symmetric, [&](auto fmt) {
      const auto span_of = [=](int64_t g) {
        return cmq::swizzled_group(g, numel, group_size, slice_numel, nodes, devices_per_node);
      };
      const int64_t groups = nodes * devices_per_node * (slice_numel / group_size);
      return quantize_groups<decltype(in), decltype(fmt)>(x, groups, group_size, span_of, q,
                                                          scales, offsets);
    });
  });
}

// Dequantizes `count` inputs of one layout and sums them in fp32, in input order; dequantize
// is the case count == 1.
int cmq_cpu_dequant_reduce(const uint8_t* const* q, const float* const* scales,
                           const float* const* offsets, int count, int64_t numel, int bits,
                           int64_t group_size, int symmetric, void* out, int out_dtype) {
  if (!valid_layout(numel, bits, group_size) || count < 1) return cmq::kBadArgument;
  const Inputs in{q, scales, offsets, count};
  return with_dtype(out_dtype, [&](auto o) {
    using Out = decltype(o);
    return with_format(bits, symmetric, [&](auto fmt) {
      using Fmt = decltype(fmt);
      auto* dst = static_cast<typename Out::Raw*>(out);
      return for_groups_with_scratch(
          numel, group_size, reduce_needs_scratch(bits, count),
          [&](int64_t g, int64_t n, float* acc) {
            reduce_group<Fmt, Out>(in, g, group_size, n, acc, dst + g * group_size);
          });
    });
  });
}

int cmq_cpu_dequant_reduce_requant(const uint8_t* const* q, const float* const* scales,
                                   const float* const* offsets, int count, int64_t numel, int bits,
                                   int64_t group_size, int symmetric, uint8_t* q_out,
                                   float* scales_out, float* offsets_out) {
  if (!valid_layout(numel, bits, group_size) || count < 1) return cmq::kBadArgument;
  const Inputs in{q, scales, offsets, count};
  return with_format(bits, symmetric, [&](auto fmt) {
    using Fmt = decltype(fmt);
    return for_groups_with_scratch(numel, group_size, true, [&](int64_t g, int64_t n, float* acc) {
      const GroupStats stats = sum_group<Fmt>(in, g, group_size, n, acc);
      encode_group<F32, Fmt>(acc, GroupSpan{0, n, n}, stats,
                             q_out + byte_of<Fmt::kBits>(g * group_size), scales_out + g,
                             offsets_out ? offsets_out + g : nullptr);
    });
  });
}

}  // extern "C"

// ---------------------------------------------------------------- gradient compression codes
// The 1-bit and ternary codes of zero/compression (pack_math.h; the spec is
// kernels/compression_reference.py). One block per iteration, blocks in parallel.

#include "pack_math.h"

namespace {

// The block's pairwise sum of term(x[i]) in the spec's order (a[i] += a[i + h], h = block/2 .. 1).
template <class Term>
float pairwise_sum(const float* x, int64_t block, Term term) {
  float a[cmq::kMaxCodeBlock];
  for (int64_t i = 0; i < block; ++i) a[i] = term(x[i]);
  for (int64_t h = block / 2; h >= 1; h /= 2)
    for (int64_t i = 0; i < h; ++i) a[i] = a[i] + a[i + h];
  return a[0];
}

template <class Body>
void for_blocks(int64_t numel, int64_t block, Body body) {
  const int64_t blocks = numel / block;
#pragma omp parallel for schedule(static) if (numel >= kParallelMinNumel)
  for (int64_t b = 0; b < blocks; ++b) body(b);
}

template <class Out>
void decoded_sum(const uint8_t* const* codes, const float* const* scales, int count, int64_t numel,
                 int64_t block, bool ternary, typename Out::Raw* out) {
  for_blocks(numel, block, [&](int64_t b) {
    for (int64_t i = b * block; i < (b + 1) * block; ++i) {
      float acc = 0.0f;
      for (int k = 0; k < count; ++k) {
        const float v = ternary ? cmq::ternary_value(cmq::ternary_field(codes[k], i), scales[k][b])
                                : cmq::onebit_value(cmq::onebit_field(codes[k], i), scales[k][b]);
        acc = k == 0 ? v : acc + v;
      }
      out[i] = Out::store(acc);
    }
  });
}

}  // namespace

extern "C" {

// codes: numel/8 bytes, scales: numel/block; residual (may be x itself, or null): x - value.
int cmq_cpu_onebit_compress(const float* x, int64_t numel, int64_t block, uint8_t* codes,
                            float* scales, float* residual) {
  if (!cmq::valid_code_layout(numel, block)) return cmq::kBadArgument;
  for_blocks(numel, block, [&](int64_t b) {
    const float* xb = x + b * block;
    const float scale = pairwise_sum(xb, block, cmq::magnitude) / static_cast<float>(block);
    scales[b] = scale;
    uint8_t* cb = codes + b * block / 8;
    for (int64_t j = 0; j < block / 8; ++j) {
      uint32_t byte = 0;
      for (int k = 0; k < 8; ++k) byte |= static_cast<uint32_t>(xb[8 * j + k] < 0.0f) << k;
      cb[j] = static_cast<uint8_t>(byte);
    }
    if (residual != nullptr) {
      float* rb = residual + b * block;
      for (int64_t i = 0; i < block; ++i) rb[i] = xb[i] - cmq::onebit_value(xb[i] < 0.0f, scale);
    }
  });
  return cmq::kOk;
}

// codes: numel/4 bytes, scales: numel/block; uniforms drawn under `seed`.
int cmq_cpu_ternary_compress(const float* x, int64_t numel, int64_t block, int64_t seed,
                             uint8_t* codes, float* scales) {
  if (!cmq::valid_code_layout(numel, block) || seed < 0) return cmq::kBadArgument;
  const uint32_t salt = cmq::mix32(static_cast<uint32_t>(seed));
  for_blocks(numel, block, [&](int64_t b) {
    const int64_t first = b * block;
    float scale = 0.0f;
    for (int64_t i = first; i < first + block; ++i) scale = cmq::nan_max(scale, cmq::magnitude(x[i]));
    scales[b] = scale;
    for (int64_t j = first / 4; j < (first + block) / 4; ++j) {
      uint32_t byte = 0;
      for (int k = 0; k < 4; ++k) {
        const int64_t i = 4 * j + k;
        byte |= cmq::ternary_code(x[i], cmq::uniform_of(salt, i), scale) << (2 * k);
      }
      codes[j] = static_cast<uint8_t>(byte);
    }
  });
  return cmq::kOk;
}

// norms: numel/block, each block's pairwise sum of squares (DGC's block top-k).
int cmq_cpu_block_sq_norms(const float* x, int64_t numel, int64_t block, float* norms) {
  if (!cmq::valid_code_layout(numel, block)) return cmq::kBadArgument;
  for_blocks(numel, block, [&](int64_t b) { norms[b] = pairwise_sum(x + b * block, block, cmq::square); });
  return cmq::kOk;
}

// The fp32 sum of `count` decoded inputs in order, stored as out_dtype; ternary: 0 or 1.
int cmq_cpu_decompress_sum(const uint8_t* const* codes, const float* const* scales, int count,
                           int64_t numel, int64_t block, int ternary, void* out, int out_dtype) {
  if (!cmq::valid_code_layout(numel, block) || count < 1) return cmq::kBadArgument;
  return cmq::with_dtype(out_dtype, [&](auto o) {
    using Out = decltype(o);
    decoded_sum<Out>(codes, scales, count, numel, block, ternary != 0,
                     static_cast<typename Out::Raw*>(out));
    return cmq::kOk;
  });
}

}  // extern "C"
