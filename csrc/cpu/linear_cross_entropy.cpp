// CPU kernel of linear_cross_entropy: chunked at::mm, then per row (at::parallel_for) a
// vectorised max pass and a vectorised sum-of-exp pass in float32.
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

template <typename T>
void row_loss_typed(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                    const at::Tensor& loss) {
  const auto lg = logits.contiguous();
  const T* x = lg.const_data_ptr<T>();
  const int64_t* t = targets.const_data_ptr<int64_t>();
  float* out = loss.data_ptr<float>();
  const int64_t rows = lg.size(0), v = lg.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (t[r] == ignore_index) {
        out[r] = 0.f;
        continue;
      }
      TORCH_CHECK(t[r] >= 0 && t[r] < v, "linear_cross_entropy: target ", t[r], " out of range [0, ", v, ")");
      const T* row = x + r * v;
      out[r] = row_logsumexp(row, v) - static_cast<float>(row[t[r]]);
    }
  });
}

void row_loss_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const at::Tensor& loss) {
  switch (logits.scalar_type()) {
    case at::kFloat: return row_loss_typed<float>(logits, targets, ignore_index, loss);
    case at::kBFloat16: return row_loss_typed<at::BFloat16>(logits, targets, ignore_index, loss);
    case at::kHalf: return row_loss_typed<at::Half>(logits, targets, ignore_index, loss);
    default: TORCH_CHECK(false, "linear_cross_entropy: unsupported dtype ", logits.scalar_type());
  }
}

at::Tensor linear_cross_entropy_cpu(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                    int64_t ignore_index, int64_t chunk_rows) {
  return chunked_linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_rows, row_loss_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CPU, m) { m.impl("linear_cross_entropy", &linear_cross_entropy_cpu); }

}  // namespace adept_ext
