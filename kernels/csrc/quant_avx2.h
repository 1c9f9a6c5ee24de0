// AVX2 + F16C lanes of the per-element math in quant_math.h, for the CPU library. g++ alone
// leaves the 16-bit conversions, the byte packing and the fused reduce mostly scalar.
//
// [Note: same bits in every lane] Each function here is a lane-wise transcription of the
// quant_math.h function it names: the same IEEE-754 fp32 operations in the same order, and
// integer code for everything else. Intrinsics are plain operations to g++, so
// -ffp-contract=off keeps a multiply and an add two roundings here too. The scalar functions
// stay the spec; the CPU library runs them on what the lanes leave (a group's tail) and on CPUs
// without AVX2, and the tests compare both builds with the reference.
//
// The CPU library is compiled with -march=native for the machine that runs it (the CPU model
// is part of its cache key), so a compile-time check picks these lanes: CMQ_HAVE_AVX2 is 1 only
// when the target has AVX2 and F16C.
#pragma once

#include "quant_math.h"

#if defined(__AVX2__) && defined(__F16C__)
#define CMQ_HAVE_AVX2 1
#include <immintrin.h>

#include <type_traits>

namespace cmq {
namespace avx2 {

inline __m256i splat(uint32_t u) { return _mm256_set1_epi32(static_cast<int>(u)); }

// ---- element types: load 8 lanes as fp32, store 16 fp32 lanes narrowed ----

// Where kInterleaved, load32 reads a block of 32 elements as four vectors holding elements 0-3
// 8-11, 4-7 12-15, 16-19 24-27 and 20-23 28-31: the order in which packus_epi32 of the pairs
// gives elements 0-15 and 16-31 back in order (low_bytes). Other types read blocks with load8.
// store16<false> may be used only for lanes that hold no NaN: it leaves out the NaN rule of the
// narrowing (see finite_sums).

template <class T>
struct Lanes;

template <>
struct Lanes<F32> {
  static constexpr bool kInterleaved = false;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  template <bool kMayBeNaN = true>
  static void store16(float* p, __m256 a, __m256 b) {
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + 8, b);
  }
};

template <>
struct Lanes<BF16> {
  static constexpr bool kInterleaved = true;
  // bf16_to_float: the 16 bits become the high half of the fp32 pattern.
  static __m256 load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // The same widening as interleaving zero words below each pattern, one instruction per 8.
  static void load32(const uint16_t* p, __m256& a, __m256& b, __m256& c, __m256& d) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, lo));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, lo));
    c = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, hi));
    d = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, hi));
  }
  // float_to_bf16, in the low half of each 32-bit lane. A NaN keeps its high half with the
  // quiet bit set: (u | 0x400000) >> 16 is float_to_bf16's (u >> 16) | 0x40.
  template <bool kMayBeNaN>
  static __m256i narrow(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), splat(1u));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(splat(0x7FFFu), odd));
    if constexpr (kMayBeNaN) {
      // v != v exactly when |u| > 0x7F800000, float_to_bf16's NaN test
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, splat(0x00400000u)), nan);
    }
    return _mm256_srli_epi32(rounded, 16);
  }
  template <bool kMayBeNaN = true>
  static void store16(uint16_t* p, __m256 a, __m256 b) {
    // Lanes hold values below 2^16, so packus only interleaves (a0-3 b0-3 | a4-7 b4-7); the
    // permute restores element order.
    const __m256i packed =
        _mm256_packus_epi32(narrow<kMayBeNaN>(a), narrow<kMayBeNaN>(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
  }
};

template <>
struct Lanes<F16> {
  static constexpr bool kInterleaved = false;
  // f16_to_float is exact and so is vcvtph2ps, except that it quiets a signalling NaN. A NaN
  // input only reaches the group statistics, where every NaN counts the same.
  static __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // float_to_f16: vcvtps2ph rounds to nearest even as it does (overflow to Inf, subnormals
  // kept; MXCSR is not consulted for the rounding); a NaN becomes its sign | 0x7E00 as there.
  template <bool kMayBeNaN>
  static __m128i narrow(__m256 v) {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if constexpr (!kMayBeNaN) return h;
    const __m128i nan =
        _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7FFF)), _mm_set1_epi16(0x7C00));
    const __m128i sign = _mm_and_si128(h, _mm_set1_epi16(static_cast<int16_t>(0x8000)));
    return _mm_blendv_epi8(h, _mm_or_si128(sign, _mm_set1_epi16(0x7E00)), nan);
  }
  template <bool kMayBeNaN = true>
  static void store16(uint16_t* p, __m256 a, __m256 b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow<kMayBeNaN>(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), narrow<kMayBeNaN>(b));
  }
};

// ---- group statistics ----

// add_to_stats per lane; fold() merges the lanes. Only the statistics the format reads are
// kept: abs_bits for symmetric groups, the order keys for asymmetric ones.
template <bool SYM>
struct StatsLanes {
  __m256i abs_bits = _mm256_setzero_si256();
  __m256i min_key = splat(static_cast<uint32_t>(INT32_MAX));
  __m256i max_key = splat(static_cast<uint32_t>(INT32_MIN));

  void add(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    if constexpr (SYM) {
      abs_bits = _mm256_max_epu32(abs_bits, _mm256_and_si256(u, splat(0x7FFFFFFFu)));
    } else {
      // order_key: u ^ ((u >> 31, arithmetic) >> 1, logical)
      const __m256i k = _mm256_xor_si256(u, _mm256_srli_epi32(_mm256_srai_epi32(u, 31), 1));
      min_key = _mm256_min_epi32(min_key, k);
      max_key = _mm256_max_epi32(max_key, k);
    }
  }

  GroupStats fold() const {
    alignas(32) uint32_t a[8];
    alignas(32) int32_t lo[8], hi[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), abs_bits);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lo), min_key);
    _mm256_store_si256(reinterpret_cast<__m256i*>(hi), max_key);
    GroupStats s = empty_stats();
    for (int i = 0; i < 8; ++i) s = merge_stats(s, GroupStats{a[i], lo[i], hi[i]});
    return s;
  }
};

// Statistics of bf16 patterns x[0, done), done = n rounded down to 16, computed on the 16-bit
// patterns h, 16 lanes per vector. bf16_to_float shifts h into the high half, so abs_bits is
// (h & 0x7FFF) << 16 and order_key is k << 16 | (k < 0 ? 0xFFFF : 0) for k the same key of
// h in 16 bits (h ^ ((h >> 15, arithmetic) >> 1, logical)): both grow with their 16-bit
// counterparts, so the largest and smallest come from the 16-bit maxima and minima.
template <bool SYM>
GroupStats bf16_stats_prefix(const uint16_t* x, int64_t n, int64_t& done) {
  __m256i abs16 = _mm256_setzero_si256();
  __m256i min16 = _mm256_set1_epi16(INT16_MAX);
  __m256i max16 = _mm256_set1_epi16(INT16_MIN);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    if constexpr (SYM) {
      abs16 = _mm256_max_epu16(abs16, _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF)));
    } else {
      const __m256i k = _mm256_xor_si256(h, _mm256_srli_epi16(_mm256_srai_epi16(h, 15), 1));
      min16 = _mm256_min_epi16(min16, k);
      max16 = _mm256_max_epi16(max16, k);
    }
  }
  done = i;
  if (i == 0) return empty_stats();
  alignas(32) uint16_t a[16];
  alignas(32) int16_t lo[16], hi[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), abs16);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lo), min16);
  _mm256_store_si256(reinterpret_cast<__m256i*>(hi), max16);
  const auto key = [](int16_t k) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(k)) << 16 |
                                (k < 0 ? 0xFFFFu : 0u));
  };
  GroupStats s = empty_stats();
  for (int j = 0; j < 16; ++j)
    s = merge_stats(s, GroupStats{static_cast<uint32_t>(a[j]) << 16, key(lo[j]), key(hi[j])});
  return s;
}

// Statistics of x[0, done) with done = n rounded down to 16; the caller adds the rest.
template <class In, bool SYM>
GroupStats stats_prefix(const typename In::Raw* x, int64_t n, int64_t& done) {
  if constexpr (std::is_same_v<In, BF16>) {
    return bf16_stats_prefix<SYM>(x, n, done);
  } else {
    StatsLanes<SYM> a, b;  // two chains, so the max/min latency does not bound the loop
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      a.add(Lanes<In>::load8(x + i));
      b.add(Lanes<In>::load8(x + i + 8));
    }
    done = i;
    return merge_stats(a.fold(), b.fold());
  }
}

// ---- quantize ----

// bits(t + kRoundMagic) for t of quantize_value: its low byte is the level's low byte, which
// is all encode_level keeps, because kRoundMagicBits ends in a zero byte. So the subtraction
// of kRoundMagicBits is left out.
template <bool SYM>
__m256i level_bits(__m256 v, __m256 inv, __m256 offset) {
  const __m256 t = SYM ? _mm256_mul_ps(v, inv) : _mm256_mul_ps(_mm256_sub_ps(v, offset), inv);
  return _mm256_castps_si256(_mm256_add_ps(t, _mm256_set1_ps(kRoundMagic)));
}

// The low bytes of the 32 lanes of a block (in load32's order if kInterleaved), in element
// order. Masking first keeps packus from saturating, so it truncates like encode_level<8>'s cast.
template <bool kInterleaved>
__m256i low_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i m = splat(0xFFu);
  const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(a, m), _mm256_and_si256(b, m));
  const __m256i cd = _mm256_packus_epi32(_mm256_and_si256(c, m), _mm256_and_si256(d, m));
  const __m256i bytes = _mm256_packus_epi16(ab, cd);
  // Interleaved: 0-7 16-23 | 8-15 24-31 in 64-bit blocks. Otherwise 0-3 8-11 16-19 24-27 |
  // 4-7 12-15 20-23 28-31 in 32-bit blocks. Reorder the blocks.
  if constexpr (kInterleaved) return _mm256_permute4x64_epi64(bytes, 0xD8);
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// encode_level<4> of 32 levels given as bytes: element 2k in the low nibble of byte k, 2k+1
// in the high one.
inline __m128i nibble_pairs(__m256i bytes) {
  const __m256i f = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
  // Each 16-bit word f[2k] | f[2k+1] << 8 becomes f[2k] | f[2k+1] << 4 in its low byte.
  const __m256i w = _mm256_and_si256(_mm256_or_si256(f, _mm256_srli_epi16(f, 4)),
                                     _mm256_set1_epi16(0xFF));
  return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// Encodes x[0, done) of a finite group into q, done = n rounded down to 32.
template <class In, class Fmt>
int64_t encode_prefix(const typename In::Raw* x, int64_t n, const GroupParams& p, uint8_t* q) {
  constexpr bool kSym = Fmt::kSymmetric;
  const __m256 inv = _mm256_set1_ps(p.inv);
  const __m256 offset = _mm256_set1_ps(p.offset);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 a, b, c, d;
    if constexpr (Lanes<In>::kInterleaved) {
      Lanes<In>::load32(x + i, a, b, c, d);
    } else {
      a = Lanes<In>::load8(x + i);
      b = Lanes<In>::load8(x + i + 8);
      c = Lanes<In>::load8(x + i + 16);
      d = Lanes<In>::load8(x + i + 24);
    }
    const __m256i bytes = low_bytes<Lanes<In>::kInterleaved>(
        level_bits<kSym>(a, inv, offset), level_bits<kSym>(b, inv, offset),
        level_bits<kSym>(c, inv, offset), level_bits<kSym>(d, inv, offset));
    if constexpr (Fmt::kBits == 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i / 2), nibble_pairs(bytes));
  }
  return i;
}

// ---- dequantize and reduce ----

// decode_level of 8 fields as int32 lanes: int8 fields are 8 bytes, int4 fields 4 bytes (low
// nibble first).
template <class Fmt>
__m256i levels8(const uint8_t* q) {
  constexpr bool kSym = Fmt::kSymmetric;
  if constexpr (Fmt::kBits == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
    return kSym ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  } else {
    int32_t word;
    memcpy(&word, q, sizeof word);
    const __m128i b = _mm_cvtsi32_si128(word);
    const __m128i m = _mm_set1_epi8(0x0F);
    __m128i fields = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    // decode_level<4, true>: (field ^ 8) - 8, on bytes before sign extension
    if constexpr (kSym)
      fields = _mm_sub_epi8(_mm_xor_si128(fields, _mm_set1_epi8(8)), _mm_set1_epi8(8));
    return kSym ? _mm256_cvtepi8_epi32(fields) : _mm256_cvtepu8_epi32(fields);
  }
}

// level_value of 8 consecutive elements: decode_level, an exact int-to-float conversion, then
// dequantize_value.
template <class Fmt>
__m256 values8(const uint8_t* q, __m256 scale, __m256 offset) {
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(levels8<Fmt>(q)), scale);
  return Fmt::kSymmetric ? v : _mm256_add_ps(v, offset);
}

// Whether every value of group g and every partial sum over the `count` inputs is finite, so
// that no lane can hold a NaN: all scales and offsets are finite and B, the sum over inputs of
// 255 |scale| + |offset| (|level| <= 255 bounds every |value|; computed in double, exactly
// enough), stays below 2^127. A partial sum is then at most B (1 + 2^-24)^(count + 1) < 2 B
// for fewer than 2^22 inputs: below the largest fp32, so no rounding carries it to Inf.
inline bool finite_sums(const float* const* scales, const float* const* offsets, int count,
                        int64_t g, bool symmetric) {
  if (count >= (1 << 22)) return false;
  double bound = 0.0;
  for (int k = 0; k < count; ++k) {
    const double scale = scales[k][g];
    const double offset = symmetric ? 0.0 : offsets[k][g];
    bound += 255.0 * (scale < 0 ? -scale : scale) + (offset < 0 ? -offset : offset);
  }
  return bound < 0x1p127;  // false for NaN and Inf too
}

// For elements [0, done) of a group, done = n rounded down to 16, sums the `count` inputs'
// values in input order (acc = v0; acc = acc + vk) and hands each 16 sums to sink(i, lo, hi).
// values_of(k, byte) gives input k's 8 values whose fields start at the group's byte `byte`.
template <class Fmt, class ValuesOf, class Sink>
int64_t sum_blocks(int count, int64_t n, ValuesOf values_of, Sink sink) {
  constexpr int64_t kBytesPer8 = Fmt::kBits == 8 ? 8 : 4;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const int64_t byte = i / 8 * kBytesPer8;
    __m256 lo = values_of(0, byte);
    __m256 hi = values_of(0, byte + kBytesPer8);
    for (int k = 1; k < count; ++k) {
      lo = _mm256_add_ps(lo, values_of(k, byte));
      hi = _mm256_add_ps(hi, values_of(k, byte + kBytesPer8));
    }
    sink(i, lo, hi);
  }
  return i;
}

// sum_blocks over group g of `count` inputs whose bytes for the group start at q[k] + at.
// Common counts keep every input's pointer, scale and offset in registers; others read them
// per block.
template <class Fmt, class Sink>
int64_t reduce_prefix(const uint8_t* const* q, const float* const* scales,
                      const float* const* offsets, int count, int64_t g, int64_t at, int64_t n,
                      Sink sink) {
  constexpr bool kSym = Fmt::kSymmetric;
  const auto offset_of = [&](int k) { return _mm256_set1_ps(kSym ? 0.0f : offsets[k][g]); };
  const auto fixed = [&](auto count_constant) {
    constexpr int kCount = decltype(count_constant)::value;
    const uint8_t* src[kCount];
    __m256 scale[kCount], offset[kCount];
    for (int k = 0; k < kCount; ++k) {
      src[k] = q[k] + at;
      scale[k] = _mm256_set1_ps(scales[k][g]);
      offset[k] = offset_of(k);
    }
    return sum_blocks<Fmt>(
        kCount, n,
        [&](int k, int64_t byte) { return values8<Fmt>(src[k] + byte, scale[k], offset[k]); },
        sink);
  };
  switch (count) {
    case 1: return fixed(std::integral_constant<int, 1>{});
    case 2: return fixed(std::integral_constant<int, 2>{});
    case 3: return fixed(std::integral_constant<int, 3>{});
    case 4: return fixed(std::integral_constant<int, 4>{});
    case 8: return fixed(std::integral_constant<int, 8>{});
    default:
      return sum_blocks<Fmt>(
          count, n,
          [&](int k, int64_t byte) {
            return values8<Fmt>(q[k] + at + byte, _mm256_set1_ps(scales[k][g]), offset_of(k));
          },
          sink);
  }
}

}  // namespace avx2
}  // namespace cmq

#else
#define CMQ_HAVE_AVX2 0
#endif
