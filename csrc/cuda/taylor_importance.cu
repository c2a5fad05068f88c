// CUDA kernel of taylor_importance, multi-tensor-apply style (cf. apex / _foreach_norm), per
// launch group of at most kListMax tensors of one dtype pair (tensor_list.cuh; metadata passed
// by value, dtypes dispatched on the host, so a call is safe under CUDA-graph capture):
// launch 1: one block per (tensor, chunk) work item, vectorised loads, block-reduced float32
//           partials per chunk (no atomics), stored by the chunk's index in the whole list;
// launch 2: one block per tensor, fixed-order double reduction of its chunk partials.
// Any number of tensors of any sizes (64-bit element indexing); the result does not depend on
// the grouping.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.cuh"
#include "tensor_list.cuh"
#include "../taylor_importance.h"

namespace adept_ext {
namespace {

constexpr int kChunkThreads = 512;
constexpr int kFinalThreads = 256;

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
    // Unrolled so that each thread has several 16-byte loads in flight (the adds keep their order).
#pragma unroll 4
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

// One block per (tensor, chunk) of one dtype pair; the float32 partial sums of chunk c of the
// whole list go to partial[c].
template <typename TP, typename TG>
__global__ void __launch_bounds__(kChunkThreads) chunk_partials_kernel(const __grid_constant__ ListMeta meta,
                                                                       float2* __restrict__ partial) {
  const int t = meta.owner(blockIdx.x);
  const int64_t chunk = blockIdx.x - meta.block0[t];
  const int64_t start = chunk * kTaylorChunk;
  const int64_t len = min(kTaylorChunk, meta.numel[t] - start);
  float dot = 0.f, abs = 0.f;
  accumulate_chunk(static_cast<const TP*>(meta.a[t]) + start, static_cast<const TG*>(meta.b[t]) + start, len,
                   meta.aligned[t] != 0, dot, abs);
  block_sum2(dot, abs);
  if (threadIdx.x == 0) partial[meta.chunk0[t] + chunk] = make_float2(dot, abs);
}

// One block per tensor of the launch: fixed-order double reduction of its chunk partials into
// its row of out.
__global__ void __launch_bounds__(kFinalThreads)
    tensor_sums_kernel(const __grid_constant__ ListMeta meta, const float2* __restrict__ partial,
                       float* __restrict__ out, bool accumulate) {
  const int t = blockIdx.x;
  const int64_t first = meta.chunk0[t], last = first + (meta.numel[t] + kTaylorChunk - 1) / kTaylorChunk;
  double dot = 0.0, abs = 0.0;
  for (int64_t c = first + threadIdx.x; c < last; c += blockDim.x) {
    dot += partial[c].x;
    abs += partial[c].y;
  }
  block_sum2(dot, abs);
  if (threadIdx.x == 0) {
    const int64_t i = meta.row[t];
    out[2 * i] = (accumulate ? out[2 * i] : 0.f) + static_cast<float>(dot);
    out[2 * i + 1] = (accumulate ? out[2 * i + 1] : 0.f) + static_cast<float>(abs);
  }
}

void taylor_importance_out_cuda(at::TensorList params_in, at::TensorList grads_in, const at::Tensor& out,
                                bool accumulate) {
  check_taylor_args(params_in, grads_in, out);
  if (params_in.empty()) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const auto params = contiguous_list(params_in);
  const auto grads = contiguous_list(grads_in);
  const auto numels = numels_of(params);
  const auto chunks = chunk_offsets(numels, kTaylorChunk).back();
  auto partial = at::empty({std::max<int64_t>(chunks, 1), 2}, out.options());
  auto* partial2 = reinterpret_cast<float2*>(partial.data_ptr<float>());
  auto stream = c10::cuda::getCurrentCUDAStream();
  for_each_launch(params, grads, numels, kTaylorChunk, 1, [&](const ListMeta& meta, int64_t blocks, auto* p_tag,
                                                              auto* g_tag) {
    using TP = std::remove_pointer_t<decltype(p_tag)>;
    using TG = std::remove_pointer_t<decltype(g_tag)>;
    if (blocks > 0) {
      chunk_partials_kernel<TP, TG><<<static_cast<unsigned>(blocks), kChunkThreads, 0, stream>>>(meta, partial2);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    tensor_sums_kernel<<<static_cast<unsigned>(meta.n), kFinalThreads, 0, stream>>>(meta, partial2,
                                                                                   out.data_ptr<float>(), accumulate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
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
