// CUDA library of the chunkmem quantization kernels: launchers with a plain C ABI over raw
// device pointers and a stream, loaded with ctypes by kernels/_cuda.py. No torch headers, so it
// builds with nvcc alone. One kernel per operation: block-per-group (grid-stride over groups)
// where a group needs its statistics, grid-stride over elements where it does not. Per-element
// math lives in quant_math.h; the spec is docs/kernels.md.
//
// Build flags that keep results bit-identical to the CPU library and the reference:
// --fmad=false --ftz=false --prec-div=true --prec-sqrt=true.
#include <cuda_runtime.h>
#include <stdio.h>

#include <type_traits>

#include "quant_math.h"

namespace {

using cmq::byte_of;
using cmq::ceil_div;
using cmq::F32;
using cmq::field_of;
using cmq::GroupParams;
using cmq::GroupSpan;
using cmq::GroupStats;
using cmq::level_value;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Grid-stride loops cover any size; more blocks than this adds nothing but launch cost.
constexpr int64_t kMaxBlocks = 1 << 16;
// Pointers of every input of a reduction travel in the kernel's parameters (3 KiB of the
// 4 KiB limit), so no device allocation or copy is needed per call.
constexpr int kMaxInputs = 128;

struct InputPtrs {
  const uint8_t* q[kMaxInputs];
  const float* scales[kMaxInputs];
  const float* offsets[kMaxInputs];
  int count;
};

thread_local char g_last_error[512] = "";

int fail(int status, const char* what, const char* detail) {
  snprintf(g_last_error, sizeof g_last_error, "%s: %s", what, detail);
  return status;
}

int launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(cmq::kCudaError, what, cudaGetErrorString(e));
  g_last_error[0] = '\0';
  return cmq::kOk;
}

int blocks_for(int64_t wanted) { return static_cast<int>(wanted < kMaxBlocks ? wanted : kMaxBlocks); }

__device__ GroupStats shuffle_merge(GroupStats s, int lane_mask) {
  GroupStats o;
  o.abs_bits = __shfl_xor_sync(0xFFFFFFFFu, s.abs_bits, lane_mask);
  o.min_key = __shfl_xor_sync(0xFFFFFFFFu, s.min_key, lane_mask);
  o.max_key = __shfl_xor_sync(0xFFFFFFFFu, s.max_key, lane_mask);
  return cmq::merge_stats(s, o);
}

// The block's combined statistics, returned to every thread. Integer min/max: the result does
// not depend on the combination order.
__device__ GroupStats block_stats(GroupStats s) {
  __shared__ GroupStats per_warp[kWarps];
  for (int m = 16; m > 0; m /= 2) s = shuffle_merge(s, m);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) per_warp[warp] = s;
  __syncthreads();
  GroupStats all = cmq::empty_stats();
  for (int w = 0; w < kWarps; ++w) all = cmq::merge_stats(all, per_warp[w]);
  __syncthreads();  // per_warp is rewritten by the next group
  return all;
}

struct PlainSpans {
  int64_t numel, group_size;
  __device__ GroupSpan operator()(int64_t g) const { return cmq::plain_group(g, numel, group_size); }
};

struct SwizzledSpans {
  int64_t numel, group_size, slice_numel, nodes, devices_per_node;
  __device__ GroupSpan operator()(int64_t g) const {
    return cmq::swizzled_group(g, numel, group_size, slice_numel, nodes, devices_per_node);
  }
};

// Element e of a group: the input value, a padding zero, or (past length) absent.
template <class In>
__device__ float span_value(const typename In::Raw* x, const GroupSpan& span, int64_t e) {
  return e < span.valid ? In::load(x[span.source + e]) : 0.0f;
}

// Writes the levels of one group given every element's value through value_at(e).
template <class Fmt, class ValueAt>
__device__ void encode_group(const GroupParams& p, int64_t length, ValueAt value_at, uint8_t* out) {
  constexpr bool kSym = Fmt::kSymmetric;
  const auto level = [&](int64_t e) {
    return p.finite ? cmq::encode_level<Fmt::kBits>(cmq::quantize_value<kSym>(value_at(e), p)) : 0;
  };
  if constexpr (Fmt::kBits == 8) {
    for (int64_t e = threadIdx.x; e < length; e += blockDim.x) out[e] = level(e);
  } else {
    for (int64_t b = threadIdx.x; b < (length + 1) / 2; b += blockDim.x) {
      const uint8_t hi = 2 * b + 1 < length ? level(2 * b + 1) : 0;
      out[b] = static_cast<uint8_t>(level(2 * b) | (hi << 4));
    }
  }
}

template <class Fmt>
__device__ void store_params(const GroupParams& p, int64_t g, float* scales, float* offsets) {
  if (threadIdx.x != 0) return;
  scales[g] = p.scale;
  if (!Fmt::kSymmetric) offsets[g] = p.offset;
}

template <class In, class Fmt, class Spans>
__global__ void quantize_kernel(const typename In::Raw* x, int64_t groups, int64_t group_size,
                                Spans spans, uint8_t* q, float* scales, float* offsets) {
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const GroupSpan span = spans(g);
    GroupStats s = cmq::empty_stats();
    for (int64_t e = threadIdx.x; e < span.length; e += blockDim.x)
      cmq::add_to_stats(s, span_value<In>(x, span, e));
    const GroupParams p = cmq::group_params<Fmt::kSymmetric>(block_stats(s), Fmt::kBits);
    store_params<Fmt>(p, g, scales, offsets);
    encode_group<Fmt>(p, span.length, [&](int64_t e) { return span_value<In>(x, span, e); },
                      q + byte_of<Fmt::kBits>(g * group_size));
  }
}

// ---- register tiles: groups of up to kThreads * kTile elements are read once ----
// Thread t of a group's block holds elements [t * kTile, t * kTile + kTile) in registers: read
// with one 16-byte load (or two) when aligned and whole, written with one store; the group's
// statistics and levels come from those registers, so the input is read once, not twice.
// Per-element math and order are those of the loops above: the bits are the same.
constexpr int kTile = 8;
constexpr int64_t kTileGroup = static_cast<int64_t>(kThreads) * kTile;

__device__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements [first, first + kTile) of a group (padding and absent elements read as 0).
template <class In>
__device__ void load_tile(const typename In::Raw* x, const GroupSpan& span, int64_t first,
                          float (&v)[kTile]) {
  const typename In::Raw* src = x + span.source + first;
  if (first + kTile <= span.valid && aligned16(src)) {
    if constexpr (sizeof(typename In::Raw) == 4) {
      const float4 a = reinterpret_cast<const float4*>(src)[0];
      const float4 b = reinterpret_cast<const float4*>(src)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 w = *reinterpret_cast<const uint4*>(src);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = In::load(static_cast<uint16_t>(words[j] & 0xFFFFu));
        v[2 * j + 1] = In::load(static_cast<uint16_t>(words[j] >> 16));
      }
    }
    return;
  }
  for (int j = 0; j < kTile; ++j) v[j] = span_value<In>(x, span, first + j);
}

__device__ GroupStats tile_stats(const float (&v)[kTile], int64_t first, int64_t length) {
  GroupStats s = cmq::empty_stats();
  for (int j = 0; j < kTile; ++j)
    if (first + j < length) cmq::add_to_stats(s, v[j]);
  return s;
}

// Writes the levels of a tile's elements that lie in the group; out is the group's first byte.
template <class Fmt>
__device__ void encode_tile(const GroupParams& p, const float (&v)[kTile], int64_t first,
                            int64_t length, uint8_t* out) {
  constexpr bool kSym = Fmt::kSymmetric;
  uint8_t levels[kTile];
  for (int j = 0; j < kTile; ++j)
    levels[j] = p.finite ? cmq::encode_level<Fmt::kBits>(cmq::quantize_value<kSym>(v[j], p)) : 0;
  if constexpr (Fmt::kBits == 8) {
    uint8_t* dst = out + first;
    if (first + kTile <= length && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
      uint64_t word = 0;
      for (int j = 0; j < kTile; ++j) word |= static_cast<uint64_t>(levels[j]) << (8 * j);
      *reinterpret_cast<uint64_t*>(dst) = word;
    } else {
      for (int j = 0; j < kTile && first + j < length; ++j) dst[j] = levels[j];
    }
  } else {
    uint8_t* dst = out + first / 2;
    if (first + kTile <= length && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
      uint32_t word = 0;
      for (int j = 0; j < kTile / 2; ++j)
        word |= static_cast<uint32_t>(levels[2 * j] | (levels[2 * j + 1] << 4)) << (8 * j);
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
      for (int j = 0; j < kTile / 2 && first + 2 * j < length; ++j) {
        const uint8_t hi = first + 2 * j + 1 < length ? levels[2 * j + 1] : 0;
        dst[j] = static_cast<uint8_t>(levels[2 * j] | (hi << 4));
      }
    }
  }
}

template <class In, class Fmt, class Spans>
__global__ void quantize_tile_kernel(const typename In::Raw* x, int64_t groups,
                                     int64_t group_size, Spans spans, uint8_t* q, float* scales,
                                     float* offsets) {
  const int64_t first = static_cast<int64_t>(threadIdx.x) * kTile;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const GroupSpan span = spans(g);
    float v[kTile];
    load_tile<In>(x, span, first, v);
    const GroupParams p =
        cmq::group_params<Fmt::kSymmetric>(block_stats(tile_stats(v, first, span.length)), Fmt::kBits);
    store_params<Fmt>(p, g, scales, offsets);
    encode_tile<Fmt>(p, v, first, span.length, q + byte_of<Fmt::kBits>(g * group_size));
  }
}

// Sum over inputs of element e (in group g), added in input order in fp32.
template <class Fmt>
__device__ float reduced_value(const InputPtrs& in, int64_t g, int64_t e) {
  float acc = 0.0f;
  for (int k = 0; k < in.count; ++k) {
    const float offset = Fmt::kSymmetric ? 0.0f : in.offsets[k][g];
    const float v = level_value<Fmt>(field_of<Fmt::kBits>(in.q[k], e), in.scales[k][g], offset);
    acc = k == 0 ? v : acc + v;
  }
  return acc;
}

template <class Fmt, class Out>
__global__ void dequant_reduce_kernel(InputPtrs in, int64_t numel, int64_t group_size,
                                      typename Out::Raw* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < numel; e += stride)
    out[e] = Out::store(reduced_value<Fmt>(in, e / group_size, e));
}

// One block per group: the sums are computed once for the statistics and again (identically)
// for encoding, which costs a second read of the inputs but no scratch memory.
template <class Fmt>
__global__ void dequant_reduce_requant_kernel(InputPtrs in, int64_t numel, int64_t group_size,
                                              uint8_t* q, float* scales, float* offsets) {
  const int64_t groups = ceil_div(numel, group_size);
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const GroupSpan span = cmq::plain_group(g, numel, group_size);
    const auto value_at = [&](int64_t e) { return reduced_value<Fmt>(in, g, span.source + e); };
    GroupStats s = cmq::empty_stats();
    for (int64_t e = threadIdx.x; e < span.length; e += blockDim.x) cmq::add_to_stats(s, value_at(e));
    const GroupParams p = cmq::group_params<Fmt::kSymmetric>(block_stats(s), Fmt::kBits);
    store_params<Fmt>(p, g, scales, offsets);
    encode_group<Fmt>(p, span.length, value_at, q + byte_of<Fmt::kBits>(g * group_size));
  }
}

// Levels of kTile elements from e on (e + kTile within the group) of one input, as one word:
// 8 bytes (int8) or 4 (int4, e even), read at once where aligned.
template <int BITS>
using TileWord = std::conditional_t<BITS == 8, uint64_t, uint32_t>;

template <int BITS>
__device__ TileWord<BITS> load_levels(const uint8_t* q, int64_t e) {
  const uint8_t* src = q + byte_of<BITS>(e);
  constexpr int kBytes = sizeof(TileWord<BITS>);
  if (reinterpret_cast<uintptr_t>(src) % kBytes == 0) return *reinterpret_cast<const TileWord<BITS>*>(src);
  TileWord<BITS> word = 0;
  for (int b = 0; b < kBytes; ++b) word |= static_cast<TileWord<BITS>>(src[b]) << (8 * b);
  return word;
}

// Adds one input's levels (its word, scale, offset) to v, in input order like reduced_value.
template <class Fmt>
__device__ void add_levels(TileWord<Fmt::kBits> word, float scale, float offset, bool first,
                           float (&v)[kTile]) {
  constexpr int kFieldBits = Fmt::kBits;
  constexpr uint32_t kMask = (1u << kFieldBits) - 1u;
  for (int j = 0; j < kTile; ++j) {
    const uint32_t field = static_cast<uint32_t>(word >> (kFieldBits * j)) & kMask;
    const float x = level_value<Fmt>(field, scale, offset);
    v[j] = first ? x : v[j] + x;
  }
}

// Inputs are read kLoadBatch at a time, all loads issued before any is used: a loop that loads
// and adds one input at a time waits for memory once per input.
constexpr int kLoadBatch = 4;

template <class Fmt>
__device__ void reduce_whole_tile(const InputPtrs& in, int64_t g, int64_t e, float (&v)[kTile]) {
  for (int k0 = 0; k0 < in.count; k0 += kLoadBatch) {
    TileWord<Fmt::kBits> words[kLoadBatch];
    float scales[kLoadBatch], offsets[kLoadBatch];
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      if (k0 + b >= in.count) break;
      words[b] = load_levels<Fmt::kBits>(in.q[k0 + b], e);
      scales[b] = in.scales[k0 + b][g];
      offsets[b] = Fmt::kSymmetric ? 0.0f : in.offsets[k0 + b][g];
    }
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      if (k0 + b >= in.count) break;
      add_levels<Fmt>(words[b], scales[b], offsets[b], k0 + b == 0, v);
    }
  }
}

// The reduced values of elements [e, e + kTile) of group g; elements at or past `end` (the
// group's end) are computed one by one where they exist and read as 0 where they do not.
template <class Fmt>
__device__ void reduce_tile(const InputPtrs& in, int64_t g, int64_t e, int64_t end, float (&v)[kTile]) {
  if (e + kTile <= end) {
    reduce_whole_tile<Fmt>(in, g, e, v);
    return;
  }
  for (int j = 0; j < kTile; ++j) v[j] = e + j < end ? reduced_value<Fmt>(in, g, e + j) : 0.0f;
}

template <class Out>
__device__ void store_tile(const float (&v)[kTile], typename Out::Raw* dst) {
  if constexpr (sizeof(typename Out::Raw) == 4) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t words[4];
    for (int j = 0; j < 4; ++j)
      words[j] = static_cast<uint32_t>(Out::store(v[2 * j])) |
                 (static_cast<uint32_t>(Out::store(v[2 * j + 1])) << 16);
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// Grid-stride over tiles of kTile elements; needs group_size % kTile == 0, so a tile lies in
// one group. A tile whose output is unaligned or that ends past numel goes element by element.
template <class Fmt, class Out>
__global__ void dequant_reduce_tile_kernel(InputPtrs in, int64_t numel, int64_t group_size,
                                           typename Out::Raw* out) {
  const int64_t tiles = ceil_div(numel, kTile);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tiles; t += stride) {
    const int64_t e = t * kTile;
    const int64_t g = e / group_size;
    if (e + kTile <= numel && aligned16(out + e)) {
      float v[kTile];
      reduce_tile<Fmt>(in, g, e, numel, v);
      store_tile<Out>(v, out + e);
    } else {
      for (int64_t i = e; i < e + kTile && i < numel; ++i)
        out[i] = Out::store(reduced_value<Fmt>(in, g, i));
    }
  }
}

// dequant_reduce_requant_kernel with register tiles: each sum is computed once.
template <class Fmt>
__global__ void dequant_reduce_requant_tile_kernel(InputPtrs in, int64_t numel, int64_t group_size,
                                                   uint8_t* q, float* scales, float* offsets) {
  const int64_t groups = ceil_div(numel, group_size);
  const int64_t first = static_cast<int64_t>(threadIdx.x) * kTile;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const GroupSpan span = cmq::plain_group(g, numel, group_size);
    float v[kTile];
    reduce_tile<Fmt>(in, g, span.source + first, span.source + span.length, v);
    const GroupParams p =
        cmq::group_params<Fmt::kSymmetric>(block_stats(tile_stats(v, first, span.length)), Fmt::kBits);
    store_params<Fmt>(p, g, scales, offsets);
    encode_tile<Fmt>(p, v, first, span.length, q + byte_of<Fmt::kBits>(g * group_size));
  }
}

template <class Spans>
int launch_quantize(const char* what, const void* x, int dtype, int64_t groups, int64_t group_size,
                    int bits, int symmetric, Spans spans, uint8_t* q, float* scales,
                    float* offsets, cudaStream_t stream) {
  if (groups == 0) return cmq::kOk;
  return cmq::with_dtype(dtype, [&](auto in) {
    using In = decltype(in);
    return cmq::with_format(bits, symmetric, [&](auto fmt) {
      using Fmt = decltype(fmt);
      const auto* raw = static_cast<const typename In::Raw*>(x);
      if (group_size <= kTileGroup)
        quantize_tile_kernel<In, Fmt><<<blocks_for(groups), kThreads, 0, stream>>>(
            raw, groups, group_size, spans, q, scales, offsets);
      else
        quantize_kernel<In, Fmt><<<blocks_for(groups), kThreads, 0, stream>>>(
            raw, groups, group_size, spans, q, scales, offsets);
      return launched(what);
    });
  });
}

int gather_inputs(const uint8_t* const* q, const float* const* scales, const float* const* offsets,
                  int count, InputPtrs* in) {
  if (count < 1 || count > kMaxInputs) {
    char detail[96];
    snprintf(detail, sizeof detail, "count=%d, must be in [1, %d]", count, kMaxInputs);
    return fail(cmq::kBadArgument, "dequant_reduce", detail);
  }
  for (int k = 0; k < count; ++k) {
    in->q[k] = q[k];
    in->scales[k] = scales[k];
    in->offsets[k] = offsets[k];
  }
  in->count = count;
  return cmq::kOk;
}

}  // namespace

extern "C" {

int cmq_cuda_runtime_version() { return CUDART_VERSION; }

const char* cmq_cuda_last_error() { return g_last_error; }

// kOk when this library holds code for the current device, else kCudaError with the reason.
int cmq_cuda_probe() {
  cudaFuncAttributes attributes;
  const cudaError_t e = cudaFuncGetAttributes(
      &attributes, dequant_reduce_kernel<cmq::Format<8, true>, F32>);
  if (e != cudaSuccess) return fail(cmq::kCudaError, "probe", cudaGetErrorString(e));
  return cmq::kOk;
}

int cmq_cuda_quantize(const void* x, int dtype, int64_t numel, int bits, int64_t group_size,
                      int symmetric, uint8_t* q, float* scales, float* offsets, void* stream) {
  if (!cmq::valid_layout(numel, bits, group_size)) return fail(cmq::kBadArgument, "quantize", "layout");
  return launch_quantize("quantize", x, dtype, ceil_div(numel, group_size), group_size, bits,
                         symmetric, PlainSpans{numel, group_size}, q, scales, offsets,
                         static_cast<cudaStream_t>(stream));
}

int cmq_cuda_swizzled_quantize(const void* x, int dtype, int64_t numel, int64_t nodes,
                               int64_t devices_per_node, int64_t slice_numel, int bits,
                               int64_t group_size, int symmetric, uint8_t* q, float* scales,
                               float* offsets, void* stream) {
  if (!cmq::valid_layout(numel, bits, group_size) || nodes < 1 || devices_per_node < 1 ||
      slice_numel < 0 || slice_numel % group_size != 0 ||
      slice_numel * nodes * devices_per_node < numel)
    return fail(cmq::kBadArgument, "swizzled_quantize", "layout");
  const int64_t groups = nodes * devices_per_node * (slice_numel / group_size);
  return launch_quantize("swizzled_quantize", x, dtype, groups, group_size, bits, symmetric,
                         SwizzledSpans{numel, group_size, slice_numel, nodes, devices_per_node}, q,
                         scales, offsets, static_cast<cudaStream_t>(stream));
}

int cmq_cuda_dequant_reduce(const uint8_t* const* q, const float* const* scales,
                            const float* const* offsets, int count, int64_t numel, int bits,
                            int64_t group_size, int symmetric, void* out, int out_dtype,
                            void* stream) {
  if (!cmq::valid_layout(numel, bits, group_size)) return fail(cmq::kBadArgument, "dequant_reduce", "layout");
  InputPtrs in;
  const int status = gather_inputs(q, scales, offsets, count, &in);
  if (status != cmq::kOk || numel == 0) return status;
  return cmq::with_dtype(out_dtype, [&](auto o) {
    using Out = decltype(o);
    return cmq::with_format(bits, symmetric, [&](auto fmt) {
      using Fmt = decltype(fmt);
      auto* raw = static_cast<typename Out::Raw*>(out);
      const auto s = static_cast<cudaStream_t>(stream);
      if (group_size % kTile == 0)
        dequant_reduce_tile_kernel<Fmt, Out>
            <<<blocks_for(ceil_div(numel, kTileGroup)), kThreads, 0, s>>>(in, numel, group_size, raw);
      else
        dequant_reduce_kernel<Fmt, Out>
            <<<blocks_for(ceil_div(numel, kThreads)), kThreads, 0, s>>>(in, numel, group_size, raw);
      return launched("dequant_reduce");
    });
  });
}

int cmq_cuda_dequant_reduce_requant(const uint8_t* const* q, const float* const* scales,
                                    const float* const* offsets, int count, int64_t numel,
                                    int bits, int64_t group_size, int symmetric, uint8_t* q_out,
                                    float* scales_out, float* offsets_out, void* stream) {
  if (!cmq::valid_layout(numel, bits, group_size)) return fail(cmq::kBadArgument, "dequant_reduce_requant", "layout");
  InputPtrs in;
  const int status = gather_inputs(q, scales, offsets, count, &in);
  if (status != cmq::kOk || numel == 0) return status;
  return cmq::with_format(bits, symmetric, [&](auto fmt) {
    using Fmt = decltype(fmt);
    const int blocks = blocks_for(ceil_div(numel, group_size));
    const auto s = static_cast<cudaStream_t>(stream);
    if (group_size <= kTileGroup)
      dequant_reduce_requant_tile_kernel<Fmt>
          <<<blocks, kThreads, 0, s>>>(in, numel, group_size, q_out, scales_out, offsets_out);
    else
      dequant_reduce_requant_kernel<Fmt>
          <<<blocks, kThreads, 0, s>>>(in, numel, group_size, q_out, scales_out, offsets_out);
    return launched("dequant_reduce_requant");
  });
}

}  // extern "C"

// ---------------------------------------------------------------- gradient compression codes
// The 1-bit and ternary codes and DGC's block norms of zero/compression (pack_math.h; the spec
// is kernels/compression_reference.py): one CUDA block per code block (its pairwise sum or max in
// shared memory, in the spec's order), grid-stride over elements for the decoded sums.

#include "pack_math.h"

namespace {

// The block's pairwise sum of term(xb[i]) in the spec's order, left in sums[0] (sums: `block`
// floats of shared memory; every thread of the CUDA block calls it).
template <class Term>
__device__ void pairwise_sum(const float* xb, int64_t block, float* sums, Term term) {
  for (int64_t i = threadIdx.x; i < block; i += blockDim.x) sums[i] = term(xb[i]);
  __syncthreads();
  for (int64_t h = block / 2; h >= 1; h /= 2) {
    for (int64_t i = threadIdx.x; i < h; i += blockDim.x) sums[i] = sums[i] + sums[i + h];
    __syncthreads();
  }
}

struct Magnitude {
  __device__ float operator()(float x) const { return cmq::magnitude(x); }
};

struct Square {
  __device__ float operator()(float x) const { return cmq::square(x); }
};

__global__ void onebit_compress_kernel(const float* x, int64_t blocks, int64_t block,
                                       uint8_t* codes, float* scales, float* residual) {
  extern __shared__ float sums[];
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const float* xb = x + b * block;
    pairwise_sum(xb, block, sums, Magnitude{});
    const float scale = sums[0] / static_cast<float>(block);
    if (threadIdx.x == 0) scales[b] = scale;
    for (int64_t j = threadIdx.x; j < block / 8; j += blockDim.x) {
      uint32_t byte = 0;
      for (int k = 0; k < 8; ++k) byte |= static_cast<uint32_t>(xb[8 * j + k] < 0.0f) << k;
      codes[b * block / 8 + j] = static_cast<uint8_t>(byte);
    }
    __syncthreads();  // every code is read from x before the residual may overwrite it
    if (residual != nullptr)
      for (int64_t i = threadIdx.x; i < block; i += blockDim.x)
        residual[b * block + i] = xb[i] - cmq::onebit_value(xb[i] < 0.0f, scale);
    __syncthreads();  // sums[0] is read by all before the next block refills it
  }
}

__global__ void block_sq_norms_kernel(const float* x, int64_t blocks, int64_t block, float* norms) {
  extern __shared__ float sums[];
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    pairwise_sum(x + b * block, block, sums, Square{});
    if (threadIdx.x == 0) norms[b] = sums[0];
    __syncthreads();  // sums[0] is read before the next block refills it
  }
}

__global__ void ternary_compress_kernel(const float* x, int64_t blocks, int64_t block,
                                        uint32_t salt, uint8_t* codes, float* scales) {
  __shared__ float maxima[kThreads];
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t first = b * block;
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < block; i += blockDim.x) m = cmq::nan_max(m, cmq::magnitude(x[first + i]));
    maxima[threadIdx.x] = m;
    __syncthreads();
    for (int h = kThreads / 2; h >= 1; h /= 2) {
      if (threadIdx.x < h) maxima[threadIdx.x] = cmq::nan_max(maxima[threadIdx.x], maxima[threadIdx.x + h]);
      __syncthreads();
    }
    const float scale = maxima[0];
    if (threadIdx.x == 0) scales[b] = scale;
    for (int64_t j = first / 4 + threadIdx.x; j < (first + block) / 4; j += blockDim.x) {
      uint32_t byte = 0;
      for (int k = 0; k < 4; ++k) {
        const int64_t i = 4 * j + k;
        byte |= cmq::ternary_code(x[i], cmq::uniform_of(salt, i), scale) << (2 * k);
      }
      codes[j] = static_cast<uint8_t>(byte);
    }
    __syncthreads();
  }
}

struct CodePtrs {
  const uint8_t* codes[kMaxInputs];
  const float* scales[kMaxInputs];
  int count;
};

template <class Out>
__global__ void decompress_sum_kernel(CodePtrs in, int64_t numel, int64_t block, int ternary,
                                      typename Out::Raw* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    float acc = 0.0f;
    for (int k = 0; k < in.count; ++k) {
      const float scale = in.scales[k][i / block];
      const float v = ternary ? cmq::ternary_value(cmq::ternary_field(in.codes[k], i), scale)
                              : cmq::onebit_value(cmq::onebit_field(in.codes[k], i), scale);
      acc = k == 0 ? v : acc + v;
    }
    out[i] = Out::store(acc);
  }
}

}  // namespace

extern "C" {

int cmq_cuda_onebit_compress(const float* x, int64_t numel, int64_t block, uint8_t* codes,
                             float* scales, float* residual, void* stream) {
  if (!cmq::valid_code_layout(numel, block)) return fail(cmq::kBadArgument, "onebit_compress", "layout");
  if (numel == 0) return cmq::kOk;
  const int64_t blocks = numel / block;
  onebit_compress_kernel<<<blocks_for(blocks), kThreads, block * sizeof(float),
                           static_cast<cudaStream_t>(stream)>>>(x, blocks, block, codes, scales,
                                                                residual);
  return launched("onebit_compress");
}

int cmq_cuda_block_sq_norms(const float* x, int64_t numel, int64_t block, float* norms,
                            void* stream) {
  if (!cmq::valid_code_layout(numel, block)) return fail(cmq::kBadArgument, "block_sq_norms", "layout");
  if (numel == 0) return cmq::kOk;
  const int64_t blocks = numel / block;
  block_sq_norms_kernel<<<blocks_for(blocks), kThreads, block * sizeof(float),
                          static_cast<cudaStream_t>(stream)>>>(x, blocks, block, norms);
  return launched("block_sq_norms");
}

int cmq_cuda_ternary_compress(const float* x, int64_t numel, int64_t block, int64_t seed,
                              uint8_t* codes, float* scales, void* stream) {
  if (!cmq::valid_code_layout(numel, block) || seed < 0)
    return fail(cmq::kBadArgument, "ternary_compress", "layout or seed");
  if (numel == 0) return cmq::kOk;
  const int64_t blocks = numel / block;
  ternary_compress_kernel<<<blocks_for(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, blocks, block, cmq::mix32(static_cast<uint32_t>(seed)), codes, scales);
  return launched("ternary_compress");
}

int cmq_cuda_decompress_sum(const uint8_t* const* codes, const float* const* scales, int count,
                            int64_t numel, int64_t block, int ternary, void* out, int out_dtype,
                            void* stream) {
  if (!cmq::valid_code_layout(numel, block) || count < 1 || count > kMaxInputs)
    return fail(cmq::kBadArgument, "decompress_sum", "layout or count");
  if (numel == 0) return cmq::kOk;
  CodePtrs in;
  for (int k = 0; k < count; ++k) {
    in.codes[k] = codes[k];
    in.scales[k] = scales[k];
  }
  in.count = count;
  return cmq::with_dtype(out_dtype, [&](auto o) {
    using Out = decltype(o);
    decompress_sum_kernel<Out>
        <<<blocks_for(ceil_div(numel, kThreads)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            in, numel, block, ternary, static_cast<typename Out::Raw*>(out));
    return launched("decompress_sum");
  });
}

}  // extern "C"
