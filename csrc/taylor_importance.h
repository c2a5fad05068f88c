// Host-side pieces of taylor_importance shared by the CPU and CUDA kernels.
#pragma once
#include <ATen/ATen.h>
#include <vector>

#include "multi_tensor.h"

namespace adept_ext {

// Elements per work item. Fixed, so that chunk boundaries (and therefore the float32
// rounding of every partial sum) do not depend on the thread count or the device:
// repeated calls give bit-identical results.
constexpr int64_t kTaylorChunk = int64_t{1} << 15;

// Second line of defence: adept_ext/ops/ validates first and names the offending index.
inline void check_taylor_args(at::TensorList params, at::TensorList grads, const at::Tensor& out) {
  TORCH_CHECK(params.size() == grads.size(), "taylor_importance: ", params.size(), " params but ",
              grads.size(), " grads");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.size(0) == static_cast<int64_t>(params.size()) && out.size(1) == 2 &&
                  out.is_contiguous(),
              "taylor_importance: out must be a contiguous float32 tensor of shape [", params.size(),
              ", 2]");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const auto& g = grads[i];
    TORCH_CHECK(p.sizes() == g.sizes(), "taylor_importance: params[", i, "] and grads[", i,
                "] differ in shape");
    TORCH_CHECK(p.device() == out.device() && g.device() == out.device(), "taylor_importance: params[",
                i, "] or grads[", i, "] is not on ", out.device());
    for (const auto& t : {p, g}) {
      const auto st = t.scalar_type();
      TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                  "taylor_importance: tensor ", i, " has unsupported dtype ", st);
    }
  }
}

}  // namespace adept_ext
