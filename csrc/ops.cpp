// Op schemas of adept_ext and the (empty) Python module whose import loads them.
// The CPU and CUDA kernels register with TORCH_LIBRARY_IMPL in csrc/cpu/ and csrc/cuda/; the fakes,
// the autograd, autocast and ADInplaceOrView kernels in adept_ext/ops/registration.py; the two ops
// written in Python (linear_cross_entropy_backward, linear_cross_entropy_sum) in
// adept_ext/ops/cross_entropy.py. The Python wrappers in adept_ext/ops/ check the arguments with
// clear messages before a kernel runs; the kernels' TORCH_CHECKs are a second line of defence
// (docs/design.md, "Conventions": arguments are checked in one place).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import adept_ext._C` runs this, and loading the shared object runs the static
// registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(adept_ext, m) {
  // Per tensor i: [sum_j theta_j * g_j, sum_j |theta_j * g_j|] in float32 (docs/methods.md §1.3).
  m.def("taylor_importance(Tensor[] params, Tensor[] grads) -> Tensor");
  // Same sums written into (accumulate=False) or added onto (accumulate=True) out [n, 2] float32.
  m.def("taylor_importance_out(Tensor[] params, Tensor[] grads, Tensor(a!) out, bool accumulate) -> ()");
  // Null-space projection (docs/methods.md §2). basis[i]: [k, *grads[i].shape], tensor i's slices of k
  // basis vectors. coeffs = Σ_i basis_i · grads_i, float64 [k] (= Qᵀg);
  m.def("null_space_coeffs(Tensor[] basis, Tensor[] grads) -> Tensor");
  // grads_i -= Σ_j coeffs[j] · basis_i[j], in place (g ← g − Q c).
  m.def("null_space_apply_(Tensor[] basis, Tensor(a!)[] grads, Tensor coeffs) -> ()");
  // Conflict correction: with d = <g_new, g_pre>, if d < -eps·|g_new|·|g_pre| remove g_new's
  // component along g_pre; then g_new += lam·g_pre, in place and without a host sync.
  // Returns float64 [4]: d, |g_pre|^2, |g_new|^2 (before the update) and the removed coefficient.
  m.def("conflict_correct_(Tensor(a!)[] g_new, Tensor[] g_pre, float lam, float eps) -> Tensor");
  // Per-row cross-entropy of hidden [N, H] @ weight[V, H]^T against targets [N] (docs/methods.md §1.1),
  // computed in row chunks without materialising [N, V]: (loss, lse), both float32 [N] and 0 at
  // ignore_index rows; lse = logsumexp of the row's logits, kept for the backward.
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, int chunk_rows) -> "
        "(Tensor, Tensor)");
  // The forward's row kernel on a given chunk of logits [c, V]: (loss, lse), float32 [c], 0 at ignored rows
  // (linear_cross_entropy_sum's forward computes the logits itself, to reuse them for the gradients).
  m.def("linear_cross_entropy_rows(Tensor logits, Tensor targets, int ignore_index) -> (Tensor, Tensor)");
  // The backward's per-chunk kernel: logits [c, V] (contiguous, the recomputed chunk) become, in place,
  // grad_loss[r] * (exp(logits - lse[r]) - onehot(targets[r])), 0 at ignore_index rows.
  m.def("linear_cross_entropy_grad_logits_(Tensor(a!) logits, Tensor targets, Tensor lse, Tensor grad_loss, "
        "int ignore_index) -> ()");
}
