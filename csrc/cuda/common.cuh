// Device helpers shared by the CUDA kernels.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace adept_ext {

constexpr int kWarp = 32;

// Element types of the multi-tensor kernels, passed to the device in per-tensor metadata.
enum DtypeCode : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "adept_ext: unsupported dtype ", t);
  }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Deterministic block-wide reduction of a pair (a, b) with combine(a, b, a2, b2), which merges
// (a2, b2) into (a, b): a fixed shuffle tree inside each warp, then the warps in a fixed order.
// (ia, ib) is the identity of combine. The result is valid in thread 0. blockDim.x must be a
// multiple of 32.
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
}

// Block-wide sums of two values (see block_reduce_pair).
template <typename T>
__device__ void block_sum2(T& a, T& b) {
  block_reduce_pair(a, b, T(0), T(0), [](T& x, T& y, T x2, T y2) {
    x += x2;
    y += y2;
  });
}

}  // namespace adept_ext
