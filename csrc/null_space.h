// Host-side pieces of the null-space projection ops shared by the CPU and CUDA kernels.
// basis[i] has shape [k, *grads[i].shape]: row j is tensor i's slice of basis vector j.
#pragma once
#include <ATen/ATen.h>

#include "multi_tensor.h"

namespace adept_ext {

// Elements per work item of the projection kernels.
constexpr int64_t kProjChunk = 8192;

inline bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Second line of defence: adept_ext/ops/ validates first and names the offending index.
inline int64_t check_basis_args(at::TensorList basis, at::TensorList grads) {
  TORCH_CHECK(basis.size() == grads.size() && !basis.empty(), "null_space: basis and grads must be non-empty lists of equal length");
  const int64_t k = basis[0].dim() > 0 ? basis[0].size(0) : -1;
  for (size_t i = 0; i < basis.size(); ++i) {
    const auto& q = basis[i];
    const auto& g = grads[i];
    TORCH_CHECK(q.dim() == g.dim() + 1 && q.size(0) == k && q.sizes().slice(1) == g.sizes(),
                "null_space: basis[", i, "] must have shape [k, *grads[", i, "].shape] with one k for all");
    TORCH_CHECK(q.device() == basis[0].device() && g.device() == basis[0].device(), "null_space: tensor ", i,
                " is on another device");
    TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
                "null_space: basis must be float32 or bfloat16");
    TORCH_CHECK(is_float_type(g.scalar_type()), "null_space: grads must be float32, bfloat16 or float16");
  }
  return k;
}

inline void check_coeffs(const at::Tensor& coeffs, int64_t k, const at::Device& device) {
  TORCH_CHECK(coeffs.scalar_type() == at::kDouble && coeffs.dim() == 1 && coeffs.size(0) == k &&
                  coeffs.device() == device,
              "null_space: coeffs must be a float64 tensor of shape [", k, "] on ", device);
}

inline void check_pair_lists(at::TensorList a, at::TensorList b) {
  TORCH_CHECK(a.size() == b.size() && !a.empty(), "conflict_correct: g_new and g_pre must be non-empty lists of equal length");
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].sizes() == b[i].sizes(), "conflict_correct: shapes differ at ", i);
    TORCH_CHECK(a[i].device() == a[0].device() && b[i].device() == a[0].device(), "conflict_correct: device mismatch at ", i);
    TORCH_CHECK(is_float_type(a[i].scalar_type()) && is_float_type(b[i].scalar_type()),
                "conflict_correct: unsupported dtype at ", i);
  }
}

// The conflict rule of docs/methods.md §2 on the reduced statistics [<g_new, g_pre>, |g_pre|^2, |g_new|^2]:
// the coefficient of g_pre removed from g_new (0 when there is no conflict).
#ifdef __CUDACC__
__host__ __device__
#endif
inline double conflict_coefficient(double dot, double pp, double nn, double eps) {
  return (pp > 0.0 && dot < -eps * sqrt(pp * nn)) ? dot / pp : 0.0;
}

}  // namespace adept_ext
