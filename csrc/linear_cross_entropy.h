// Chunked drivers of linear_cross_entropy shared by the CPU and CUDA kernels. Forward: for each
// chunk of rows, logits = hidden_chunk @ weight^T (one GEMM in the inputs' dtype), then a fused
// per-row kernel writes lse = logsumexp(logits) and loss = lse - logit[target]. Only one chunk of
// logits [chunk_rows, V] exists at a time. The backward's per-chunk kernel (grad_logits_) turns a
// recomputed chunk of logits into the logits' gradient in place; its chunk loop is in Python
// (adept_ext/ops/cross_entropy.py), which picks the weight-gradient GEMM the running torch offers.
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

// row_loss(logits [c, V], targets [c], ignore_index, loss [c], lse [c]) is the backend's fused
// kernel (both float32; 0 at ignored rows). Returns (loss, lse).
template <typename RowLoss>
std::tuple<at::Tensor, at::Tensor> chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                                                const at::Tensor& targets, int64_t ignore_index,
                                                                int64_t chunk_rows, RowLoss row_loss) {
  check_lce_args(hidden, weight, targets, chunk_rows);
  const int64_t n = hidden.size(0);
  auto loss = at::empty({n}, hidden.options().dtype(at::kFloat));
  auto lse = at::empty({n}, hidden.options().dtype(at::kFloat));
  const int64_t chunk = chunk_rows > 0 ? chunk_rows : default_chunk_rows(weight.size(0));
  const auto w_t = weight.t();
  const auto t = targets.contiguous();
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    const auto logits = at::mm(hidden.narrow(0, r0, c), w_t);
    row_loss(logits, t.narrow(0, r0, c), ignore_index, loss.narrow(0, r0, c), lse.narrow(0, r0, c));
  }
  return {loss, lse};
}

// The row kernel on logits the caller computed: (loss, lse) of each row, float32.
template <typename RowLoss>
std::tuple<at::Tensor, at::Tensor> logits_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                                        int64_t ignore_index, RowLoss row_loss) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0) &&
                  targets.scalar_type() == at::kLong && targets.device() == logits.device(),
              "linear_cross_entropy_rows: expected logits [c, V] and int64 targets [c] on one device");
  auto loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  auto lse = at::empty_like(loss);
  row_loss(logits, targets.contiguous(), ignore_index, loss, lse);
  return {loss, lse};
}

inline void check_grad_logits_args(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                                   const at::Tensor& grad_loss) {
  const char* name = "linear_cross_entropy_grad_logits_";
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), name, ": logits must be a contiguous [c, V] tensor");
  const int64_t c = logits.size(0);
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == c && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous(), name, ": targets must be contiguous int64 [c]");
  for (const auto* t : {&lse, &grad_loss}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == c && t->scalar_type() == at::kFloat && t->is_contiguous(), name,
                ": lse and grad_loss must be contiguous float32 [c]");
  }
  TORCH_CHECK(targets.device() == logits.device() && lse.device() == logits.device() &&
                  grad_loss.device() == logits.device(), name, ": tensors on different devices");
}

}  // namespace adept_ext
