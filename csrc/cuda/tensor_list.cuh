// Per-launch metadata of the multi-tensor CUDA kernels, passed by value as a kernel parameter
// (the TensorListMetadata of multi_tensor_apply): a call allocates no metadata buffer and makes
// no host-to-device copy, so the ops can be captured in a CUDA graph. The dtypes are dispatched
// on the host: tensors are grouped by their (a, b) dtype pair and each launch runs one
// instantiation of the kernel; a group longer than kListMax tensors takes several launches.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "../multi_tensor.h"

namespace adept_ext {

// 96 tensors keep the struct (3944 bytes) and a kernel's other parameters within the classic
// 4 KiB parameter limit.
constexpr int kListMax = 96;

struct ListMeta {
  const void* a[kListMax];
  const void* b[kListMax];
  int64_t numel[kListMax];
  // Index of the tensor's first chunk in the call's chunk numbering (that of the whole list, in
  // list order): partial results land at the same place whatever the grouping into launches.
  int64_t chunk0[kListMax];
  int32_t block0[kListMax + 1];  // first block of tensor t in this launch; block0[n] = blocks
  int32_t row[kListMax];         // index of the tensor in the op's list
  uint8_t aligned[kListMax];     // 1: both base pointers 16-byte aligned (and numel a multiple of the caller's need)
  int32_t n;

#ifdef __CUDACC__
  // The tensor of block b: the last t with block0[t] <= b (tensors without elements own no block).
  __device__ __forceinline__ int owner(int64_t b) const {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (block0[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
#endif
};
static_assert(sizeof(ListMeta) <= 3968, "ListMeta must leave room for the kernel's other parameters in 4 KiB");

// Calls launch(meta, blocks, a_tag, b_tag) for every launch needed to cover the tensor pairs
// (a[i], b[i]) in chunks of `chunk` elements of numels[i] (one block per chunk), with typed null
// pointers (float, at::BFloat16, at::Half) for the dtypes of the group. Tensors whose element
// count is not a multiple of numel_multiple are never marked aligned. Returns the number of
// chunks of the whole list (the size of a per-chunk partial buffer).
template <typename Launch>
int64_t for_each_launch(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                        const std::vector<int64_t>& numels, int64_t chunk, int64_t numel_multiple, Launch launch) {
  const int64_t n = static_cast<int64_t>(a.size());
  const auto first = chunk_offsets(numels, chunk);
  for (int64_t i = 0; i < n; ++i) {  // before any launch: an error leaves every tensor as it was
    TORCH_CHECK(first[i + 1] - first[i] < (int64_t{1} << 31), "adept_ext: tensor ", i,
                " has too many chunks for one launch");
  }
  std::vector<bool> done(n, false);
  for (int64_t start = 0; start < n; ++start) {
    if (done[start]) continue;
    const auto ta = a[start].scalar_type(), tb = b[start].scalar_type();
    ListMeta meta;
    meta.n = 0;
    int64_t blocks = 0;
    auto flush = [&] {
      meta.block0[meta.n] = static_cast<int32_t>(blocks);
      dispatch_pair(ta, tb, [&](auto* a_tag, auto* b_tag) { launch(meta, blocks, a_tag, b_tag); });
      meta.n = 0;
      blocks = 0;
    };
    for (int64_t i = start; i < n; ++i) {
      if (done[i] || a[i].scalar_type() != ta || b[i].scalar_type() != tb) continue;
      const int64_t chunks = first[i + 1] - first[i];
      if (meta.n == kListMax || (meta.n > 0 && blocks + chunks >= (int64_t{1} << 31))) flush();
      const auto pa = reinterpret_cast<uintptr_t>(a[i].const_data_ptr());
      const auto pb = reinterpret_cast<uintptr_t>(b[i].const_data_ptr());
      const int t = meta.n++;
      meta.a[t] = a[i].const_data_ptr();
      meta.b[t] = b[i].const_data_ptr();
      meta.numel[t] = numels[i];
      meta.chunk0[t] = first[i];
      meta.block0[t] = static_cast<int32_t>(blocks);
      meta.row[t] = static_cast<int32_t>(i);
      meta.aligned[t] = (pa % 16 == 0 && pb % 16 == 0 && numels[i] % numel_multiple == 0) ? 1 : 0;
      blocks += chunks;
      done[i] = true;
    }
    if (meta.n > 0) flush();
  }
  return first.back();
}

}  // namespace adept_ext
