// Per-element and per-block math of the gradient compressors' codes (1-bit sign and scale,
// TernGrad's stochastic ternary, DGC's block squared norms), shared by the CPU library (quant_cpu.cpp) and the CUDA library
// (quant_cuda.cu). The spec and ground truth is kernels/compression_reference.py; the same
// bit-exactness rules as quant_math.h hold (no FMA contraction, denormals kept).
#pragma once

#include <stdint.h>

#include "quant_math.h"

namespace cmq {

// Block sizes the codes accept: powers of two in [32, 4096] (whole bytes of codes, fp32 scales
// that start on 4 bytes, and a block's pairwise sum fits one CUDA block's shared memory).
constexpr int64_t kMinCodeBlock = 32;
constexpr int64_t kMaxCodeBlock = 4096;

CMQ_HD bool valid_code_layout(int64_t numel, int64_t block) {
  return block >= kMinCodeBlock && block <= kMaxCodeBlock && (block & (block - 1)) == 0 &&
         numel >= 0 && numel % block == 0;
}

// "lowbias32": a counter-based hash, so every backend draws the same uniforms.
CMQ_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// uniform(seed, i) in [0, 1): 24 random bits times 2^-24, exact in fp32.
CMQ_HD float uniform_of(uint32_t salt, int64_t index) {
  const uint32_t h = mix32(static_cast<uint32_t>(index) ^ salt);
  return static_cast<float>(h >> 8) * 5.9604644775390625e-08f;
}

// |x| as torch computes it: the sign bit cleared (so |-0| is +0 and a NaN stays NaN).
CMQ_HD float magnitude(float x) { return float_of(bits_of(x) & 0x7FFFFFFFu); }

// x * x (a block's squared norm adds these; separate from the add: no FMA contraction).
CMQ_HD float square(float x) { return x * x; }

// The magnitude of the larger of two, NaN winning (|x| of the block's elements).
CMQ_HD float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

// 1-bit: bit 1 is level -1.
CMQ_HD float onebit_value(uint32_t bit, float scale) { return (bit ? -1.0f : 1.0f) * scale; }

// Ternary: code 1 is +1, 2 is -1, 0 (and the unused 3) is 0; a non-finite scale gives NaN.
CMQ_HD float ternary_value(uint32_t code, float scale) {
  const float level = code == 1u ? 1.0f : (code == 2u ? -1.0f : 0.0f);
  return level * scale;
}

CMQ_HD uint32_t onebit_field(const uint8_t* codes, int64_t i) { return (codes[i >> 3] >> (i & 7)) & 1u; }

CMQ_HD uint32_t ternary_field(const uint8_t* codes, int64_t i) {
  return (codes[i >> 2] >> (2 * (i & 3))) & 3u;
}

CMQ_HD uint32_t ternary_code(float x, float u, float scale) {
  if (!(u * scale < magnitude(x))) return 0u;
  return x < 0.0f ? 2u : 1u;
}

}  // namespace cmq
