// AVX2 lanes of host_optim_math.h: the body formulas on 8 elements at a time.
//
// [Note: same bits in every lane] adam_lanes and sgd_lanes transcribe adam_element<false> and
// sgd_element<false> operation for operation; _mm256_fmadd_ps is the one rounding of fmaf,
// and -ffp-contract=off keeps every other multiply and add two roundings. The element types'
// loads and stores are quant_avx2.h's (exact widening, round-to-nearest-even narrowing).
// HOST_OPTIM_HAVE_AVX2 is 1 only when the target has AVX2, FMA and F16C; otherwise the scalar
// functions run every element.
#pragma once

#include "host_optim_math.h"
#include "quant_avx2.h"

#if CMQ_HAVE_AVX2 && defined(__FMA__)
#define HOST_OPTIM_HAVE_AVX2 1
#include <immintrin.h>

#include <type_traits>

namespace cmo {
namespace avx2 {

using cmq::avx2::Lanes;

template <class T>
inline __m256 load8(const typename T::Raw* p) {
  return Lanes<T>::load8(p);
}

// 8 fp32 lanes rounded to 8 bf16 or fp16 values.
template <class T>
inline __m128i narrow8(__m256 x) {
  if constexpr (std::is_same_v<T, BF16>) {
    // Values below 2^16 in 32-bit lanes: packus pairs the halves (x0-3 x0-3 | x4-7 x4-7) and
    // the permute brings x0-7 to the low 128 bits.
    const __m256i n = Lanes<BF16>::narrow<true>(x);
    return _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_packus_epi32(n, n), 0xD8));
  } else {
    return Lanes<F16>::narrow<true>(x);
  }
}

template <class T>
inline void store8(typename T::Raw* p, __m256 x) {
  if constexpr (std::is_same_v<T, F32>) {
    _mm256_storeu_ps(p, x);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow8<T>(x));
  }
}

// The 16-bit copy of the parameters is written once and not read here: with STREAM (p 32-byte
// aligned for 16 elements, 16-byte for 8) it goes to memory without the line being read first
// (non-temporal store), so the mixed step moves no more bytes than fp32 AdamW.
template <class O, bool STREAM>
inline void store_out8(typename O::Raw* p, __m256 x) {
  if constexpr (STREAM)
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), narrow8<O>(x));
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow8<O>(x));
}

// 16 values (a: elements 0-7, b: 8-15) in one 32-byte store.
template <class O, bool STREAM>
inline void store_out16(typename O::Raw* p, __m256 a, __m256 b) {
  __m256i packed;
  if constexpr (std::is_same_v<O, BF16>) {
    // packus interleaves 4-element halves (a0-3 b0-3 | a4-7 b4-7); the permute restores order.
    packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(Lanes<BF16>::narrow<true>(a), Lanes<BF16>::narrow<true>(b)), 0xD8);
  } else {
    packed = _mm256_set_m128i(Lanes<F16>::narrow<true>(b), Lanes<F16>::narrow<true>(a));
  }
  if constexpr (STREAM)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

// Runs step8(i) (which returns the 8 new parameters at i) over [0, n), n a multiple of 8, and
// writes the 16-bit copy to out unless O is NoOut.
template <class O, bool STREAM, class Step>
inline void for_steps(int64_t n, typename O::Raw* out, Step step8) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<O, NoOut>) {
    for (; i + 16 <= n; i += 16) {
      const __m256 a = step8(i);
      const __m256 b = step8(i + 8);
      store_out16<O, STREAM>(out + i, a, b);
    }
  }
  for (; i < n; i += kLanes) {
    const __m256 param = step8(i);
    if constexpr (!std::is_same_v<O, NoOut>) store_out8<O, STREAM>(out + i, param);
  }
  if constexpr (STREAM) _mm_sfence();  // streamed stores are weakly ordered
}

inline __m256 fma8(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 splat(float x) { return _mm256_set1_ps(x); }

// Elements [0, n) of one tensor, n a multiple of 8, with the body formulas. Gradients of type
// G are divided by *grad_scale when it is given (and written back when G is fp32, as torch
// does); states are of type S; a 16-bit copy of the new parameters goes to out unless O is
// NoOut (see store_out8 for STREAM).
// One tensor's rows for adam_lanes: what it reads (p, g, m, v) and where the new values go
// (p_new, m_new, v_new: the same pointers for an update in place); g_saved, when not null,
// receives the gradients as read (see save8), streamed where stream_saved says so.
template <class G, class S>
struct AdamRows {
  const float* p;
  typename G::Raw* g;
  const typename S::Raw* m;
  const typename S::Raw* v;
  float* p_new;
  typename S::Raw* m_new;
  typename S::Raw* v_new;
  typename G::Raw* g_saved = nullptr;
  bool stream_saved = false;
};

// 8 gradients copied as they are (before any division) from src to dst, for an update that
// overwrites them and may be undone (offload/speculation.py). The lanes load src anyway, so
// the copy costs its store only; with stream (dst aligned to the 8 values' size) the store
// does not read the line first: the copy is read again only if the step rolls back.
template <class G>
inline void save8(typename G::Raw* dst, const typename G::Raw* src, bool stream) {
  if constexpr (sizeof(typename G::Raw) == 4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    if (stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), x);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), x);
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    if (stream)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), x);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), x);
  }
}

// An fp32 row of new values: with STREAM_NEW (written out of place, the row 32-byte aligned)
// it goes to memory without its line being read first. The kernel never reads what it writes
// there, and the next reader is the next step's update, so caching it gains nothing, while
// writing it through the cache reads every line first: 1.6x the bytes of the update in place.
// Some machines stream far slower than that costs: the library measures which kind to use
// (row_stores.h, [Note: streamed or cached row stores]).
template <bool STREAM_NEW>
inline void store_new8(float* p, __m256 x) {
  if constexpr (STREAM_NEW)
    _mm256_stream_ps(p, x);
  else
    _mm256_storeu_ps(p, x);
}

// STREAM_PARAMS streams the new fp32 parameters, STREAM_MOMENTS the new moments (fp32 states
// only): an update out of place may write one elsewhere and the other in place (fp32
// training's speculative update keeps its parameters in place).
template <class G, class S, class O, bool STREAM, bool STREAM_PARAMS, bool STREAM_MOMENTS>
void adam_lanes(const AdamScalars& s, int64_t n, const AdamRows<G, S>& rows,
                typename O::Raw* out, const float* grad_scale) {
  constexpr bool kStreamMoments = STREAM_MOMENTS && std::is_same_v<S, F32>;
  const float* const p = rows.p;
  typename G::Raw* const g = rows.g;
  const typename S::Raw* const m = rows.m;
  const typename S::Raw* const v = rows.v;
  const __m256 lr_decay = splat(s.lr_decay), wd = splat(s.weight_decay);
  const __m256 coeff = splat(s.lerp_coeff), c2 = splat(s.c2), beta2 = splat(s.beta2);
  const __m256 bc2_sqrt = splat(s.bc2_sqrt), eps = splat(s.eps);
  const __m256 neg_step_size = splat(s.neg_step_size);
  // Locals, not s's fields: the stores below could alias s, which would reload them per step.
  const bool decay = s.decay, decoupled = s.decoupled, small_lerp = s.small_lerp;
  const __m256 scale = splat(grad_scale ? *grad_scale : 1.0f);
  typename G::Raw* const g_saved = rows.g_saved;
  const bool stream_saved = rows.stream_saved;
  for_steps<O, STREAM>(n, out, [&](int64_t i) {
    if (g_saved) save8<G>(g_saved + i, g + i, stream_saved);
    __m256 grad = load8<G>(g + i);
    if (grad_scale) {
      grad = _mm256_div_ps(grad, scale);
      if constexpr (std::is_same_v<G, F32>) _mm256_storeu_ps(g + i, grad);
    }
    __m256 param = _mm256_loadu_ps(p + i);
    if (decay) {
      if (decoupled)
        param = _mm256_mul_ps(param, lr_decay);
      else
        grad = fma8(param, wd, grad);
    }
    __m256 exp_avg = load8<S>(m + i);
    const __m256 base = small_lerp ? exp_avg : grad;
    exp_avg = fma8(coeff, _mm256_sub_ps(grad, exp_avg), base);
    __m256 exp_avg_sq = load8<S>(v + i);
    exp_avg_sq = fma8(_mm256_mul_ps(c2, grad), grad, _mm256_mul_ps(exp_avg_sq, beta2));
    if constexpr (kStreamMoments) {
      store_new8<true>(rows.m_new + i, exp_avg);
      store_new8<true>(rows.v_new + i, exp_avg_sq);
    } else {
      store8<S>(rows.m_new + i, exp_avg);
      store8<S>(rows.v_new + i, exp_avg_sq);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(exp_avg_sq), bc2_sqrt), eps);
    param = _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(neg_step_size, exp_avg), denom));
    store_new8<STREAM_PARAMS>(rows.p_new + i, param);
    return param;
  });
  // Streamed stores are weakly ordered.
  if (STREAM_PARAMS || kStreamMoments || stream_saved) _mm_sfence();
}

template <class G, class S, class O, bool STREAM>
void sgd_lanes(const SgdScalars& s, int64_t n, float* p, typename G::Raw* g,
               typename S::Raw* buf, typename O::Raw* out, const float* grad_scale) {
  const __m256 wd = splat(s.weight_decay), momentum = splat(s.momentum);
  const __m256 damp_coeff = splat(s.damp_coeff), neg_lr = splat(s.neg_lr);
  const bool decay = s.decay, momentum_on = s.momentum_on, first_step = s.first_step;
  const bool nesterov = s.nesterov;
  const __m256 scale = splat(grad_scale ? *grad_scale : 1.0f);
  for_steps<O, STREAM>(n, out, [&](int64_t i) {
    __m256 grad = load8<G>(g + i);
    if (grad_scale) {
      grad = _mm256_div_ps(grad, scale);
      if constexpr (std::is_same_v<G, F32>) _mm256_storeu_ps(g + i, grad);
    }
    __m256 param = _mm256_loadu_ps(p + i);
    if (decay) grad = fma8(param, wd, grad);
    if (momentum_on) {
      __m256 b = grad;
      if (!first_step) b = fma8(damp_coeff, grad, _mm256_mul_ps(load8<S>(buf + i), momentum));
      store8<S>(buf + i, b);
      grad = nesterov ? fma8(b, momentum, grad) : b;
    }
    param = fma8(grad, neg_lr, param);
    _mm256_storeu_ps(p + i, param);
    return param;
  });
}

}  // namespace avx2
}  // namespace cmo

#else
#define HOST_OPTIM_HAVE_AVX2 0
#endif
