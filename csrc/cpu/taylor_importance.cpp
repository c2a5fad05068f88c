// CPU kernel of taylor_importance: one at::parallel_for over (tensor, chunk) work items,
// vectorised float32 accumulation per chunk, fixed-order double reduction per tensor.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec_load.h"
#include "../taylor_importance.h"

namespace adept_ext {
namespace {

struct Sums {
  float dot;
  float abs;
};

inline float horizontal_sum(const Vec& v) {
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int k = 0; k < Vec::size(); ++k) s += lanes[k];
  return s;
}

// Sums of theta*g and |theta*g| over n elements, two independent vector accumulators each.
template <typename TP, typename TG>
Sums chunk_sums(const void* pv, const void* gv, int64_t n) {
  const TP* p = static_cast<const TP*>(pv);
  const TG* g = static_cast<const TG*>(gv);
  constexpr int64_t W = Vec::size();
  Vec dot0(0.f), dot1(0.f), abs0(0.f), abs1(0.f);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const Vec x0 = load_float(p + j) * load_float(g + j);
    const Vec x1 = load_float(p + j + W) * load_float(g + j + W);
    dot0 = dot0 + x0;
    dot1 = dot1 + x1;
    abs0 = abs0 + x0.abs();
    abs1 = abs1 + x1.abs();
  }
  Sums s{horizontal_sum(dot0 + dot1), horizontal_sum(abs0 + abs1)};
  for (; j < n; ++j) {
    const float x = static_cast<float>(p[j]) * static_cast<float>(g[j]);
    s.dot += x;
    s.abs += std::abs(x);
  }
  return s;
}

using ChunkFn = Sums (*)(const void*, const void*, int64_t);

template <typename TP>
ChunkFn pick_grad_type(at::ScalarType g) {
  switch (g) {
    case at::kFloat: return chunk_sums<TP, float>;
    case at::kBFloat16: return chunk_sums<TP, at::BFloat16>;
    case at::kHalf: return chunk_sums<TP, at::Half>;
    default: TORCH_CHECK(false, "taylor_importance: unsupported grad dtype ", g);
  }
}

ChunkFn pick_chunk_fn(at::ScalarType p, at::ScalarType g) {
  switch (p) {
    case at::kFloat: return pick_grad_type<float>(g);
    case at::kBFloat16: return pick_grad_type<at::BFloat16>(g);
    case at::kHalf: return pick_grad_type<at::Half>(g);
    default: TORCH_CHECK(false, "taylor_importance: unsupported param dtype ", p);
  }
}

void taylor_importance_out_cpu(at::TensorList params_in, at::TensorList grads_in, const at::Tensor& out,
                               bool accumulate) {
  check_taylor_args(params_in, grads_in, out);
  const auto params = contiguous_list(params_in);
  const auto grads = contiguous_list(grads_in);
  const int64_t n = static_cast<int64_t>(params.size());
  const auto first = chunk_offsets(numels_of(params), kTaylorChunk);
  const int64_t total = first[n];
  const auto owner = chunk_owners(first);
  std::vector<ChunkFn> fns(n);
  for (int64_t i = 0; i < n; ++i) fns[i] = pick_chunk_fn(params[i].scalar_type(), grads[i].scalar_type());

  std::vector<Sums> partial(total);
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = owner[c];
      const int64_t start = (c - first[i]) * kTaylorChunk;
      const int64_t len = std::min(kTaylorChunk, params[i].numel() - start);
      const auto* p = static_cast<const char*>(params[i].const_data_ptr()) + start * params[i].element_size();
      const auto* g = static_cast<const char*>(grads[i].const_data_ptr()) + start * grads[i].element_size();
      partial[c] = fns[i](p, g, len);
    }
  });

  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0.0, abs = 0.0;
    for (int64_t c = first[i]; c < first[i + 1]; ++c) {
      dot += partial[c].dot;
      abs += partial[c].abs;
    }
    o[2 * i] = (accumulate ? o[2 * i] : 0.f) + static_cast<float>(dot);
    o[2 * i + 1] = (accumulate ? o[2 * i + 1] : 0.f) + static_cast<float>(abs);
  }
}

at::Tensor taylor_importance_cpu(at::TensorList params, at::TensorList grads) {
  TORCH_CHECK(!params.empty(), "taylor_importance: empty tensor list");
  auto out = at::empty({static_cast<int64_t>(params.size()), 2}, params[0].options().dtype(at::kFloat));
  taylor_importance_out_cpu(params, grads, out, /*accumulate=*/false);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(adept_ext, CPU, m) {
  m.impl("taylor_importance", &taylor_importance_cpu);
  m.impl("taylor_importance_out", &taylor_importance_out_cpu);
}

}  // namespace adept_ext
