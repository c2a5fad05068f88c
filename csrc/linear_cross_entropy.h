// Chunked driver of linear_cross_entropy shared by the CPU and CUDA kernels: for each chunk
// of rows, logits = hidden_chunk @ weight^T (one GEMM in the inputs' dtype), then a fused
// per-row logsumexp + target-logit kernel writes loss = logsumexp - logit[target]. Only one
// chunk of logits [chunk_rows, V] exists at a time.
#pragma once
#include <ATen/ATen.h>

namespace adept_ext {

// Default chunk: about 2^23 logits (32 MB in float32).
inline int64_t default_chunk_rows(int64_t vocab) {
  return std::max<int64_t>(1, (int64_t{1} << 23) / std::max<int64_t>(vocab, 1));
}

inline void check_lce_args(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                           int64_t chunk_rows) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && targets.dim() == 1,
              "linear_cross_entropy: expected hidden [N, H], weight [V, H], targets [N]");
  TORCH_CHECK(hidden.size(1) == weight.size(1) && targets.size(0) == hidden.size(0),
              "linear_cross_entropy: shape mismatch");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "linear_cross_entropy: dtype mismatch");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "linear_cross_entropy: targets must be int64");
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == targets.device(),
              "linear_cross_entropy: tensors on different devices");
  TORCH_CHECK(chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0 (0 = default)");
}

// row_loss(logits [c, V], targets [c], ignore_index, loss [c] float32) is the backend's fused kernel.
template <typename RowLoss>
at::Tensor chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                        const at::Tensor& targets, int64_t ignore_index, int64_t chunk_rows,
                                        RowLoss row_loss) {
  check_lce_args(hidden, weight, targets, chunk_rows);
  const int64_t n = hidden.size(0);
  auto loss = at::empty({n}, hidden.options().dtype(at::kFloat));
  const int64_t chunk = chunk_rows > 0 ? chunk_rows : default_chunk_rows(weight.size(0));
  const auto w_t = weight.t();
  const auto t = targets.contiguous();
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    const auto logits = at::mm(hidden.narrow(0, r0, c), w_t);
    row_loss(logits, t.narrow(0, r0, c), ignore_index, loss.narrow(0, r0, c));
  }
  return loss;
}

}  // namespace adept_ext
