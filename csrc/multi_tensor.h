// Host-side helpers of the multi-tensor kernels (CPU and CUDA): work items are (tensor, chunk)
// pairs of a fixed chunk size, so that partial sums, and therefore results, do not depend on the
// thread count (CPU) or on how a list is split into launches (CUDA). The two devices share the
// chunks but not the order of the sums inside a chunk: they agree to rounding, not bit for bit.
#pragma once
#include <ATen/ATen.h>
#include <vector>

namespace adept_ext {

// Non-contiguous inputs are read through a contiguous copy; contiguous ones are used in place.
inline std::vector<at::Tensor> contiguous_list(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(t.contiguous());
  return out;
}

// first[i] = index of tensor i's first chunk of `chunk` elements; first[n] = total chunks.
inline std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& numels, int64_t chunk) {
  std::vector<int64_t> first(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) first[i + 1] = first[i] + (numels[i] + chunk - 1) / chunk;
  return first;
}

inline std::vector<int64_t> numels_of(const std::vector<at::Tensor>& ts) {
  std::vector<int64_t> n;
  n.reserve(ts.size());
  for (const auto& t : ts) n.push_back(t.numel());
  return n;
}

// Calls fn(a_tag, b_tag) with typed null pointers (float, at::BFloat16, at::Half) for the dtypes
// of one tensor pair: the host-side dtype dispatch of the CPU and CUDA multi-tensor kernels.
template <typename Fn>
void dispatch_pair(at::ScalarType ta, at::ScalarType tb, Fn fn) {
  auto with_b = [&](auto a) {
    switch (tb) {
      case at::kFloat: return fn(a, static_cast<float*>(nullptr));
      case at::kBFloat16: return fn(a, static_cast<at::BFloat16*>(nullptr));
      case at::kHalf: return fn(a, static_cast<at::Half*>(nullptr));
      default: TORCH_CHECK(false, "adept_ext: unsupported dtype ", tb);
    }
  };
  switch (ta) {
    case at::kFloat: return with_b(static_cast<float*>(nullptr));
    case at::kBFloat16: return with_b(static_cast<at::BFloat16*>(nullptr));
    case at::kHalf: return with_b(static_cast<at::Half*>(nullptr));
    default: TORCH_CHECK(false, "adept_ext: unsupported dtype ", ta);
  }
}

// owner[c] = the tensor that chunk c belongs to.
inline std::vector<int64_t> chunk_owners(const std::vector<int64_t>& first) {
  std::vector<int64_t> owner(first.back());
  for (size_t i = 0; i + 1 < first.size(); ++i)
    for (int64_t c = first[i]; c < first[i + 1]; ++c) owner[c] = static_cast<int64_t>(i);
  return owner;
}

}  // namespace adept_ext
