// CUDA kernels of the null-space projection (docs/methods.md §2). Launches run per group of at most
// kListMax tensors of one dtype pair (tensor_list.cuh: metadata passed by value, dtypes
// dispatched on the host, no allocation or copy of metadata, safe under CUDA-graph capture).
// One block per (tensor, kProjChunk-element chunk) work item; thread x owns the elements
// (it * kThreads + x) * V + [0, V) of its chunk, it < kIters, read as one V-element access when
// the tensors are aligned (V = 4) and one by one otherwise (V = 1):
//  coeffs: the thread keeps its grad elements in registers and accumulates the dot products with
//          kRows basis rows at a time; block sums go to float32 partials [chunks, k] (chunks
//          numbered over the whole list), then a fixed-order float64 reduction per basis row
//          (no atomics);
//  apply:  the thread accumulates Σ_j c_j·Q[j, e] for its elements in registers, kRows
//          coefficients at a time (held in registers: no shared memory, so no limit on k), and
//          subtracts it from g in place;
//  conflict correction: chunk partials of (<a,b>, |b|², |a|²) → float64 stats on the device →
//          an update kernel that reads the stats and decides the branch on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common.cuh"
#include "tensor_list.cuh"
#include "../null_space.h"

namespace adept_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 8;  // basis rows (coefficients) per register tile
constexpr int kVec = 4;   // elements per access on the aligned path
// Aligned path: 16-byte aligned base pointers and numel a multiple of 8, so that every basis row
// (at j * numel) of a 2-byte type also starts 16-byte aligned.
constexpr int64_t kAlignNumel = 8;

// The elements [s, s + n) of tensor t of block blockIdx.x.
struct Span {
  int t;
  int64_t chunk, s, n;
  __device__ explicit Span(const ListMeta& meta) {
    t = meta.owner(blockIdx.x);
    chunk = meta.chunk0[t] + (blockIdx.x - meta.block0[t]);
    s = (blockIdx.x - meta.block0[t]) * kProjChunk;
    n = min(kProjChunk, meta.numel[t] - s);
  }
};

// Loads x[e, e + V) as float (one access of V elements).
template <int V, typename T>
__device__ __forceinline__ void load_vec(const T* x, int64_t e, float (&out)[V]) {
  const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(x + e);
#pragma unroll
  for (int v = 0; v < V; ++v) out[v] = to_float(p.v[v]);
}

template <int V, typename T>
__device__ __forceinline__ void store_vec(T* x, int64_t e, const float (&in)[V]) {
  Pack<T, V> p;
#pragma unroll
  for (int v = 0; v < V; ++v) p.v[v] = from_float<T>(in[v]);
  *reinterpret_cast<Pack<T, V>*>(x + e) = p;
}

// Runs body.template operator()<V>() with V = kVec for an aligned tensor and V = 1 otherwise.
template <typename Body>
__device__ __forceinline__ void with_width(bool aligned, Body body) {
  if (aligned) body(std::integral_constant<int, kVec>{});
  else body(std::integral_constant<int, 1>{});
}

template <int V>
constexpr int iters() { return static_cast<int>(kProjChunk / (kThreads * V)); }
static_assert(kProjChunk % (kThreads * kVec) == 0, "a chunk must be whole vectors of every thread");

// Offset of the thread's it-th group of V elements in its chunk.
template <int V>
__device__ __forceinline__ int64_t elem(int it) { return (static_cast<int64_t>(it) * kThreads + threadIdx.x) * V; }

// Calls fn(it, e, x) for each group `it` of V elements that the thread owns in its chunk, at offset
// e < n of the chunk, with x = p[e, e + V) as float (the loop is unrolled: `it` is a constant).
template <int V, typename T, typename Fn>
__device__ __forceinline__ void for_each_group(const T* p, int64_t n, Fn fn) {
#pragma unroll
  for (int it = 0; it < iters<V>(); ++it) {
    const int64_t e = elem<V>(it);
    if (e >= n) break;
    float x[V];
    load_vec<V>(p, e, x);
    fn(it, e, x);
  }
}

// a = the basis, b = the grads.
template <typename TQ, typename TG>
__global__ void __launch_bounds__(kThreads) coeffs_partial_kernel(const __grid_constant__ ListMeta meta, int64_t k,
                                                                  float* __restrict__ partial) {
  const Span sp(meta);
  const auto* q = static_cast<const TQ*>(meta.a[sp.t]);
  const auto* g = static_cast<const TG*>(meta.b[sp.t]) + sp.s;
  const int64_t numel = meta.numel[sp.t];
  with_width(meta.aligned[sp.t] != 0, [&](auto width) {
    constexpr int V = decltype(width)::value;
    float gv[iters<V>()][V] = {};  // the thread's grad elements, read once for all basis rows
    for_each_group<V>(g, sp.n, [&](int it, int64_t, const float(&x)[V]) {
#pragma unroll
      for (int v = 0; v < V; ++v) gv[it][v] = x[v];
    });
    for (int64_t j0 = 0; j0 < k; j0 += kRows) {
      float acc[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        acc[r] = 0.f;
        if (j0 + r >= k) continue;
        for_each_group<V>(q + (j0 + r) * numel + sp.s, sp.n, [&](int it, int64_t, const float(&x)[V]) {
#pragma unroll
          for (int v = 0; v < V; ++v) acc[r] += x[v] * gv[it][v];
        });
      }
      block_sum_to(acc, partial + sp.chunk * k + j0, static_cast<int>(k - j0 < kRows ? k - j0 : kRows));
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

// a = the grads (written), b = the basis.
template <typename TG, typename TQ>
__global__ void __launch_bounds__(kThreads) apply_kernel(const __grid_constant__ ListMeta meta, int64_t k,
                                                         const double* __restrict__ coeffs) {
  const Span sp(meta);
  auto* g = const_cast<TG*>(static_cast<const TG*>(meta.a[sp.t])) + sp.s;
  const auto* q = static_cast<const TQ*>(meta.b[sp.t]);
  const int64_t numel = meta.numel[sp.t];
  with_width(meta.aligned[sp.t] != 0, [&](auto width) {
    constexpr int V = decltype(width)::value;
    float acc[iters<V>()][V] = {};  // Σ_j c_j·Q[j, e] for the thread's elements
    for (int64_t j0 = 0; j0 < k; j0 += kRows) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (j0 + r >= k) break;
        const float c = static_cast<float>(coeffs[j0 + r]);
        for_each_group<V>(q + (j0 + r) * numel + sp.s, sp.n, [&](int it, int64_t, const float(&x)[V]) {
#pragma unroll
          for (int v = 0; v < V; ++v) acc[it][v] += c * x[v];
        });
      }
    }
    for_each_group<V>(g, sp.n, [&](int it, int64_t e, const float(&x)[V]) {
      float out[V];
#pragma unroll
      for (int v = 0; v < V; ++v) out[v] = x[v] - acc[it][v];
      store_vec<V>(g, e, out);
    });
  });
}

// a = g_new, b = g_pre.
template <typename TA, typename TB>
__global__ void __launch_bounds__(kThreads) conflict_partial_kernel(const __grid_constant__ ListMeta meta,
                                                                    float* __restrict__ partial) {
  const Span sp(meta);
  const auto* a = static_cast<const TA*>(meta.a[sp.t]) + sp.s;
  const auto* b = static_cast<const TB*>(meta.b[sp.t]) + sp.s;
  float acc[3] = {0.f, 0.f, 0.f};  // <a, b>, |b|², |a|²
  with_width(meta.aligned[sp.t] != 0, [&](auto width) {
    constexpr int V = decltype(width)::value;
    for_each_group<V>(a, sp.n, [&](int, int64_t e, const float(&x)[V]) {
      float y[V];
      load_vec<V>(b, e, y);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        acc[0] += x[v] * y[v];
        acc[1] += y[v] * y[v];
        acc[2] += x[v] * x[v];
      }
    });
  });
  block_sum_to(acc, partial + 3 * sp.chunk, 3);
}

__global__ void finish_stats_kernel(double* stats, double eps) {
  stats[3] = conflict_coefficient(stats[0], stats[1], stats[2], eps);
}

template <typename TA, typename TB>
__global__ void __launch_bounds__(kThreads) conflict_update_kernel(const __grid_constant__ ListMeta meta,
                                                                   const double* __restrict__ stats, double lam) {
  const float scale = static_cast<float>(lam - stats[3]);
  const Span sp(meta);
  auto* a = const_cast<TA*>(static_cast<const TA*>(meta.a[sp.t])) + sp.s;
  const auto* b = static_cast<const TB*>(meta.b[sp.t]) + sp.s;
  with_width(meta.aligned[sp.t] != 0, [&](auto width) {
    constexpr int V = decltype(width)::value;
    for_each_group<V>(a, sp.n, [&](int, int64_t e, const float(&x)[V]) {
      float y[V];
      load_vec<V>(b, e, y);
#pragma unroll
      for (int v = 0; v < V; ++v) y[v] = x[v] + scale * y[v];
      store_vec<V>(a, e, y);
    });
  });
}

std::vector<int64_t> numels_checked(at::TensorList ts, const char* what) {
  std::vector<int64_t> n;
  n.reserve(ts.size());
  for (const auto& t : ts) {
    TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (updated in place)");
    n.push_back(t.numel());
  }
  return n;
}

#define ADEPT_TYPES_OF(a_tag, b_tag)                   \
  using TA = std::remove_pointer_t<decltype(a_tag)>; \
  using TB = std::remove_pointer_t<decltype(b_tag)>

at::Tensor null_space_coeffs_cuda(at::TensorList basis, at::TensorList grads) {
  const int64_t k = check_basis_args(basis, grads);
  TORCH_CHECK(k < (int64_t{1} << 31),
              "null_space_coeffs: k must be below 2^31 on CUDA (one block per basis row)");
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto q = contiguous_list(basis), g = contiguous_list(grads);
  const auto numels = numels_of(g);
  const int64_t chunks = chunk_offsets(numels, kProjChunk).back();
  auto out = at::zeros({k}, g[0].options().dtype(at::kDouble));
  if (k == 0 || chunks == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto partial = at::empty({chunks, k}, g[0].options().dtype(at::kFloat));
  for_each_launch(q, g, numels, kProjChunk, kAlignNumel, [&](const ListMeta& meta, int64_t blocks, auto* q_tag,
                                                               auto* g_tag) {
    ADEPT_TYPES_OF(q_tag, g_tag);
    if (blocks == 0) return;
    coeffs_partial_kernel<TA, TB><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(meta, k,
                                                                                       partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  reduce_columns_kernel<<<static_cast<unsigned>(k), kThreads, 0, stream>>>(partial.const_data_ptr<float>(), chunks, k,
                                                                          out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void null_space_apply_cuda(at::TensorList basis, at::TensorList grads, const at::Tensor& coeffs) {
  const int64_t k = check_basis_args(basis, grads);
  check_coeffs(coeffs, k, grads[0].device());
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const auto numels = numels_checked(grads, "null_space_apply_: grads");
  if (k == 0) return;
  const auto q = contiguous_list(basis);
  const auto c = coeffs.contiguous();
  auto stream = c10::cuda::getCurrentCUDAStream();
  for_each_launch(std::vector<at::Tensor>(grads.begin(), grads.end()), q, numels, kProjChunk, kAlignNumel,
                  [&](const ListMeta& meta, int64_t blocks, auto* g_tag, auto* q_tag) {
                    ADEPT_TYPES_OF(g_tag, q_tag);
                    if (blocks == 0) return;
                    apply_kernel<TA, TB><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
                        meta, k, c.const_data_ptr<double>());
                    C10_CUDA_KERNEL_LAUNCH_CHECK();
                  });
}

at::Tensor conflict_correct_cuda(at::TensorList g_new, at::TensorList g_pre, double lam, double eps) {
  check_pair_lists(g_new, g_pre);
  const c10::cuda::CUDAGuard guard(g_new[0].device());
  const auto numels = numels_checked(g_new, "conflict_correct_: g_new");
  const std::vector<at::Tensor> a(g_new.begin(), g_new.end());
  const auto b = contiguous_list(g_pre);
  const int64_t chunks = chunk_offsets(numels, kProjChunk).back();
  auto stats = at::zeros({4}, g_new[0].options().dtype(at::kDouble));
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (chunks > 0) {
    auto partial = at::empty({chunks, 3}, g_new[0].options().dtype(at::kFloat));
    for_each_launch(a, b, numels, kProjChunk, kAlignNumel, [&](const ListMeta& meta, int64_t blocks, auto* a_tag,
                                                               auto* b_tag) {
      ADEPT_TYPES_OF(a_tag, b_tag);
      if (blocks == 0) return;
      conflict_partial_kernel<TA, TB><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          meta, partial.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    reduce_columns_kernel<<<3, kThreads, 0, stream>>>(partial.const_data_ptr<float>(), chunks, 3,
                                                      stats.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  finish_stats_kernel<<<1, 1, 0, stream>>>(stats.data_ptr<double>(), eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (chunks > 0) {
    for_each_launch(a, b, numels, kProjChunk, kAlignNumel, [&](const ListMeta& meta, int64_t blocks, auto* a_tag,
                                                               auto* b_tag) {
      ADEPT_TYPES_OF(a_tag, b_tag);
      if (blocks == 0) return;
      conflict_update_kernel<TA, TB><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          meta, stats.const_data_ptr<double>(), lam);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return stats;
}

#undef ADEPT_TYPES_OF

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CUDA, m) {
  m.impl("null_space_coeffs", &null_space_coeffs_cuda);
  m.impl("null_space_apply_", &null_space_apply_cuda);
  m.impl("conflict_correct_", &conflict_correct_cuda);
}

}  // namespace adept_ext
