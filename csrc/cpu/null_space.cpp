// CPU kernels of the null-space projection (docs/methods.md §2): c = Qᵀg and g ← g − Q c over lists of
// tensors, and the fused conflict correction. One at::parallel_for over (tensor, chunk) work
// items per pass; float32 vector accumulation inside a chunk, float64 across chunks in a fixed order.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec_load.h"
#include "../null_space.h"

namespace adept_ext {
namespace {

template <typename A, typename B>
float dot_chunk(const A* a, const B* b, int64_t n) {
  constexpr int64_t W = Vec::size();
  Vec s0(0.f), s1(0.f);
  int64_t e = 0;
  for (; e + 2 * W <= n; e += 2 * W) {
    s0 = at::vec::fmadd(load_float(a + e), load_float(b + e), s0);
    s1 = at::vec::fmadd(load_float(a + e + W), load_float(b + e + W), s1);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s0 + s1);
  for (; e < n; ++e) s += static_cast<float>(a[e]) * static_cast<float>(b[e]);
  return s;
}

// out[r] = <rows[r][0:n], g[0:n]> for 4 rows at once (g loaded once per 4 rows).
template <typename TQ, typename TG>
void dot4_chunk(const TQ* const rows[4], const TG* g, int64_t n, float out[4]) {
  constexpr int64_t W = Vec::size();
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t e = 0;
  for (; e + W <= n; e += W) {
    const Vec gv = load_float(g + e);
    s0 = at::vec::fmadd(load_float(rows[0] + e), gv, s0);
    s1 = at::vec::fmadd(load_float(rows[1] + e), gv, s1);
    s2 = at::vec::fmadd(load_float(rows[2] + e), gv, s2);
    s3 = at::vec::fmadd(load_float(rows[3] + e), gv, s3);
  }
  const Vec* acc[4] = {&s0, &s1, &s2, &s3};
  for (int r = 0; r < 4; ++r) {
    out[r] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, *acc[r]);
    for (int64_t t = e; t < n; ++t) out[r] += static_cast<float>(rows[r][t]) * static_cast<float>(g[t]);
  }
}

// acc[0:n] += Σ_r c[r] * rows[r][0:n] for up to 4 rows (acc read and written once per 4 rows).
template <typename T>
void axpy4_chunk(const float* c, const T* const rows[4], int m, float* acc, int64_t n) {
  constexpr int64_t W = Vec::size();
  const Vec c0(c[0]), c1(m > 1 ? c[1] : 0.f), c2(m > 2 ? c[2] : 0.f), c3(m > 3 ? c[3] : 0.f);
  const T* r1 = rows[m > 1 ? 1 : 0];
  const T* r2 = rows[m > 2 ? 2 : 0];
  const T* r3 = rows[m > 3 ? 3 : 0];
  int64_t e = 0;
  for (; e + W <= n; e += W) {
    Vec a = at::vec::fmadd(c0, load_float(rows[0] + e), Vec::loadu(acc + e));
    a = at::vec::fmadd(c1, load_float(r1 + e), a);
    a = at::vec::fmadd(c2, load_float(r2 + e), a);
    a = at::vec::fmadd(c3, load_float(r3 + e), a);
    a.store(acc + e);
  }
  for (; e < n; ++e)
    for (int r = 0; r < m; ++r) acc[e] += c[r] * static_cast<float>(rows[r][e]);
}

// acc[0:n] += c * x[0:n]
template <typename T>
void axpy_chunk(float c, const T* x, float* acc, int64_t n) {
  const T* rows[4] = {x, x, x, x};
  axpy4_chunk(&c, rows, 1, acc, n);
}

// The (tensor, kProjChunk-element chunk) work items of a pass over two tensor lists; numels are
// those of the second list (the basis rows of the first list have that length too).
struct Chunks {
  std::vector<at::Tensor> a, b;
  std::vector<int64_t> numels, first, owner;
  Chunks(at::TensorList a_in, at::TensorList b_in)
      : a(contiguous_list(a_in)), b(contiguous_list(b_in)), numels(numels_of(b)),
        first(chunk_offsets(numels, kProjChunk)), owner(chunk_owners(first)) {}
  int64_t total() const { return first.back(); }

  // fn(c, i, s, n, a_ptr, b_ptr, scratch) for every chunk c in parallel: chunk c covers elements
  // [s, s + n) of tensor i; a_ptr/b_ptr are the typed data pointers of a[i] and b[i] (not offset);
  // scratch holds kProjChunk floats private to the calling thread.
  template <typename Fn>
  void for_each(Fn fn) const {
    at::parallel_for(0, total(), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(kProjChunk);
      for (int64_t c = begin; c < end; ++c) {
        const int64_t i = owner[c], s = (c - first[i]) * kProjChunk, n = std::min(kProjChunk, numels[i] - s);
        dispatch_pair(a[i].scalar_type(), b[i].scalar_type(), [&](auto* a_tag, auto* b_tag) {
          using TA = std::remove_pointer_t<decltype(a_tag)>;
          using TB = std::remove_pointer_t<decltype(b_tag)>;
          fn(c, i, s, n, a[i].data_ptr<TA>(), b[i].data_ptr<TB>(), scratch.data());
        });
      }
    });
  }
};

// The rows j..j+3 of tensor i's basis at element s (the last valid row repeated past k).
template <typename TQ>
void basis_rows(const TQ* q, int64_t j, int m, int64_t numel, int64_t s, const TQ* rows[4]) {
  for (int r = 0; r < 4; ++r) rows[r] = q + (j + std::min(r, m - 1)) * numel + s;
}

at::Tensor null_space_coeffs_cpu(at::TensorList basis, at::TensorList grads) {
  const int64_t k = check_basis_args(basis, grads);
  const Chunks ch(basis, grads);
  std::vector<float> partial(ch.total() * k);
  ch.for_each([&](int64_t c, int64_t i, int64_t s, int64_t n, const auto* q, const auto* g, float*) {
    for (int64_t j = 0; j < k; j += 4) {
      const int m = static_cast<int>(std::min<int64_t>(4, k - j));
      std::remove_const_t<std::remove_pointer_t<decltype(q)>> const* rows[4];
      basis_rows(q, j, m, ch.numels[i], s, rows);
      float out[4];
      dot4_chunk(rows, g + s, n, out);
      for (int r = 0; r < m; ++r) partial[c * k + j + r] = out[r];
    }
  });
  auto out = at::zeros({k}, grads[0].options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (int64_t c = 0; c < ch.total(); ++c)
    for (int64_t j = 0; j < k; ++j) o[j] += partial[c * k + j];
  return out;
}

void null_space_apply_cpu(at::TensorList basis, at::TensorList grads, const at::Tensor& coeffs) {
  const int64_t k = check_basis_args(basis, grads);
  check_coeffs(coeffs, k, grads[0].device());
  for (const auto& g : grads)
    TORCH_CHECK(g.is_contiguous(), "null_space_apply_: grads must be contiguous (updated in place)");
  const Chunks ch(basis, grads);  // ch.b[i] aliases grads[i] (contiguous)
  const auto cd = coeffs.contiguous();
  std::vector<float> cf(cd.const_data_ptr<double>(), cd.const_data_ptr<double>() + k);
  ch.for_each([&](int64_t, int64_t i, int64_t s, int64_t n, const auto* q, auto* g, float* acc) {
    std::fill(acc, acc + n, 0.f);
    for (int64_t j = 0; j < k; j += 4) {
      const int m = static_cast<int>(std::min<int64_t>(4, k - j));
      std::remove_const_t<std::remove_pointer_t<decltype(q)>> const* rows[4];
      basis_rows(q, j, m, ch.numels[i], s, rows);
      axpy4_chunk(&cf[j], rows, m, acc, n);
    }
    using TG = std::remove_pointer_t<decltype(g)>;
    for (int64_t e = 0; e < n; ++e) g[s + e] = static_cast<TG>(static_cast<float>(g[s + e]) - acc[e]);
  });
}

at::Tensor conflict_correct_cpu(at::TensorList g_new, at::TensorList g_pre, double lam, double eps) {
  check_pair_lists(g_new, g_pre);
  for (const auto& g : g_new)
    TORCH_CHECK(g.is_contiguous(), "conflict_correct_: g_new must be contiguous (updated in place)");
  const Chunks ch(g_new, g_pre);  // ch.a[i] aliases g_new[i] (contiguous)
  std::vector<float> partial(ch.total() * 3);
  ch.for_each([&](int64_t c, int64_t, int64_t s, int64_t n, const auto* a, const auto* b, float*) {
    partial[3 * c] = dot_chunk(a + s, b + s, n);
    partial[3 * c + 1] = dot_chunk(b + s, b + s, n);
    partial[3 * c + 2] = dot_chunk(a + s, a + s, n);
  });
  auto stats = at::zeros({4}, g_new[0].options().dtype(at::kDouble));
  double* st = stats.data_ptr<double>();
  for (int64_t c = 0; c < ch.total(); ++c)
    for (int m = 0; m < 3; ++m) st[m] += partial[3 * c + m];
  const double coef = conflict_coefficient(st[0], st[1], st[2], eps);
  st[3] = coef;
  const float scale = static_cast<float>(lam - coef);
  ch.for_each([&](int64_t, int64_t, int64_t s, int64_t n, auto* a, const auto* b, float* acc) {
    std::fill(acc, acc + n, 0.f);
    axpy_chunk(scale, b + s, acc, n);
    using TA = std::remove_pointer_t<decltype(a)>;
    for (int64_t e = 0; e < n; ++e) a[s + e] = static_cast<TA>(static_cast<float>(a[s + e]) + acc[e]);
  });
  return stats;
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CPU, m) {
  m.impl("null_space_coeffs", &null_space_coeffs_cpu);
  m.impl("null_space_apply_", &null_space_apply_cpu);
  m.impl("conflict_correct_", &conflict_correct_cpu);
}

}  // namespace adept_ext
