// Device helpers shared by the CUDA kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace adept_ext {

constexpr int kWarp = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

}  // namespace adept_ext
