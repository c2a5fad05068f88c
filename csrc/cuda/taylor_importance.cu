// CUDA kernel of taylor_importance, multi-tensor-apply style (cf. apex / _foreach_norm):
// launch 1: one block per (tensor, chunk) work item, vectorised loads, block-reduced float32
//           partials per chunk (no atomics);
// launch 2: one block per tensor, fixed-order double reduction of its chunk partials.
// Both launches cover any number of tensors of any sizes (64-bit element indexing).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include "common.cuh"
#include "../taylor_importance.h"

namespace adept_ext {
namespace {

constexpr int kChunkThreads = 512;
constexpr int kFinalThreads = 256;

// Metadata of n tensors in one int64 buffer (one host-to-device copy per call):
// [ptr_p x n | ptr_g x n | numel x n | code x n | first_chunk x (n+1)],
// code = dtype(p) | dtype(g) << 4 | both-16-byte-aligned << 8.
struct Meta {
  const int64_t* base;
  int64_t n;
  __device__ const void* param(int64_t i) const { return reinterpret_cast<const void*>(base[i]); }
  __device__ const void* grad(int64_t i) const { return reinterpret_cast<const void*>(base[n + i]); }
  __device__ int64_t numel(int64_t i) const { return base[2 * n + i]; }
  __device__ int64_t code(int64_t i) const { return base[3 * n + i]; }
  __device__ int64_t first_chunk(int64_t i) const { return base[4 * n + i]; }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename TP, typename TG>
__device__ void accumulate_chunk(const TP* p, const TG* g, int64_t len, bool aligned, float& dot,
                                 float& abs) {
  // 16-byte loads of the wider of the two types; the narrower one loads as many elements.
  constexpr int N = 16 / (sizeof(TP) > sizeof(TG) ? sizeof(TP) : sizeof(TG));
  int64_t done = 0;
  if (aligned) {
    const int64_t packs = len / N;
    const auto* pp = reinterpret_cast<const Pack<TP, N>*>(p);
    const auto* gp = reinterpret_cast<const Pack<TG, N>*>(g);
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x) {
      const Pack<TP, N> a = pp[k];
      const Pack<TG, N> b = gp[k];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float x = to_float(a.v[e]) * to_float(b.v[e]);
        dot += x;
        abs += fabsf(x);
      }
    }
    done = packs * N;
  }
  for (int64_t j = done + threadIdx.x; j < len; j += blockDim.x) {
    const float x = to_float(p[j]) * to_float(g[j]);
    dot += x;
    abs += fabsf(x);
  }
}

template <typename TP>
__device__ void dispatch_grad(int64_t gcode, const TP* p, const void* g, int64_t len, bool aligned,
                              float& dot, float& abs) {
  switch (gcode) {
    case kF32: accumulate_chunk(p, static_cast<const float*>(g), len, aligned, dot, abs); break;
    case kBF16: accumulate_chunk(p, static_cast<const __nv_bfloat16*>(g), len, aligned, dot, abs); break;
    default: accumulate_chunk(p, static_cast<const __half*>(g), len, aligned, dot, abs); break;
  }
}

__global__ void __launch_bounds__(kChunkThreads)
    chunk_partials_kernel(Meta meta, float2* __restrict__ partial) {
  const int64_t chunk = blockIdx.x;
  // The tensor owning this chunk: last i with first_chunk(i) <= chunk (tensors with no
  // elements own no chunk and are skipped by taking the last such i).
  int64_t lo = 0, hi = meta.n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (meta.first_chunk(mid) <= chunk) lo = mid; else hi = mid - 1;
  }
  const int64_t i = lo;
  const int64_t start = (chunk - meta.first_chunk(i)) * kTaylorChunk;
  const int64_t len = min(kTaylorChunk, meta.numel(i) - start);
  const int64_t code = meta.code(i);
  const int64_t pcode = code & 0xf, gcode = (code >> 4) & 0xf;
  const bool aligned = (code >> 8) & 1;
  float dot = 0.f, abs = 0.f;
  switch (pcode) {
    case kF32:
      dispatch_grad(gcode, static_cast<const float*>(meta.param(i)) + start,
                    static_cast<const char*>(meta.grad(i)) + start * (gcode == kF32 ? 4 : 2), len,
                    aligned, dot, abs);
      break;
    case kBF16:
      dispatch_grad(gcode, static_cast<const __nv_bfloat16*>(meta.param(i)) + start,
                    static_cast<const char*>(meta.grad(i)) + start * (gcode == kF32 ? 4 : 2), len,
                    aligned, dot, abs);
      break;
    default:
      dispatch_grad(gcode, static_cast<const __half*>(meta.param(i)) + start,
                    static_cast<const char*>(meta.grad(i)) + start * (gcode == kF32 ? 4 : 2), len,
                    aligned, dot, abs);
      break;
  }
  block_sum2(dot, abs);
  if (threadIdx.x == 0) partial[chunk] = make_float2(dot, abs);
}

__global__ void __launch_bounds__(kFinalThreads)
    tensor_sums_kernel(Meta meta, const float2* __restrict__ partial, float* __restrict__ out,
                       bool accumulate) {
  const int64_t i = blockIdx.x;
  const int64_t first = meta.first_chunk(i), last = meta.first_chunk(i + 1);
  double dot = 0.0, abs = 0.0;
  for (int64_t c = first + threadIdx.x; c < last; c += blockDim.x) {
    dot += partial[c].x;
    abs += partial[c].y;
  }
  block_sum2(dot, abs);
  if (threadIdx.x == 0) {
    out[2 * i] = (accumulate ? out[2 * i] : 0.f) + static_cast<float>(dot);
    out[2 * i + 1] = (accumulate ? out[2 * i + 1] : 0.f) + static_cast<float>(abs);
  }
}

void taylor_importance_out_cuda(at::TensorList params_in, at::TensorList grads_in, const at::Tensor& out,
                                bool accumulate) {
  check_taylor_args(params_in, grads_in, out);
  const int64_t n = static_cast<int64_t>(params_in.size());
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const auto params = contiguous_list(params_in);
  const auto grads = contiguous_list(grads_in);
  const auto first = chunk_offsets(numels_of(params), kTaylorChunk);
  const int64_t total = first[n];

  auto host = at::empty({5 * n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const auto pa = reinterpret_cast<uintptr_t>(params[i].const_data_ptr());
    const auto ga = reinterpret_cast<uintptr_t>(grads[i].const_data_ptr());
    h[i] = static_cast<int64_t>(pa);
    h[n + i] = static_cast<int64_t>(ga);
    h[2 * n + i] = params[i].numel();
    const int64_t aligned = (pa % 16 == 0 && ga % 16 == 0) ? 1 : 0;
    h[3 * n + i] = dtype_code(params[i].scalar_type()) | (dtype_code(grads[i].scalar_type()) << 4) |
                   (aligned << 8);
  }
  std::copy(first.begin(), first.end(), h + 4 * n);
  // The caching host allocator keeps `host` alive until this asynchronous copy has run.
  const auto dev = host.to(out.device(), /*non_blocking=*/true);
  const Meta meta{dev.const_data_ptr<int64_t>(), n};
  auto stream = c10::cuda::getCurrentCUDAStream();

  auto partial = at::empty({std::max<int64_t>(total, 1), 2}, out.options());
  auto* partial2 = reinterpret_cast<float2*>(partial.data_ptr<float>());
  if (total > 0) {
    TORCH_CHECK(total < (int64_t{1} << 31), "taylor_importance: too many chunks for one launch");
    chunk_partials_kernel<<<static_cast<unsigned>(total), kChunkThreads, 0, stream>>>(meta, partial2);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  tensor_sums_kernel<<<static_cast<unsigned>(n), kFinalThreads, 0, stream>>>(
      meta, partial2, out.data_ptr<float>(), accumulate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor taylor_importance_cuda(at::TensorList params, at::TensorList grads) {
  TORCH_CHECK(!params.empty(), "taylor_importance: empty tensor list");
  auto out = at::empty({static_cast<int64_t>(params.size()), 2}, params[0].options().dtype(at::kFloat));
  taylor_importance_out_cuda(params, grads, out, /*accumulate=*/false);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CUDA, m) {
  m.impl("taylor_importance", &taylor_importance_cuda);
  m.impl("taylor_importance_out", &taylor_importance_out_cuda);
}

}  // namespace adept_ext
