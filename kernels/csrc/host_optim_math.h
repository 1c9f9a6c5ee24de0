// Per-element math of the chunkmem host optimizer (host_optim_cpu.cpp): Adam/AdamW and SGD
// with momentum, written to give the bits of torch's fused CPU kernels
// (aten/src/ATen/native/cpu/FusedAdamKernel.cpp and FusedSGDKernel.cpp, torch 2.13) as the
// x86-64 wheel runs them. The spec is docs/host_optim.md.
//
// [Note: torch's FMAs] torch compiles those kernels with g++'s default -ffp-contract=fast, so
// its binary contains fused multiply-adds that its source does not spell, and they differ
// between the vector body (8 floats per step) and the scalar loop that takes the last
// numel % 8 elements of each tensor. This header spells every one of them with std::fma and
// is compiled with -ffp-contract=off, so that nothing else is fused. What torch's AVX2 kernel
// (which AVX-512 CPUs run too; the wheel has no AVX-512 copy) computes, read from its
// disassembly and checked bit for bit by tests/test_host_optim.py:
//
//   Adam body:  m = fma(c, g - m, small ? m : g)        c = small ? c1 : c1 - 1
//               v = fma(c2 * g, g, v * beta2)
//   Adam tail:  m = the same (fma(g - m, c1, m), or g - (g - m) * (1 - c1) in one rounding)
//               v = fma(v, beta2, (c2 * g) * g)
//   L2 decay:   g = fma(p, wd, g)                         (both)
//   SGD body:   buf = fma(1 - dampening, g, buf * momentum)
//   SGD tail:   buf = fma(buf, momentum, g * (1 - dampening))
//   SGD both:   g = fma(p, wd, g);  nesterov: g = fma(buf, momentum, g);  p = fma(g, -lr, p)
//
// and in double, once per tensor: AdamW's factor 1 - lr * wd is fma(-lr, wd, 1).
// Everything else is one IEEE-754 operation per source operation, in source order; sqrt and
// division are exact-rounded (no rsqrt, no reciprocal). Denormals are kept (no FTZ/DAZ).
#pragma once

#include <math.h>
#include <stdint.h>

#include "quant_math.h"

namespace cmo {

using cmq::BF16;
using cmq::F16;
using cmq::F32;

// Elements per vector step of torch's kernels: tensor elements [0, n - n % kLanes) take the
// body formulas, the rest the tail formulas.
constexpr int64_t kLanes = 8;

inline int64_t body_end(int64_t numel) { return numel - numel % kLanes; }

// No 16-bit copy of the parameters is written.
struct NoOut {
  using Raw = uint16_t;
};

// ---- Adam / AdamW ----

// The fp32 constants of one tensor's update, computed in double from the hyper-parameters and
// the tensor's step exactly as adam_fused_step_impl does, then rounded to float at use.
struct AdamScalars {
  bool decay;           // weight_decay != 0
  bool decoupled;       // AdamW: p *= lr_decay; Adam: g += wd * p
  bool small_lerp;      // |c1| < 0.5: m = m + c1 (g - m); else m = g + (c1 - 1)(g - m)
  float weight_decay;   // wd
  float lr_decay;       // 1 - lr * wd (one fused rounding in double, see the note above)
  float lerp_coeff;     // c1 if small_lerp, else c1 - 1 (in float)
  float c2;             // 1 - beta2
  float beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

inline AdamScalars adam_scalars(double lr, double beta1, double beta2, double weight_decay,
                                double eps, bool decoupled, float step_value) {
  const double step = step_value;
  const double bias_correction1 = 1.0 - pow(beta1, step);
  const double bias_correction2 = 1.0 - pow(beta2, step);
  const double step_size = lr / bias_correction1;
  AdamScalars s;
  s.decay = weight_decay != 0.0;
  s.decoupled = decoupled;
  const float c1 = static_cast<float>(1.0 - beta1);
  s.small_lerp = fabsf(c1) < 0.5f;
  s.lerp_coeff = s.small_lerp ? c1 : c1 - 1.0f;
  s.weight_decay = static_cast<float>(weight_decay);
  s.lr_decay = static_cast<float>(fma(-lr, weight_decay, 1.0));
  s.c2 = static_cast<float>(1.0 - beta2);
  s.beta2 = static_cast<float>(beta2);
  s.bc2_sqrt = static_cast<float>(sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-step_size);
  return s;
}

// One element. g is the gradient already divided by the gradient scale; p, m and v are fp32
// (16-bit states are widened before and rounded after, like torch's composition). TAIL picks
// the formulas of torch's scalar loop.
template <bool TAIL>
inline void adam_element(const AdamScalars& s, float g, float& p, float& m, float& v) {
  if (s.decay) {
    if (s.decoupled)
      p = p * s.lr_decay;
    else
      g = fmaf(p, s.weight_decay, g);
  }
  m = fmaf(s.lerp_coeff, g - m, s.small_lerp ? m : g);
  v = TAIL ? fmaf(v, s.beta2, (s.c2 * g) * g) : fmaf(s.c2 * g, g, v * s.beta2);
  const float denom = sqrtf(v) / s.bc2_sqrt + s.eps;
  p = p + (s.neg_step_size * m) / denom;
}

// ---- SGD with momentum ----

struct SgdScalars {
  bool decay;        // weight_decay != 0
  bool momentum_on;  // momentum != 0
  bool nesterov;
  bool first_step;   // the momentum buffer starts as the gradient
  float weight_decay;
  float momentum;
  float damp_coeff;  // 1 - dampening
  float neg_lr;
};

inline SgdScalars sgd_scalars(double lr, double momentum, double dampening, double weight_decay,
                              bool nesterov, bool first_step) {
  SgdScalars s;
  s.decay = weight_decay != 0.0;
  s.momentum_on = momentum != 0.0;
  s.nesterov = nesterov;
  s.first_step = first_step;
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.damp_coeff = static_cast<float>(1.0 - dampening);
  s.neg_lr = static_cast<float>(-lr);
  return s;
}

// One element; buf is only read and written when momentum is on.
template <bool TAIL>
inline void sgd_element(const SgdScalars& s, float g, float& p, float& buf) {
  if (s.decay) g = fmaf(p, s.weight_decay, g);
  if (s.momentum_on) {
    if (s.first_step)
      buf = g;
    else
      buf = TAIL ? fmaf(buf, s.momentum, g * s.damp_coeff)
                 : fmaf(s.damp_coeff, g, buf * s.momentum);
    g = s.nesterov ? fmaf(buf, s.momentum, g) : buf;
  }
  p = fmaf(g, s.neg_lr, p);
}

}  // namespace cmo
