// CPU kernels of linear_cross_entropy. Forward: chunked at::mm, then per row (at::parallel_for) a
// vectorised max pass and a vectorised sum-of-exp pass in float32. Backward (grad_logits_): per
// row, one vectorised pass that turns the logits into g·(exp(z − lse) − onehot(t)) in place.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "vec_load.h"
#include "../linear_cross_entropy.h"

namespace adept_ext {
namespace {

template <typename T>
float row_logsumexp(const T* x, int64_t v) {
  constexpr int64_t W = Vec::size();
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (v >= W) {
    Vec m = load_float(x);
    for (j = W; j + W <= v; j += W) m = at::vec::maximum(m, load_float(x + j));
    mx = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  }
  for (int64_t k = j; k < v; ++k) {
    const float xk = static_cast<float>(x[k]);
    mx = std::isnan(xk) ? xk : std::max(mx, xk);  // NaN propagates, as through the vector maximum
  }
  // A NaN, all -inf, or a +inf present: the logsumexp is that value (the CUDA twin gives the same).
  if (!std::isfinite(mx)) return mx;
  const Vec vmx(mx);
  Vec s(0.f);
  for (j = 0; j + W <= v; j += W) s = s + (load_float(x + j) - vmx).exp();
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s);
  for (; j < v; ++j) sum += std::exp(static_cast<float>(x[j]) - mx);
  return mx + std::log(sum);
}

// Every target is ignore_index or in [0, v): checked once before any GEMM, so that a bad target
// is a ValueError naming its index (the Python wrapper leaves this check to the kernels: reading
// the targets on the host there would synchronise a GPU).
void check_targets(const at::Tensor& targets, int64_t ignore_index, int64_t v) {
  const auto t = targets.contiguous();
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] == ignore_index || (p[i] >= 0 && p[i] < v), "linear_cross_entropy: targets[", i,
                      "] = ", p[i], " is outside [0, ", v, ") and is not ignore_index (", ignore_index, ")");
  }
}

template <typename T>
void row_loss_typed(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                    const at::Tensor& loss, const at::Tensor& lse) {
  const auto lg = logits.contiguous();
  const T* x = lg.const_data_ptr<T>();
  const int64_t* t = targets.const_data_ptr<int64_t>();
  float* out = loss.data_ptr<float>();
  float* out_lse = lse.data_ptr<float>();
  const int64_t rows = lg.size(0), v = lg.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (t[r] == ignore_index) {
        out[r] = out_lse[r] = 0.f;
        continue;
      }
      TORCH_CHECK(t[r] >= 0 && t[r] < v, "linear_cross_entropy: target ", t[r], " out of range [0, ", v, ")");
      const T* row = x + r * v;
      out_lse[r] = row_logsumexp(row, v);
      out[r] = out_lse[r] - static_cast<float>(row[t[r]]);
    }
  });
}

void row_loss_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const at::Tensor& loss,
                  const at::Tensor& lse) {
  switch (logits.scalar_type()) {
    case at::kFloat: return row_loss_typed<float>(logits, targets, ignore_index, loss, lse);
    case at::kBFloat16: return row_loss_typed<at::BFloat16>(logits, targets, ignore_index, loss, lse);
    case at::kHalf: return row_loss_typed<at::Half>(logits, targets, ignore_index, loss, lse);
    default: TORCH_CHECK(false, "linear_cross_entropy: unsupported dtype ", logits.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                                                            const at::Tensor& targets, int64_t ignore_index,
                                                            int64_t chunk_rows) {
  check_targets(targets, ignore_index, weight.size(0));
  return chunked_linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_rows, row_loss_cpu);
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_rows_cpu(const at::Tensor& logits, const at::Tensor& targets,
                                                                 int64_t ignore_index) {
  check_targets(targets, ignore_index, logits.size(1));
  return logits_cross_entropy(logits, targets, ignore_index, row_loss_cpu);
}

// Row r of z (V logits) becomes d = g_r·(exp(z − lse_r) − onehot(t_r)) in one pass, computed in
// float32 and stored in T; the target's entry as g·expm1(z_t − lse) (no cancellation when p_t ≈ 1);
// an ignored row becomes 0.
template <typename T>
void grad_logits_typed(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                       const at::Tensor& grad_loss, int64_t ignore_index) {
  constexpr int64_t W = Vec::size();
  T* x = logits.data_ptr<T>();
  const int64_t* t = targets.const_data_ptr<int64_t>();
  const float* l = lse.const_data_ptr<float>();
  const float* g = grad_loss.const_data_ptr<float>();
  const int64_t rows = logits.size(0), v = logits.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = x + r * v;
      if (t[r] == ignore_index) {
        std::fill(row, row + v, T(0));
        continue;
      }
      TORCH_CHECK_VALUE(t[r] >= 0 && t[r] < v, "linear_cross_entropy: target ", t[r], " out of range [0, ", v, ")");
      const float zt = static_cast<float>(row[t[r]]);
      const Vec vl(l[r]), vg(g[r]);
      int64_t j = 0;
      for (; j + W <= v; j += W) store_float(row + j, (load_float(row + j) - vl).exp() * vg);
      for (; j < v; ++j) row[j] = static_cast<T>(std::exp(static_cast<float>(row[j]) - l[r]) * g[r]);
      row[t[r]] = static_cast<T>(g[r] * std::expm1(zt - l[r]));
    }
  });
}

void grad_logits_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                     const at::Tensor& grad_loss, int64_t ignore_index) {
  check_grad_logits_args(logits, targets, lse, grad_loss);
  switch (logits.scalar_type()) {
    case at::kFloat: return grad_logits_typed<float>(logits, targets, lse, grad_loss, ignore_index);
    case at::kBFloat16: return grad_logits_typed<at::BFloat16>(logits, targets, lse, grad_loss, ignore_index);
    case at::kHalf: return grad_logits_typed<at::Half>(logits, targets, lse, grad_loss, ignore_index);
    default: TORCH_CHECK(false, "linear_cross_entropy_grad_logits_: unsupported dtype ", logits.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CPU, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_cpu);
  m.impl("linear_cross_entropy_rows", &linear_cross_entropy_rows_cpu);
  m.impl("linear_cross_entropy_grad_logits_", &grad_logits_cpu);
}

}  // namespace adept_ext
