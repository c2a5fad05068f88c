// CUDA kernels of the null-space projection (SPEC §2), one launch per pass over all tensors:
//  coeffs: one block per (tensor, chunk) work item; warp w computes the chunk's dot products
//          with basis rows w, w+8, ...; float32 partials [chunks, k], then a fixed-order float64
//          reduction per basis row (no atomics);
//  apply:  one block per work item; each thread accumulates Σ_j c_j·Q[j, e] for its elements
//          and subtracts it from g in place;
//  conflict correction: chunk partials of (<a,b>, |b|², |a|²) → float64 stats on the device →
//          an update kernel that reads the stats and decides the branch on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common.cuh"
#include "../null_space.h"

namespace adept_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;

// Per-tensor metadata in one int64 buffer: [ptr_a x n | ptr_b x n | numel x n | code x n | first x (n+1)],
// code = dtype(a) | dtype(b) << 4.
struct Meta {
  const int64_t* base;
  int64_t n;
  __device__ const void* a(int64_t i) const { return reinterpret_cast<const void*>(base[i]); }
  __device__ const void* b(int64_t i) const { return reinterpret_cast<const void*>(base[n + i]); }
  __device__ int64_t numel(int64_t i) const { return base[2 * n + i]; }
  __device__ int64_t code(int64_t i) const { return base[3 * n + i]; }
  __device__ int64_t first(int64_t i) const { return base[4 * n + i]; }
  // The tensor owning chunk c (tensors without elements own no chunk).
  __device__ int64_t owner(int64_t c) const {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (first(mid) <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
};

struct Launch {
  at::Tensor meta_dev;
  Meta meta;
  int64_t chunks;
};

Launch make_meta(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::vector<int64_t>& numels) {
  const int64_t n = static_cast<int64_t>(a.size());
  const auto first = chunk_offsets(numels, kProjChunk);
  auto host = at::empty({5 * n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    h[i] = reinterpret_cast<int64_t>(a[i].const_data_ptr());
    h[n + i] = reinterpret_cast<int64_t>(b[i].const_data_ptr());
    h[2 * n + i] = numels[i];
    h[3 * n + i] = dtype_code(a[i].scalar_type()) | (dtype_code(b[i].scalar_type()) << 4);
  }
  std::copy(first.begin(), first.end(), h + 4 * n);
  Launch l;
  l.meta_dev = host.to(a[0].device(), /*non_blocking=*/true);  // host memory kept alive by the caching allocator
  l.meta = Meta{l.meta_dev.const_data_ptr<int64_t>(), n};
  l.chunks = first.back();
  TORCH_CHECK(l.chunks < (int64_t{1} << 31), "null_space: too many chunks for one launch");
  return l;
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// Calls fn(a_ptr, b_ptr) with the element types of code (a | b << 4).
template <typename Fn>
__device__ void dispatch_code(int64_t code, const void* a, const void* b, Fn fn) {
  auto with_b = [&](auto* ta) {
    switch ((code >> 4) & 0xf) {
      case kF32: fn(ta, static_cast<const float*>(b)); break;
      case kBF16: fn(ta, static_cast<const __nv_bfloat16*>(b)); break;
      default: fn(ta, static_cast<const __half*>(b)); break;
    }
  };
  switch (code & 0xf) {
    case kF32: with_b(static_cast<const float*>(a)); break;
    case kBF16: with_b(static_cast<const __nv_bfloat16*>(a)); break;
    default: with_b(static_cast<const __half*>(a)); break;
  }
}

__global__ void __launch_bounds__(kThreads) coeffs_partial_kernel(Meta meta, int64_t k, float* __restrict__ partial) {
  const int64_t c = blockIdx.x, i = meta.owner(c), numel = meta.numel(i);
  const int64_t s = (c - meta.first(i)) * kProjChunk, n = min(kProjChunk, numel - s);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  dispatch_code(meta.code(i), meta.a(i), meta.b(i), [&](const auto* q, const auto* g) {
    for (int64_t j = warp; j < k; j += kWarps) {
      const auto* row = q + j * numel + s;
      float acc = 0.f;
      for (int64_t e = lane; e < n; e += kWarp) acc += to_float(row[e]) * to_float(g[s + e]);
      for (int off = kWarp / 2; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
      if (lane == 0) partial[c * k + j] = acc;
    }
  });
}

// out[j] = Σ_c partial[c, j] in float64, fixed order; one block per j (also used with k = 3 for the stats).
__global__ void __launch_bounds__(kThreads) reduce_columns_kernel(const float* __restrict__ partial, int64_t chunks,
                                                                  int64_t k, double* __restrict__ out) {
  const int64_t j = blockIdx.x;
  double s = 0.0, unused = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) s += partial[c * k + j];
  block_sum2(s, unused);
  if (threadIdx.x == 0) out[j] = s;
}

__global__ void __launch_bounds__(kThreads) apply_kernel(Meta meta, int64_t k, const double* __restrict__ coeffs) {
  extern __shared__ float coef[];
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) coef[j] = static_cast<float>(coeffs[j]);
  __syncthreads();
  const int64_t c = blockIdx.x, i = meta.owner(c), numel = meta.numel(i);
  const int64_t s = (c - meta.first(i)) * kProjChunk, n = min(kProjChunk, numel - s);
  // a = the gradient (written), b = the basis.
  dispatch_code(meta.code(i), meta.a(i), meta.b(i), [&](const auto* g_const, const auto* q) {
    using TG = std::remove_const_t<std::remove_pointer_t<decltype(g_const)>>;
    TG* g = const_cast<TG*>(g_const);
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) acc += coef[j] * to_float(q[j * numel + s + e]);
      g[s + e] = from_float<TG>(to_float(g[s + e]) - acc);
    }
  });
}

__global__ void __launch_bounds__(kThreads) conflict_partial_kernel(Meta meta, float* __restrict__ partial) {
  const int64_t c = blockIdx.x, i = meta.owner(c);
  const int64_t s = (c - meta.first(i)) * kProjChunk, n = min(kProjChunk, meta.numel(i) - s);
  float ab = 0.f, bb = 0.f, aa = 0.f;
  dispatch_code(meta.code(i), meta.a(i), meta.b(i), [&](const auto* a, const auto* b) {
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
      const float x = to_float(a[s + e]), y = to_float(b[s + e]);
      ab += x * y;
      bb += y * y;
      aa += x * x;
    }
  });
  block_sum2(ab, bb);
  __syncthreads();
  float unused = 0.f;
  block_sum2(aa, unused);
  if (threadIdx.x == 0) {
    partial[3 * c] = ab;
    partial[3 * c + 1] = bb;
    partial[3 * c + 2] = aa;
  }
}

__global__ void finish_stats_kernel(double* stats, double eps) {
  stats[3] = conflict_coefficient(stats[0], stats[1], stats[2], eps);
}

__global__ void __launch_bounds__(kThreads) conflict_update_kernel(Meta meta, const double* __restrict__ stats, double lam) {
  const float scale = static_cast<float>(lam - stats[3]);
  const int64_t c = blockIdx.x, i = meta.owner(c);
  const int64_t s = (c - meta.first(i)) * kProjChunk, n = min(kProjChunk, meta.numel(i) - s);
  dispatch_code(meta.code(i), meta.a(i), meta.b(i), [&](const auto* a_const, const auto* b) {
    using TA = std::remove_const_t<std::remove_pointer_t<decltype(a_const)>>;
    TA* a = const_cast<TA*>(a_const);
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) a[s + e] = from_float<TA>(to_float(a[s + e]) + scale * to_float(b[s + e]));
  });
}

std::vector<int64_t> numels_checked(at::TensorList ts, const char* what) {
  std::vector<int64_t> n;
  for (const auto& t : ts) {
    TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (updated in place)");
    n.push_back(t.numel());
  }
  return n;
}

at::Tensor null_space_coeffs_cuda(at::TensorList basis, at::TensorList grads) {
  const int64_t k = check_basis_args(basis, grads);
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto q = contiguous_list(basis), g = contiguous_list(grads);
  const auto l = make_meta(q, g, numels_of(g));
  auto out = at::zeros({k}, g[0].options().dtype(at::kDouble));
  if (k == 0 || l.chunks == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto partial = at::empty({l.chunks, k}, g[0].options().dtype(at::kFloat));
  coeffs_partial_kernel<<<static_cast<unsigned>(l.chunks), kThreads, 0, stream>>>(l.meta, k, partial.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  reduce_columns_kernel<<<static_cast<unsigned>(k), kThreads, 0, stream>>>(partial.const_data_ptr<float>(), l.chunks, k,
                                                                          out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void null_space_apply_cuda(at::TensorList basis, at::TensorList grads, const at::Tensor& coeffs) {
  const int64_t k = check_basis_args(basis, grads);
  check_coeffs(coeffs, k, grads[0].device());
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto numels = numels_checked(grads, "null_space_apply_: grads");
  const auto q = contiguous_list(basis);
  const auto l = make_meta(std::vector<at::Tensor>(grads.begin(), grads.end()), q, numels);
  if (k == 0 || l.chunks == 0) return;
  const auto c = coeffs.contiguous();
  apply_kernel<<<static_cast<unsigned>(l.chunks), kThreads, k * sizeof(float), c10::cuda::getCurrentCUDAStream()>>>(
      l.meta, k, c.const_data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor conflict_correct_cuda(at::TensorList g_new, at::TensorList g_pre, double lam, double eps) {
  check_pair_lists(g_new, g_pre);
  const c10::cuda::CUDAGuard guard(g_new[0].device());
  const auto numels = numels_checked(g_new, "conflict_correct_: g_new");
  const auto pre = contiguous_list(g_pre);
  const auto l = make_meta(std::vector<at::Tensor>(g_new.begin(), g_new.end()), pre, numels);
  auto stats = at::zeros({4}, g_new[0].options().dtype(at::kDouble));
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (l.chunks > 0) {
    auto partial = at::empty({l.chunks, 3}, g_new[0].options().dtype(at::kFloat));
    conflict_partial_kernel<<<static_cast<unsigned>(l.chunks), kThreads, 0, stream>>>(l.meta, partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    reduce_columns_kernel<<<3, kThreads, 0, stream>>>(partial.const_data_ptr<float>(), l.chunks, 3, stats.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  finish_stats_kernel<<<1, 1, 0, stream>>>(stats.data_ptr<double>(), eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (l.chunks > 0) {
    conflict_update_kernel<<<static_cast<unsigned>(l.chunks), kThreads, 0, stream>>>(l.meta, stats.const_data_ptr<double>(), lam);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return stats;
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CUDA, m) {
  m.impl("null_space_coeffs", &null_space_coeffs_cuda);
  m.impl("null_space_apply_", &null_space_apply_cuda);
  m.impl("conflict_correct_", &conflict_correct_cuda);
}

}  // namespace adept_ext
