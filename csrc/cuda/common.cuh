// Device helpers shared by the CUDA kernels.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace adept_ext {

constexpr int kWarp = 32;

// Element conversions of the kernels; the multi-tensor kernels use ATen's element types
// (dispatched on the host by dispatch_pair), linear_cross_entropy CUDA's own.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(at::BFloat16 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(at::Half x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
// (torch's extension build defines __CUDA_NO_{HALF,BFLOAT16}_CONVERSIONS__: no implicit casts)
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// N elements loaded or stored as one access of N * sizeof(T) bytes (the pointer must be so aligned).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Deterministic block-wide reduction of a pair (a, b) with combine(a, b, a2, b2), which merges
// (a2, b2) into (a, b): a fixed shuffle tree inside each warp, then the warps in a fixed order.
// (ia, ib) is the identity of combine. The result is valid in thread 0. Every thread must call it;
// blockDim.x must be a multiple of 32.
template <typename T, typename Combine>
__device__ void block_reduce_pair(T& a, T& b, T ia, T ib, Combine combine) {
  __shared__ T sa[kWarp], sb[kWarp];
  for (int off = kWarp / 2; off > 0; off /= 2) {
    combine(a, b, __shfl_down_sync(0xffffffffu, a, off), __shfl_down_sync(0xffffffffu, b, off));
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / kWarp;
    a = lane < warps ? sa[lane] : ia;
    b = lane < warps ? sb[lane] : ib;
    for (int off = kWarp / 2; off > 0; off /= 2) {
      combine(a, b, __shfl_down_sync(0xffffffffu, a, off), __shfl_down_sync(0xffffffffu, b, off));
    }
  }
  __syncthreads();  // sa, sb may be reused by a later call
}

// Block-wide sums of two values (see block_reduce_pair).
template <typename T>
__device__ void block_sum2(T& a, T& b) {
  block_reduce_pair(a, b, T(0), T(0), [](T& x, T& y, T x2, T y2) {
    x += x2;
    y += y2;
  });
}

// Block-wide sums of J float32 values per thread, the first `count` written to out[0, count) (a
// fixed shuffle tree in each warp, then the warps in order: deterministic). Every thread must
// call it; out is written by threads 0..count-1. J <= blockDim.x and blockDim.x / 32 <= kWarp.
template <int J>
__device__ void block_sum_to(float (&v)[J], float* out, int count) {
  __shared__ float s[kWarp][J];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int r = 0; r < J; ++r) {
    for (int off = kWarp / 2; off > 0; off /= 2) v[r] += __shfl_down_sync(0xffffffffu, v[r], off);
    if (lane == 0) s[warp][r] = v[r];
  }
  __syncthreads();
  if (threadIdx.x < count) {
    float total = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarp); ++w) total += s[w][threadIdx.x];
    out[threadIdx.x] = total;
  }
  __syncthreads();  // s may be reused by the caller's next call
}

}  // namespace adept_ext
