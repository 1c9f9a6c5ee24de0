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

// 32 gradients saved as save8 saves 8: whole 64-byte lines of 16-bit gradients (two of fp32)
// stored back to back (see kLineLanes).
template <class G>
inline void save32(typename G::Raw* dst, const typename G::Raw* src, bool stream) {
  for (int k = 0; k < 4; ++k) save8<G>(dst + 8 * k, src + 8 * k, stream);
}

// The new values of 8 elements, computed before they are stored.
struct Adam8 {
  __m256 param, exp_avg, exp_avg_sq;
};

// The body formulas on 8 elements of one tensor's rows: the scalars splatted once per call.
template <class G, class S>
class AdamMath {
 public:
  AdamMath(const AdamScalars& s, const AdamRows<G, S>& rows, const float* grad_scale)
      : p_(rows.p), g_(rows.g), m_(rows.m), v_(rows.v), lr_decay_(splat(s.lr_decay)),
        wd_(splat(s.weight_decay)), coeff_(splat(s.lerp_coeff)), c2_(splat(s.c2)),
        beta2_(splat(s.beta2)), bc2_sqrt_(splat(s.bc2_sqrt)), eps_(splat(s.eps)),
        neg_step_size_(splat(s.neg_step_size)), scale_(splat(grad_scale ? *grad_scale : 1.0f)),
        decay_(s.decay), decoupled_(s.decoupled), small_lerp_(s.small_lerp),
        scaled_(grad_scale != nullptr) {}

  // Reads elements [i, i + 8) and computes their new values (fp32 gradients divided by the
  // scale are written back here); moments(exp_avg, exp_avg_sq) may store the new moments as
  // soon as they are known.
  template <class Moments>
  __attribute__((always_inline)) Adam8 operator()(int64_t i, Moments&& moments) const {
    __m256 grad = load8<G>(g_ + i);
    if (scaled_) {
      grad = _mm256_div_ps(grad, scale_);
      if constexpr (std::is_same_v<G, F32>) _mm256_storeu_ps(g_ + i, grad);
    }
    __m256 param = _mm256_loadu_ps(p_ + i);
    if (decay_) {
      if (decoupled_)
        param = _mm256_mul_ps(param, lr_decay_);
      else
        grad = fma8(param, wd_, grad);
    }
    __m256 exp_avg = load8<S>(m_ + i);
    const __m256 base = small_lerp_ ? exp_avg : grad;
    exp_avg = fma8(coeff_, _mm256_sub_ps(grad, exp_avg), base);
    __m256 exp_avg_sq = load8<S>(v_ + i);
    exp_avg_sq = fma8(_mm256_mul_ps(c2_, grad), grad, _mm256_mul_ps(exp_avg_sq, beta2_));
    moments(exp_avg, exp_avg_sq);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(exp_avg_sq), bc2_sqrt_), eps_);
    param = _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(neg_step_size_, exp_avg), denom));
    return Adam8{param, exp_avg, exp_avg_sq};
  }

 private:
  // Copies, not the rows' or scalars' fields: the stores could alias them, which would reload
  // them per step.
  const float* const p_;
  typename G::Raw* const g_;
  const typename S::Raw* const m_;
  const typename S::Raw* const v_;
  const __m256 lr_decay_, wd_, coeff_, c2_, beta2_, bc2_sqrt_, eps_, neg_step_size_, scale_;
  const bool decay_, decoupled_, small_lerp_, scaled_;
};

// Elements per step of adam_lanes: 32, a whole 64-byte line of every 16-bit row and two of
// every fp32 row.
//
// [Note: whole lines a step] A non-temporal store goes to a write-combining buffer that is
// flushed to memory when its line is whole, or early when the buffers are needed for other
// lines; a line flushed in parts costs a read-modify-write of memory per part. Stored 8
// elements at a time, each row's line was written in 2 (fp32) or 4 (16-bit) parts with the
// other rows' stores between them, and on 2026-12-01's Ice Lake VM that made a speculative
// update 2.3 times as slow streamed as through the cache (row_stores.h). Computing 32 elements
// first and then storing each streamed row's lines whole took the streamed stores of a mimic of
// the update (3 fp32 rows and a 16-bit gradient read; 3 fp32 rows, the 16-bit copy and the saved
// gradients written elsewhere) from 15.5 to 1.8 ns an element, against 2.7 through the cache and
// 1.25 in place; 16 elements at a time (whole fp32 lines, half 16-bit ones) took 5.1. The same
// steps made the update in place faster too (17M elements, bf16 gradients, one core: 21-24 ms
// against 27-33 stored 8 at a time).
constexpr int64_t kLineLanes = 32;

// STREAM_PARAMS streams the new fp32 parameters, STREAM_MOMENTS the new moments (fp32 states
// only): an update out of place may write one elsewhere and the other in place (fp32
// training's speculative update keeps its parameters in place). Streamed rows are stored a whole
// line at a time (adam_range aligns them to 64 bytes), the others as they are computed.
template <class G, class S, class O, bool STREAM, bool STREAM_PARAMS, bool STREAM_MOMENTS>
void adam_lanes(const AdamScalars& s, int64_t n, const AdamRows<G, S>& rows,
                typename O::Raw* out, const float* grad_scale) {
  constexpr bool kStreamMoments = STREAM_MOMENTS && std::is_same_v<S, F32>;
  const AdamMath<G, S> update8(s, rows, grad_scale);
  // Moments through the cache as they are computed; streamed ones after the step's 32.
  const auto cached_moments = [&](int64_t i) {
    return [&rows, i](__m256 exp_avg, __m256 exp_avg_sq) {
      if constexpr (!kStreamMoments) {
        store8<S>(rows.m_new + i, exp_avg);
        store8<S>(rows.v_new + i, exp_avg_sq);
      }
    };
  };
  int64_t i = 0;
  for (; i + kLineLanes <= n; i += kLineLanes) {
    if (rows.g_saved) save32<G>(rows.g_saved + i, rows.g + i, rows.stream_saved);
    Adam8 r[4];
    for (int k = 0; k < 4; ++k) r[k] = update8(i + 8 * k, cached_moments(i + 8 * k));
    if constexpr (kStreamMoments) {
      for (int k = 0; k < 4; ++k) store_new8<true>(rows.m_new + i + 8 * k, r[k].exp_avg);
      for (int k = 0; k < 4; ++k) store_new8<true>(rows.v_new + i + 8 * k, r[k].exp_avg_sq);
    }
    for (int k = 0; k < 4; ++k) store_new8<STREAM_PARAMS>(rows.p_new + i + 8 * k, r[k].param);
    if constexpr (!std::is_same_v<O, NoOut>) {
      store_out16<O, STREAM>(out + i, r[0].param, r[1].param);
      store_out16<O, STREAM>(out + i + 16, r[2].param, r[3].param);
    }
  }
  for (; i < n; i += kLanes) {  // the last elements, fewer than kLineLanes
    if (rows.g_saved) save8<G>(rows.g_saved + i, rows.g + i, rows.stream_saved);
    const Adam8 r = update8(i, cached_moments(i));
    if constexpr (kStreamMoments) {
      store_new8<true>(rows.m_new + i, r.exp_avg);
      store_new8<true>(rows.v_new + i, r.exp_avg_sq);
    }
    store_new8<STREAM_PARAMS>(rows.p_new + i, r.param);
    if constexpr (!std::is_same_v<O, NoOut>) store_out8<O, STREAM>(out + i, r.param);
  }
  // Streamed stores are weakly ordered.
  if (STREAM || STREAM_PARAMS || kStreamMoments || rows.stream_saved) _mm_sfence();
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
