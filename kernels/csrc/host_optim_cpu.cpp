// CPU library of the chunkmem host optimizer: Adam/AdamW and SGD with momentum over lists of
// flat buffers in one call, a plain C ABI over raw pointers loaded with ctypes by
// kernels/host_optim.py. Per-element math: host_optim_math.h (scalar, the spec) and
// host_optim_avx2.h (its lanes); docs/host_optim.md says what each path is bit-identical to.
//
// [Note: work split] Every tensor is cut into blocks of kBlock elements; the blocks of all
// tensors of a call form one sequence and each OpenMP thread takes a contiguous run of it
// (static split). An element's formulas depend only on its index in its tensor (body or the
// last numel % 8), never on the block or the thread, so the result does not depend on the
// thread count. One call over many small tensors (the pieces of a chunk) wakes the team once.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

#include "host_optim_avx2.h"
#include "host_optim_math.h"
#include "row_stores.h"

namespace {

using cmo::AdamScalars;
using cmo::BF16;
using cmo::F16;
using cmo::F32;
using cmo::NoOut;
using cmo::SgdScalars;

// A multiple of 8 (a block starts on a vector step of its tensor) and of 16 (64-byte lines of
// fp32); 32K elements keep the per-block overhead negligible.
constexpr int64_t kBlock = 1 << 15;
// Below this many elements in a call the work runs on the calling thread.
constexpr int64_t kParallelMinNumel = 1 << 16;
// From this many elements in a call (112 MB of traffic, more than a last-level cache holds) the
// 16-bit copy of the parameters is streamed to memory (host_optim_avx2.h, store_out8).
constexpr int64_t kStreamMinNumel = 1 << 22;

// Whether the lanes may stream the 16-bit copy starting at out, aligned to `alignment` bytes
// (32: the lanes' 32-byte stores; 64 beside rows streamed elsewhere, a whole line at a time:
// [Note: whole lines a step]).
template <class O>
bool may_stream(bool large_call, const typename O::Raw* out, uintptr_t alignment = 32) {
  return !std::is_same_v<O, NoOut> && large_call &&
         reinterpret_cast<uintptr_t>(out) % alignment == 0;
}

#if HOST_OPTIM_HAVE_AVX2
// Streamed rows are stored a whole 64-byte line at a time ([Note: whole lines a step]).
inline bool aligned64(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

// Whether the lanes may stream the new parameters (host_optim_avx2.h, store_new8): written
// elsewhere than they are read, 64-byte aligned, and rows are streamed on this machine
// ([Note: streamed or cached row stores]).
template <class S, class G>
bool may_stream_params(const cmo::avx2::AdamRows<G, S>& rows, bool stream_rows) {
  return stream_rows && rows.p_new != rows.p && aligned64(rows.p_new);
}

// Whether the lanes may stream the new moments: fp32, both written elsewhere, aligned, and
// rows are streamed on this machine.
template <class S, class G>
bool may_stream_moments(const cmo::avx2::AdamRows<G, S>& rows, bool stream_rows) {
  return stream_rows && std::is_same_v<S, F32> && rows.m_new != rows.m && rows.v_new != rows.v &&
         aligned64(rows.m_new) && aligned64(rows.v_new);
}

// adam_lanes with its stream flags chosen at run time.
template <class G, class S, class O, bool STREAM>
void adam_lanes_streaming(const AdamScalars& s, int64_t n, const cmo::avx2::AdamRows<G, S>& rows,
                          typename O::Raw* out, const float* grad_scale, bool stream_rows) {
  const bool params = may_stream_params<S>(rows, stream_rows);
  const bool moments = may_stream_moments<S>(rows, stream_rows);
  if (params && moments)
    cmo::avx2::adam_lanes<G, S, O, STREAM, true, true>(s, n, rows, out, grad_scale);
  else if (params)
    cmo::avx2::adam_lanes<G, S, O, STREAM, true, false>(s, n, rows, out, grad_scale);
  else if (moments)
    cmo::avx2::adam_lanes<G, S, O, STREAM, false, true>(s, n, rows, out, grad_scale);
  else
    cmo::avx2::adam_lanes<G, S, O, STREAM, false, false>(s, n, rows, out, grad_scale);
}
#endif

enum Status : int { kOk = 0, kBadArgument = 1, kOutOfMemory = 2 };

// Runs fn(tensor, begin, end) over the blocks of `count` tensors (see the note above).
template <class Fn>
int for_blocks(const int64_t* numels, int count, int num_threads, Fn fn) {
  std::vector<int64_t> first_block;
  try {
    first_block.resize(static_cast<size_t>(count) + 1);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  int64_t total_numel = 0;
  first_block[0] = 0;
  for (int i = 0; i < count; ++i) {
    if (numels[i] < 0) return kBadArgument;
    total_numel += numels[i];
    first_block[i + 1] = first_block[i] + (numels[i] + kBlock - 1) / kBlock;
  }
  const int64_t blocks = first_block[count];
  const bool parallel = total_numel >= kParallelMinNumel && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    const int64_t threads = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t lo = blocks * t / threads;
    const int64_t hi = blocks * (t + 1) / threads;
    int i = static_cast<int>(std::upper_bound(first_block.begin(), first_block.end(), lo) -
                             first_block.begin()) - 1;
    for (int64_t b = lo; b < hi; ++b) {
      while (b >= first_block[i + 1]) ++i;
      const int64_t begin = (b - first_block[i]) * kBlock;
      fn(i, begin, std::min(begin + kBlock, numels[i]));
    }
  }
  return kOk;
}

template <class T>
inline float load(const typename T::Raw* p, int64_t i) {
  return T::load(p[i]);
}

template <class T>
inline void store(typename T::Raw* p, int64_t i, float x) {
  p[i] = T::store(x);
}

// The gradient of element i divided by the scale (written back for fp32 gradients).
template <class G>
inline float scaled_grad(typename G::Raw* g, int64_t i, const float* grad_scale) {
  float grad = load<G>(g, i);
  if (grad_scale) {
    grad = grad / *grad_scale;
    if constexpr (std::is_same_v<G, F32>) g[i] = grad;
  }
  return grad;
}

// Elements [begin, end) of one tensor of `numel` elements: reads p, m, v and writes the new
// values to p_new, m_new, v_new (the same pointers for an update in place; see
// [Note: updates out of place]); g_saved, when not null, receives the gradients as read.
// stream_rows: the rows written elsewhere (new values, saved gradients) may be streamed
// ([Note: streamed or cached row stores]).
template <class G, class S, class O>
void adam_range(const AdamScalars& s, int64_t numel, int64_t begin, int64_t end, const float* p,
                typename G::Raw* g, const typename S::Raw* m, const typename S::Raw* v,
                float* p_new, typename S::Raw* m_new, typename S::Raw* v_new,
                typename G::Raw* g_saved, typename O::Raw* out, const float* grad_scale,
                bool large_call, bool stream_rows) {
  const auto element = [&](auto tail, int64_t i) {
    if (g_saved) g_saved[i] = g[i];
    const float grad = scaled_grad<G>(g, i, grad_scale);
    float param = p[i], exp_avg = load<S>(m, i), exp_avg_sq = load<S>(v, i);
    cmo::adam_element<decltype(tail)::value>(s, grad, param, exp_avg, exp_avg_sq);
    p_new[i] = param;
    store<S>(m_new, i, exp_avg);
    store<S>(v_new, i, exp_avg_sq);
    if constexpr (!std::is_same_v<O, NoOut>) store<O>(out, i, param);
  };
  const int64_t body = std::min(end, cmo::body_end(numel));
  int64_t i = begin;
#if HOST_OPTIM_HAVE_AVX2
  if constexpr (std::is_same_v<S, F32>) {
    // Out of place: the first elements one at a time (the same bits) until the new rows are
    // 64-byte aligned, so that the lanes stream them a line at a time (store_new8, [Note:
    // whole lines a step]). The rows written elsewhere share their alignment (shadows
    // laid out like the payloads).
    const float* first_new = p_new != p ? p_new : m_new != m ? m_new : nullptr;
    if (first_new)
      for (; i < body && !aligned64(first_new + i); ++i) element(std::false_type{}, i);
  }
  if (i < body) {
    const int64_t n = (body - i) / cmo::kLanes * cmo::kLanes;  // the rest: one at a time, below
    typename O::Raw* o = std::is_same_v<O, NoOut> ? out : out + i;
    typename G::Raw* const saved = g_saved ? g_saved + i : nullptr;
    const bool stream_saved = stream_rows && saved && aligned64(saved);
    const cmo::avx2::AdamRows<G, S> rows{p + i,     g + i,     m + i, v + i, p_new + i,
                                         m_new + i, v_new + i, saved, stream_saved};
    // Beside rows streamed elsewhere the copy is streamed a whole line at a time too.
    const bool elsewhere = p_new != p || m_new != m || saved != nullptr;
    if (may_stream<O>(large_call, o, stream_rows && elsewhere ? 64 : 32))
      adam_lanes_streaming<G, S, O, true>(s, n, rows, o, grad_scale, stream_rows);
    else
      adam_lanes_streaming<G, S, O, false>(s, n, rows, o, grad_scale, stream_rows);
    i += n;
  }
#endif
  for (; i < body; ++i) element(std::false_type{}, i);
  for (; i < end; ++i) element(std::true_type{}, i);
}

template <class G, class S, class O>
void sgd_range(const SgdScalars& s, int64_t numel, int64_t begin, int64_t end, float* p,
               typename G::Raw* g, typename S::Raw* buf, typename O::Raw* out,
               const float* grad_scale, bool large_call) {
  const auto element = [&](auto tail, int64_t i) {
    const float grad = scaled_grad<G>(g, i, grad_scale);
    float b = s.momentum_on && !s.first_step ? load<S>(buf, i) : 0.0f;
    cmo::sgd_element<decltype(tail)::value>(s, grad, p[i], b);
    if (s.momentum_on) store<S>(buf, i, b);
    if constexpr (!std::is_same_v<O, NoOut>) store<O>(out, i, p[i]);
  };
  const int64_t body = std::min(end, cmo::body_end(numel));
  int64_t i = begin;
#if HOST_OPTIM_HAVE_AVX2
  if (i < body) {
    const int64_t n = body - i;
    typename S::Raw* b = s.momentum_on ? buf + i : buf;
    typename O::Raw* o = std::is_same_v<O, NoOut> ? out : out + i;
    if (may_stream<O>(large_call, o))
      cmo::avx2::sgd_lanes<G, S, O, true>(s, n, p + i, g + i, b, o, grad_scale);
    else
      cmo::avx2::sgd_lanes<G, S, O, false>(s, n, p + i, g + i, b, o, grad_scale);
    i = body;
  }
#endif
  for (; i < body; ++i) element(std::false_type{}, i);
  for (; i < end; ++i) element(std::true_type{}, i);
}

// Calls f(G{}, S{}, O{}) for the gradient, state and output types named by the dtype codes
// (cmq::DType; out_dtype -1: no 16-bit copy). States are fp32 or bf16, copies bf16 or fp16.
template <class F>
int with_types(int grad_dtype, int state_dtype, int out_dtype, F&& f) {
  const auto with_out = [&](auto grad, auto state) {
    switch (out_dtype) {
      case -1: return f(grad, state, NoOut{});
      case cmq::kBFloat16: return f(grad, state, BF16{});
      case cmq::kFloat16: return f(grad, state, F16{});
      default: return static_cast<int>(kBadArgument);
    }
  };
  const auto with_state = [&](auto grad) {
    switch (state_dtype) {
      case cmq::kFloat32: return with_out(grad, F32{});
      case cmq::kBFloat16: return with_out(grad, BF16{});
      default: return static_cast<int>(kBadArgument);
    }
  };
  switch (grad_dtype) {
    case cmq::kFloat32: return with_state(F32{});
    case cmq::kBFloat16: return with_state(BF16{});
    case cmq::kFloat16: return with_state(F16{});
    default: return kBadArgument;
  }
}

int64_t total_numel(const int64_t* numels, int count) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += numels[i];
  return total;
}

bool large_call(const int64_t* numels, int count) {
  return total_numel(numels, count) >= kStreamMinNumel;
}

// Where the first row an update writes elsewhere starts (null: in place).
const void* first_row_elsewhere(int count, void* const* new_params, void* const* new_exp_avgs,
                                void* const* grads_saved) {
  if (count == 0) return nullptr;
  if (new_params) return new_params[0];
  if (new_exp_avgs) return new_exp_avgs[0];
  for (int i = 0; grads_saved && i < count; ++i)
    if (grads_saved[i]) return grads_saved[i];
  return nullptr;
}

// The process's choice of row stores for updates out of place ([Note: streamed or cached row
// stores]): measured once, on the first large calls.
cmo::RowStoreChooser& row_store_chooser() {
  static cmo::RowStoreChooser chooser;
  return chooser;
}

template <class T>
typename T::Raw* as(void* p) {
  return static_cast<typename T::Raw*>(p);
}

// [Note: one summation order] A tensor's sum of squares is the sum, in double and in order, of
// its blocks' sums; a block's is the sum, in double and in order, of 32 fp32 lanes, element i
// of the block adding x*x to lane i % 32 with one rounding (fmaf, as _mm256_fmadd_ps). The
// AVX2 and scalar builds, and every thread count, give the same bits.
constexpr int kNormLanes = 32;

template <class G>
double block_sum_of_squares(const typename G::Raw* g, int64_t begin, int64_t end) {
  float lanes[kNormLanes] = {};
  int64_t i = begin;
#if HOST_OPTIM_HAVE_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (; i + kNormLanes <= end; i += kNormLanes) {
    for (int k = 0; k < 4; ++k) {
      const __m256 x = cmo::avx2::load8<G>(g + i + 8 * k);
      acc[k] = _mm256_fmadd_ps(x, x, acc[k]);
    }
  }
  for (int k = 0; k < 4; ++k) _mm256_storeu_ps(lanes + 8 * k, acc[k]);
#endif
  for (; i < end; ++i) {
    const float x = load<G>(g, i);
    float& lane = lanes[(i - begin) % kNormLanes];
    lane = std::fma(x, x, lane);
  }
  double sum = 0.0;
  for (const float lane : lanes) sum += lane;
  return sum;
}

// Per-block sums of squares of `count` tensors, reduced per tensor in block order into fp32
// norms ([Note: one summation order]): the blocks are for_blocks' blocks, so a pass that
// walks them (the norms alone, or Adam reading each block's gradients) fills one slot each.
class BlockSums {
 public:
  int init(const int64_t* numels, int count) {
    try {
      first_block_.resize(static_cast<size_t>(count) + 1);
      first_block_[0] = 0;
      for (int i = 0; i < count; ++i)
        first_block_[i + 1] =
            first_block_[i] + (std::max<int64_t>(numels[i], 0) + kBlock - 1) / kBlock;
      sums_.resize(static_cast<size_t>(first_block_[count]));
    } catch (const std::bad_alloc&) {
      return kOutOfMemory;
    }
    return kOk;
  }
  template <class G>
  void add(int i, const typename G::Raw* g, int64_t begin, int64_t end) {
    sums_[first_block_[i] + begin / kBlock] = block_sum_of_squares<G>(g, begin, end);
  }
  void finish(int count, float* norms) const {
    for (int i = 0; i < count; ++i) {
      double sum = 0.0;
      for (int64_t b = first_block_[i]; b < first_block_[i + 1]; ++b) sum += sums_[b];
      norms[i] = static_cast<float>(std::sqrt(sum));
    }
  }

 private:
  std::vector<int64_t> first_block_;
  std::vector<double> sums_;
};

template <class F>
int with_grad_type(int dtype, F&& f) {
  switch (dtype) {
    case cmq::kFloat32: return f(F32{});
    case cmq::kBFloat16: return f(BF16{});
    case cmq::kFloat16: return f(F16{});
    default: return kBadArgument;
  }
}

}  // namespace

extern "C" {

// 1 when the AVX2 lanes are compiled in, 0 when the scalar functions run every element.
int cmo_cpu_has_avx2() {
#if HOST_OPTIM_HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}

// One Adam (decoupled = 0) or AdamW (decoupled = 1) step over `count` tensors: params[i] fp32,
// grads[i] of grad_dtype, exp_avgs[i] and exp_avg_sqs[i] of state_dtype, params_out[i] of
// out_dtype (or ignored when out_dtype is -1), all of numels[i] elements; steps[i] points at
// the tensor's step count (already incremented). grad_scale, when not null, points at the
// number the gradients are divided by. new_params, new_exp_avgs and new_exp_avg_sqs, when not
// null, receive the new values and the inputs are only read ([Note: updates out of place]);
// null: the update is in place. grads_saved, when not null, holds for each tensor null or a
// buffer of its gradient's dtype and size that receives the gradient as read, before any
// division: what an undoable update needs of the gradients it overwrites or divides.
// grad_norms, when not null, receives each gradient's fp32 L2 norm before any division, the
// bits of cmo_cpu_norms, measured as each block is read (a speculative update measures the
// gradients it consumes for the step's clipping check: one pass over them, not two).
//
// [Note: updates out of place] A speculative update (offload/speculation.py) must leave its
// inputs as they were until the step knows it stands, so it writes the new fp32 values and
// moments elsewhere, and committing it is swapping buffers. With streamed stores, reading one
// buffer and writing another moves the same bytes as updating in place; whether those stores
// beat the cache's is the machine's, measured ([Note: streamed or cached row stores]). The
// arithmetic is the same: the results are bit for bit those of the update in place.
int cmo_cpu_adam(void* const* params, void* const* grads, void* const* exp_avgs,
                 void* const* exp_avg_sqs, void* const* params_out, void* const* new_params,
                 void* const* new_exp_avgs, void* const* new_exp_avg_sqs,
                 void* const* grads_saved, const float* const* steps, const int64_t* numels, int count, int grad_dtype,
                 int state_dtype, int out_dtype, double lr, double beta1, double beta2,
                 double weight_decay, double eps, int decoupled, const float* grad_scale,
                 float* grad_norms, int num_threads) {
  if (count < 0 || num_threads < 1) return kBadArgument;
  BlockSums sums;
  if (grad_norms != nullptr && sums.init(numels, count) != kOk) return kOutOfMemory;
  std::vector<AdamScalars> scalars;
  try {
    scalars.reserve(static_cast<size_t>(count));
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  for (int i = 0; i < count; ++i)
    scalars.push_back(
        cmo::adam_scalars(lr, beta1, beta2, weight_decay, eps, decoupled != 0, *steps[i]));
  const bool large = large_call(numels, count);
  const bool out_of_place = new_params != nullptr || new_exp_avgs != nullptr ||
                            new_exp_avg_sqs != nullptr || grads_saved != nullptr;
  // An update in place writes no row elsewhere: nothing to choose, nothing timed.
  cmo::TimedCall timed(row_store_chooser(), out_of_place ? total_numel(numels, count) : 0,
                       first_row_elsewhere(count, new_params, new_exp_avgs, grads_saved));
  const bool stream_rows = timed.kind() == cmo::kStreamed;
  const int status =
      with_types(grad_dtype, state_dtype, out_dtype, [&](auto grad, auto state, auto out) {
    using G = decltype(grad);
    using S = decltype(state);
    using O = decltype(out);
    return for_blocks(numels, count, num_threads, [&](int i, int64_t begin, int64_t end) {
      // The block's gradients measured first (before any division): read again by the
      // update from cache, not memory.
      if (grad_norms != nullptr) sums.add<G>(i, as<G>(grads[i]), begin, end);
      float* p = static_cast<float*>(params[i]);
      typename S::Raw* m = as<S>(exp_avgs[i]);
      typename S::Raw* v = as<S>(exp_avg_sqs[i]);
      adam_range<G, S, O>(scalars[i], numels[i], begin, end, p, as<G>(grads[i]), m, v,
                          new_params ? static_cast<float*>(new_params[i]) : p,
                          new_exp_avgs ? as<S>(new_exp_avgs[i]) : m,
                          new_exp_avg_sqs ? as<S>(new_exp_avg_sqs[i]) : v,
                          grads_saved ? as<G>(grads_saved[i]) : nullptr,
                          std::is_same_v<O, NoOut> ? nullptr : as<O>(params_out[i]), grad_scale,
                          large, stream_rows);
    });
  });
  if (status == kOk && out_of_place) timed.completed();
  if (status == kOk && grad_norms != nullptr) sums.finish(count, grad_norms);
  return status;
}

// How updates out of place store their rows from now on ([Note: streamed or cached row
// stores]): -1 measures anew, 0 streams, 1 goes through the cache.
int cmo_cpu_set_row_stores(int kind) {
  if (kind < cmo::kMeasure || kind > cmo::kCached) return kBadArgument;
  row_store_chooser().set(static_cast<cmo::RowStores>(kind));
  return kOk;
}

// The kind updates out of place use (-1 while still measuring), with the median ns per element
// of the timed calls of each kind and their counts.
int cmo_cpu_row_stores(double* streamed_ns, double* cached_ns, int* streamed_calls,
                       int* cached_calls) {
  return row_store_chooser().report(streamed_ns, cached_ns, streamed_calls, cached_calls);
}

// One SGD step over `count` tensors; momentum_buffers is only read when momentum != 0, and
// first_step makes each buffer start as its gradient (torch's is_first_step).
int cmo_cpu_sgd(void* const* params, void* const* grads, void* const* momentum_buffers,
                void* const* params_out, const int64_t* numels, int count, int grad_dtype,
                int state_dtype, int out_dtype, double lr, double momentum, double dampening,
                double weight_decay, int nesterov, int first_step, const float* grad_scale,
                int num_threads) {
  if (count < 0 || num_threads < 1) return kBadArgument;
  const SgdScalars s =
      cmo::sgd_scalars(lr, momentum, dampening, weight_decay, nesterov != 0, first_step != 0);
  const bool large = large_call(numels, count);
  return with_types(grad_dtype, state_dtype, out_dtype, [&](auto grad, auto state, auto out) {
    using G = decltype(grad);
    using S = decltype(state);
    using O = decltype(out);
    return for_blocks(numels, count, num_threads, [&](int i, int64_t begin, int64_t end) {
      sgd_range<G, S, O>(s, numels[i], begin, end, static_cast<float*>(params[i]),
                         as<G>(grads[i]), s.momentum_on ? as<S>(momentum_buffers[i]) : nullptr,
                         std::is_same_v<O, NoOut> ? nullptr : as<O>(params_out[i]), grad_scale,
                         large);
    });
  });
}

// The L2 norm of each of `count` tensors of `dtype` (fp32, bf16 or fp16), in fp32, into
// norms[i] (see [Note: one summation order]).
int cmo_cpu_norms(void* const* tensors, const int64_t* numels, int count, int dtype,
                  float* norms, int num_threads) {
  if (count < 0 || num_threads < 1) return kBadArgument;
  BlockSums sums;
  if (sums.init(numels, count) != kOk) return kOutOfMemory;
  const int status = with_grad_type(dtype, [&](auto type) {
    using G = decltype(type);
    return for_blocks(numels, count, num_threads, [&](int i, int64_t begin, int64_t end) {
      sums.add<G>(i, static_cast<const typename G::Raw*>(tensors[i]), begin, end);
    });
  });
  if (status != kOk) return status;
  sums.finish(count, norms);
  return kOk;
}

}  // extern "C"
