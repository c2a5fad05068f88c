// Loads of float32 / bfloat16 / float16 data into at::vec::Vectorized<float> and stores back, shared by
// the CPU kernels.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace adept_ext {

using Vec = at::vec::Vectorized<float>;

// Vec::size() elements starting at p, converted to float.
template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// Stores the Vec::size() floats of v at p, converted to T (rounded to nearest).
template <typename T>
inline void store_float(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    float buf[Vec::size()];
    v.store(buf);
    for (int64_t k = 0; k < Vec::size(); ++k) p[k] = static_cast<T>(buf[k]);
  }
}

}  // namespace adept_ext
