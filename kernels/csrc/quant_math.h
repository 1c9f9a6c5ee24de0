// Per-element and per-group math of the chunkmem quantization kernels, shared by the CPU
// library (quant_cpu.cpp) and the CUDA library (quant_cuda.cu) so that both compute the
// same bits. The spec is docs/kernels.md; kernels/reference.py is the ground truth.
//
// [Note: bit-exactness] Every function here is a fixed sequence of IEEE-754 fp32 operations,
// each rounded to nearest-even. That only holds when the compiler neither contracts a*b+c into
// an FMA nor flushes denormals: g++ builds with -ffp-contract=off and without -ffast-math,
// nvcc with --fmad=false --ftz=false --prec-div=true.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define CMQ_HD __host__ __device__ __forceinline__
#else
#define CMQ_HD inline
#endif

namespace cmq {

// Element type codes of the C ABI (kernels/_native.py mirrors them).
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Return codes of the C ABI.
enum Status : int { kOk = 0, kBadArgument = 1, kOutOfMemory = 2, kCudaError = 3 };

// The smallest step a group may have: 2^-126, the smallest normal fp32. A group whose
// absmax/qmax (or range/levels) is below it uses it instead, so a step is never zero or
// denormal and its reciprocal is finite.
constexpr float kMinStep = 1.17549435082228750797e-38f;

// For |t| < 2^22, t + 1.5 * 2^23 is rounded (ties to even) to an integer, which then sits in
// the low mantissa bits: bits(t + kRoundMagic) - kRoundMagicBits == rne(t). Plain fp32 addition,
// so every compiler and device computes it identically; no float-to-int conversion is needed.
constexpr float kRoundMagic = 12582912.0f;
constexpr int32_t kRoundMagicBits = 0x4B400000;

CMQ_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

CMQ_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

CMQ_HD float quiet_nan() { return float_of(0x7FC00000u); }

// ---- 16-bit <-> fp32 conversions (exact widening; RNE narrowing like torch's .to()) ----

CMQ_HD float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

CMQ_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  // exponent 0: zero or subnormal, mantissa * 2^-24 (exact in fp32).
  const uint32_t small = sign | bits_of(static_cast<float>(mantissa) * 5.9604644775390625e-08f);
  // exponent 31: Inf or NaN, payload kept.
  const uint32_t special = sign | 0x7F800000u | (mantissa << 13);
  // otherwise rebias the exponent from 15 to 127.
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  return float_of(exponent == 0 ? small : (exponent == 31 ? special : normal));
}

CMQ_HD uint16_t float_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);  // ties to even; a carry into the exponent is correct
  return static_cast<uint16_t>(u >> 16);
}

CMQ_HD uint16_t float_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 2^16: Inf
  if (a >= 0x38800000u) {                                               // >= 2^-14: normal
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);  // ties to even; may carry to Inf
    return static_cast<uint16_t>(sign | ((r >> 13) - (112u << 10)));
  }
  // Subnormal half: units of 2^-24. value = m * 2^(e - 150), so units = m >> (126 - e).
  const uint32_t e = a >> 23;
  const uint32_t shift = 126u - e;  // >= 14
  if (shift > 24u) return static_cast<uint16_t>(sign);
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t units = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  units += (rest > half || (rest == half && (units & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | units);
}

// ---- group statistics ----

// A float's order key: signed comparison of keys orders floats like fp32 comparison, with
// -0 < +0 and NaNs beyond +-Inf. The map is its own inverse.
CMQ_HD int32_t order_key(uint32_t u) {
  return static_cast<int32_t>(u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) >> 1));
}

constexpr int32_t kKeyPosInf = 0x7F800000;                    // order_key(+Inf)
constexpr int32_t kKeyNegInf = static_cast<int32_t>(0x807FFFFFu);  // order_key(-Inf)
constexpr uint32_t kAbsInfBits = 0x7F800000u;

// Statistics of a group, combined element by element. Symmetric groups use abs_bits (the
// largest |x| as bits; >= kAbsInfBits means a NaN or Inf is present), asymmetric groups the
// order keys of min and max. Integer max/min is exact and order-free, so the CPU loop and the
// CUDA block reduction agree whatever order they combine in.
struct GroupStats {
  uint32_t abs_bits;
  int32_t min_key;
  int32_t max_key;
};

CMQ_HD GroupStats empty_stats() { return GroupStats{0u, INT32_MAX, INT32_MIN}; }

CMQ_HD void add_to_stats(GroupStats& s, float v) {
  const uint32_t u = bits_of(v);
  const uint32_t a = u & 0x7FFFFFFFu;
  const int32_t k = order_key(u);
  s.abs_bits = a > s.abs_bits ? a : s.abs_bits;
  s.min_key = k < s.min_key ? k : s.min_key;
  s.max_key = k > s.max_key ? k : s.max_key;
}

CMQ_HD GroupStats merge_stats(GroupStats a, const GroupStats& b) {
  a.abs_bits = b.abs_bits > a.abs_bits ? b.abs_bits : a.abs_bits;
  a.min_key = b.min_key < a.min_key ? b.min_key : a.min_key;
  a.max_key = b.max_key > a.max_key ? b.max_key : a.max_key;
  return a;
}

// ---- group parameters ----

// scale: step between levels; offset: value of level 0 (0 for symmetric); inv = 1 / scale.
// A non-finite group has scale = offset = NaN and encodes every element as level 0, so every
// element dequantizes to NaN.
struct GroupParams {
  float scale;
  float offset;
  float inv;
  bool finite;
};

CMQ_HD GroupParams nonfinite_params() {
  return GroupParams{quiet_nan(), quiet_nan(), 0.0f, false};
}

// Symmetric, b bits: qmax = 2^(b-1) - 1; scale = max(absmax / qmax, 2^-126).
CMQ_HD GroupParams symmetric_params(const GroupStats& s, int bits) {
  if (s.abs_bits >= kAbsInfBits) return nonfinite_params();
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
  float scale = float_of(s.abs_bits) / qmax;
  scale = scale < kMinStep ? kMinStep : scale;
  return GroupParams{scale, 0.0f, 1.0f / scale, true};
}

// Asymmetric, b bits: L = 2^b - 1; step = max((max - min) / L, 2^-126); offset = min + 0
// (so -0 is stored as +0). A range that overflows fp32 counts as non-finite.
CMQ_HD GroupParams asymmetric_params(const GroupStats& s, int bits) {
  if (s.max_key >= kKeyPosInf || s.min_key <= kKeyNegInf) return nonfinite_params();
  const float lo = float_of(static_cast<uint32_t>(order_key(static_cast<uint32_t>(s.min_key))));
  const float hi = float_of(static_cast<uint32_t>(order_key(static_cast<uint32_t>(s.max_key))));
  const float levels = static_cast<float>((1 << bits) - 1);
  float step = (hi - lo) / levels;
  if (!(step <= 3.40282346638528859812e+38f)) return nonfinite_params();
  step = step < kMinStep ? kMinStep : step;
  return GroupParams{step, lo + 0.0f, 1.0f / step, true};
}

template <bool SYM>
CMQ_HD GroupParams group_params(const GroupStats& s, int bits) {
  return SYM ? symmetric_params(s, bits) : asymmetric_params(s, bits);
}

// ---- per-element quantize / dequantize ----

// Level of v in a finite group: round-to-nearest-even of (v - offset) * inv. For every value
// of the group the result lies in [-qmax, qmax] (symmetric) or [0, L] (asymmetric) without
// clamping: docs/kernels.md proves it and the tests check it.
template <bool SYM>
CMQ_HD int quantize_value(float v, const GroupParams& p) {
  const float t = SYM ? v * p.inv : (v - p.offset) * p.inv;
  return static_cast<int32_t>(bits_of(t + kRoundMagic)) - kRoundMagicBits;
}

template <bool SYM>
CMQ_HD float dequantize_value(int q, float scale, float offset) {
  return SYM ? static_cast<float>(q) * scale : static_cast<float>(q) * scale + offset;
}

// Storage: int8 symmetric is a two's-complement byte, int8 asymmetric an unsigned byte;
// int4 is a 4-bit field (two's complement when symmetric), element 2k in the low nibble of
// byte k and element 2k+1 in the high nibble.
template <int BITS>
CMQ_HD uint8_t encode_level(int q) {
  return BITS == 8 ? static_cast<uint8_t>(q) : static_cast<uint8_t>(q & 0xF);
}

template <int BITS, bool SYM>
CMQ_HD int decode_level(uint32_t field) {
  if (BITS == 8) return SYM ? static_cast<int>(static_cast<int8_t>(field)) : static_cast<int>(field);
  return SYM ? static_cast<int>(field ^ 8u) - 8 : static_cast<int>(field);
}

// ---- element types and formats, for dispatching a C ABI call to a template ----

struct F32 {
  using Raw = float;
  static CMQ_HD float load(float v) { return v; }
  static CMQ_HD float store(float v) { return v; }
};
struct BF16 {
  using Raw = uint16_t;
  static CMQ_HD float load(uint16_t v) { return bf16_to_float(v); }
  static CMQ_HD uint16_t store(float v) { return float_to_bf16(v); }
};
struct F16 {
  using Raw = uint16_t;
  static CMQ_HD float load(uint16_t v) { return f16_to_float(v); }
  static CMQ_HD uint16_t store(float v) { return float_to_f16(v); }
};

template <int B, bool S>
struct Format {
  static constexpr int kBits = B;
  static constexpr bool kSymmetric = S;
};

// Calls f(T{}) with T the element type named by the dtype code.
template <class F>
int with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: return f(F32{});
    case kBFloat16: return f(BF16{});
    case kFloat16: return f(F16{});
    default: return kBadArgument;
  }
}

// Calls f(Format<bits, symmetric>{}).
template <class F>
int with_format(int bits, int symmetric, F&& f) {
  if (bits == 8) return symmetric ? f(Format<8, true>{}) : f(Format<8, false>{});
  if (bits == 4) return symmetric ? f(Format<4, true>{}) : f(Format<4, false>{});
  return kBadArgument;
}

inline bool valid_layout(int64_t numel, int bits, int64_t group_size) {
  return numel >= 0 && group_size >= 1 && (bits == 8 || (bits == 4 && group_size % 2 == 0));
}

CMQ_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Byte offset of element `e` in packed data (for int4, e is even: a group start).
template <int BITS>
CMQ_HD int64_t byte_of(int64_t e) {
  return BITS == 8 ? e : e / 2;
}

// Level field of element `e`: its byte (int8) or nibble (int4).
template <int BITS>
CMQ_HD uint32_t field_of(const uint8_t* q, int64_t e) {
  return BITS == 8 ? q[e] : (q[e / 2] >> ((e & 1) * 4)) & 0xFu;
}

template <class Fmt>
CMQ_HD float level_value(uint32_t field, float scale, float offset) {
  constexpr bool kSym = Fmt::kSymmetric;
  return dequantize_value<kSym>(decode_level<Fmt::kBits, kSym>(field), scale, offset);
}

// ---- group placement ----

// Which input elements feed output group `g`: `valid` elements from `source`, followed by
// `length - valid` zeros of padding (only the swizzle pads).
struct GroupSpan {
  int64_t source;
  int64_t valid;
  int64_t length;
};

CMQ_HD GroupSpan plain_group(int64_t g, int64_t numel, int64_t group_size) {
  const int64_t start = g * group_size;
  const int64_t rest = numel - start;
  const int64_t len = rest < group_size ? rest : group_size;
  return GroupSpan{start, len, len};
}

// Swizzle for nodes x devices_per_node ranks: the padded input holds world slices of
// slice_numel elements, slice j for rank j = node * devices_per_node + local. The output holds
// the same slices in the order (local, node): for local l, for node m, slice m * dpn + l.
// slice_numel is a multiple of group_size, so group g of the output lies in one slice.
CMQ_HD GroupSpan swizzled_group(int64_t g, int64_t numel, int64_t group_size,
                                int64_t slice_numel, int64_t nodes, int64_t devices_per_node) {
  const int64_t groups_per_slice = slice_numel / group_size;
  const int64_t position = g / groups_per_slice;
  const int64_t local = position / nodes;
  const int64_t node = position % nodes;
  const int64_t slice = node * devices_per_node + local;
  const int64_t start = slice * slice_numel + (g % groups_per_slice) * group_size;
  const int64_t rest = numel - start;
  const int64_t valid = rest <= 0 ? 0 : (rest < group_size ? rest : group_size);
  return GroupSpan{start, valid, group_size};
}

}  // namespace cmq
