// CUDA kernels of linear_cross_entropy. Forward: chunked GEMM (at::mm, cuBLAS), then one block per
// row computing an online (max, sum-of-exp) logsumexp over the vocabulary in float32 (16-byte loads,
// one exp per finite logit) with a deterministic block reduction, minus the target logit. Backward
// (grad_logits_): one block per row turns the logits into g·(exp(z − lse) − onehot(t)) in place,
// 16 bytes per load and store. Every row is read in 16-byte packs from its first 16-byte boundary,
// whatever V · sizeof(T) is (V = 32001, 50257, 151665 leave most rows unaligned): only the few
// logits before that boundary and after the last whole pack go one by one.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cmath>

#include "common.cuh"
#include "../linear_cross_entropy.h"

namespace adept_ext {
namespace {

constexpr int kThreads = 256;

// Online logsumexp state (m, s): m = the largest logit seen, s = Σ exp(x - m). The CPU twin
// (csrc/cpu/linear_cross_entropy.cpp) returns a NaN if any logit is NaN, else the max when it is
// infinite (all -inf: -inf; a +inf: +inf), else m + log(s). Here infinities are kept out of the
// arithmetic (inf - inf would be NaN) and a NaN sticks in s.

// Adds one logit x to the state.
__device__ __forceinline__ void add_logit(float& m, float& s, float x) {
  if (isnan(x)) {
    s = x;
  } else if (x > m) {  // x > -inf; exp(m - x) is 0 when m = -inf or x = +inf (and a NaN s stays NaN)
    s = s * expf(m - x) + 1.f;
    m = x;
  } else if (x != -INFINITY && m != INFINITY) {  // exp(-inf) adds 0; after a +inf nothing else counts
    s += expf(x - m);
  }
}

// Merges the state (m2, s2) into (m, s).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) {
    s += s2;  // 0, or NaN
  } else if (mx == INFINITY) {
    s = (isnan(s) || isnan(s2)) ? NAN : 1.f;
  } else {
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
  }
  m = mx;
}

__device__ __forceinline__ float logsumexp_of(float m, float s) {
  return isnan(s) ? s : (isinf(m) ? m : m + logf(s));
}

// Adds N logits to the state. When they are all finite and no +inf was seen, the state moves to
// their max once and each adds one exp (no per-logit branch); otherwise they go one by one.
template <int N>
__device__ __forceinline__ void add_logits(float& m, float& s, const float (&x)[N]) {
  float mx = x[0];
  bool finite = isfinite(x[0]);
#pragma unroll
  for (int e = 1; e < N; ++e) {
    mx = fmaxf(mx, x[e]);
    finite = finite && isfinite(x[e]);
  }
  if (finite && m != INFINITY) {  // m is -inf (nothing seen) or finite; a NaN s stays NaN
    if (mx > m) {
      s *= expf(m - mx);
      m = mx;
    }
#pragma unroll
    for (int e = 0; e < N; ++e) s += expf(x[e] - m);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) add_logit(m, s, x[e]);
  }
}

// A row of v elements split for 16-byte accesses: `packs` packs of N = 16 / sizeof(T) elements from
// element `head` (the row's first 16-byte boundary, head < N), and the elements outside them (the
// head, and the tail from head + packs·N) one by one. A row's address is a multiple of sizeof(T).
template <typename T>
struct RowSplit {
  static constexpr int N = 16 / sizeof(T);
  int64_t head, packs, tail;

  __device__ RowSplit(const T* row, int64_t v) {
    const auto misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % 16);
    head = misaligned == 0 ? 0 : min(v, (16 - misaligned) / static_cast<int64_t>(sizeof(T)));
    packs = (v - head) / N;
    tail = head + packs * N;
  }

  // The e-th element outside the packs (e < head + v - tail).
  __device__ __forceinline__ int64_t unpacked(int64_t e) const { return e < head ? e : tail + (e - head); }
  __device__ __forceinline__ int64_t unpacked_count(int64_t v) const { return head + v - tail; }
};

// One block per row: 16 bytes (N logits) per access, a few accesses in flight per thread (RowSplit).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    row_loss_kernel(const T* __restrict__ logits, const int64_t* __restrict__ targets, int64_t v,
                    int64_t ignore_index, float* __restrict__ loss, float* __restrict__ lse) {
  constexpr int N = RowSplit<T>::N;
  const int64_t r = blockIdx.x;
  const int64_t t = targets[r];
  if (t == ignore_index) {
    if (threadIdx.x == 0) loss[r] = lse[r] = 0.f;
    return;
  }
  CUDA_KERNEL_ASSERT(t >= 0 && t < v);
  const T* row = logits + r * v;
  const RowSplit<T> split(row, v);
  float m = -INFINITY, s = 0.f;
  const auto* packs = reinterpret_cast<const Pack<T, N>*>(row + split.head);
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < split.packs; k += blockDim.x) {
    const Pack<T, N> p = packs[k];
    float x[N];
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = to_float(p.v[e]);
    add_logits(m, s, x);
  }
  for (int64_t e = threadIdx.x; e < split.unpacked_count(v); e += blockDim.x) {
    add_logit(m, s, to_float(row[split.unpacked(e)]));
  }
  block_reduce_pair(m, s, -INFINITY, 0.f, [](float& m1, float& s1, float m2, float s2) { merge(m1, s1, m2, s2); });
  if (threadIdx.x == 0) {
    lse[r] = logsumexp_of(m, s);
    loss[r] = lse[r] - to_float(row[t]);
  }
}

template <typename T>
void launch_row_loss(const T* logits, int64_t rows, int64_t v, const int64_t* targets, int64_t ignore_index,
                     float* loss, float* lse, cudaStream_t stream) {
  row_loss_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, targets, v, ignore_index, loss,
                                                                       lse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void row_loss_cuda(const at::Tensor& logits_in, const at::Tensor& targets, int64_t ignore_index,
                   const at::Tensor& loss, const at::Tensor& lse_out) {
  const auto logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), v = logits.size(1);
  if (rows == 0) return;
  TORCH_CHECK(rows < (int64_t{1} << 31),
              "linear_cross_entropy: chunk_rows must be below 2^31 on CUDA (one block per row)");
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* t = targets.const_data_ptr<int64_t>();
  float* out = loss.data_ptr<float>();
  float* lse = lse_out.data_ptr<float>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      return launch_row_loss(logits.const_data_ptr<float>(), rows, v, t, ignore_index, out, lse, stream);
    case at::kBFloat16:
      return launch_row_loss(reinterpret_cast<const __nv_bfloat16*>(logits.const_data_ptr<at::BFloat16>()), rows, v,
                             t, ignore_index, out, lse, stream);
    case at::kHalf:
      return launch_row_loss(reinterpret_cast<const __half*>(logits.const_data_ptr<at::Half>()), rows, v, t,
                             ignore_index, out, lse, stream);
    default: TORCH_CHECK(false, "linear_cross_entropy: unsupported dtype ", logits.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                             const at::Tensor& targets, int64_t ignore_index,
                                                             int64_t chunk_rows) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return chunked_linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_rows, row_loss_cuda);
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_rows_cuda(const at::Tensor& logits, const at::Tensor& targets,
                                                                  int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  return logits_cross_entropy(logits, targets, ignore_index, row_loss_cuda);
}

// d = g·exp(x − l), except at the target: g·expm1(x − l) (no cancellation when p_t ≈ 1).
__device__ __forceinline__ float grad_logit(float x, int64_t j, int64_t t, float l, float g) {
  return j == t ? g * expm1f(x - l) : g * expf(x - l);
}

// One block per row, read and written as row_loss_kernel reads (RowSplit); an ignored row becomes 0.
// Each element is read and written by the same thread, so the row is rewritten in place safely.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grad_logits_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets, const float* __restrict__ lse,
                       const float* __restrict__ grad_loss, int64_t v, int64_t ignore_index) {
  constexpr int N = RowSplit<T>::N;
  const int64_t r = blockIdx.x;
  const int64_t t = targets[r];
  T* row = logits + r * v;
  const bool ignored = t == ignore_index;
  if (!ignored) {
    CUDA_KERNEL_ASSERT(t >= 0 && t < v);
  }
  const float l = lse[r], g = ignored ? 0.f : grad_loss[r];
  const RowSplit<T> split(row, v);
  auto* packs = reinterpret_cast<Pack<T, N>*>(row + split.head);
#pragma unroll 4
  for (int64_t k = threadIdx.x; k < split.packs; k += blockDim.x) {
    Pack<T, N> p = packs[k];
    const int64_t j = split.head + k * N;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      p.v[e] = ignored ? from_float<T>(0.f) : from_float<T>(grad_logit(to_float(p.v[e]), j + e, t, l, g));
    }
    packs[k] = p;
  }
  for (int64_t e = threadIdx.x; e < split.unpacked_count(v); e += blockDim.x) {
    const int64_t j = split.unpacked(e);
    row[j] = ignored ? from_float<T>(0.f) : from_float<T>(grad_logit(to_float(row[j]), j, t, l, g));
  }
}

template <typename T>
void launch_grad_logits(T* logits, int64_t rows, int64_t v, const int64_t* targets, const float* lse,
                        const float* grad_loss, int64_t ignore_index, cudaStream_t stream) {
  grad_logits_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, targets, lse, grad_loss, v,
                                                                          ignore_index);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void grad_logits_cuda(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                      const at::Tensor& grad_loss, int64_t ignore_index) {
  check_grad_logits_args(logits, targets, lse, grad_loss);
  const int64_t rows = logits.size(0), v = logits.size(1);
  if (rows == 0) return;
  TORCH_CHECK(rows < (int64_t{1} << 31), "linear_cross_entropy: chunk_rows must be below 2^31 on CUDA");
  const c10::cuda::CUDAGuard guard(logits.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* t = targets.const_data_ptr<int64_t>();
  const float* l = lse.const_data_ptr<float>();
  const float* g = grad_loss.const_data_ptr<float>();
  switch (logits.scalar_type()) {
    case at::kFloat: return launch_grad_logits(logits.data_ptr<float>(), rows, v, t, l, g, ignore_index, stream);
    case at::kBFloat16:
      return launch_grad_logits(reinterpret_cast<__nv_bfloat16*>(logits.data_ptr<at::BFloat16>()), rows, v, t, l, g,
                                ignore_index, stream);
    case at::kHalf:
      return launch_grad_logits(reinterpret_cast<__half*>(logits.data_ptr<at::Half>()), rows, v, t, l, g,
                                ignore_index, stream);
    default: TORCH_CHECK(false, "linear_cross_entropy_grad_logits_: unsupported dtype ", logits.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CUDA, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_cuda);
  m.impl("linear_cross_entropy_rows", &linear_cross_entropy_rows_cuda);
  m.impl("linear_cross_entropy_grad_logits_", &grad_logits_cuda);
}

}  // namespace adept_ext
