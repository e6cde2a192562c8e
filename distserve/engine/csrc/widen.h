// Widening float32/bfloat16 rows to float32, shared by the CPU kernels.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

// The bfloat16 case is written as bit shifts so the compiler vectorises it
// (c10::BFloat16's scalar conversion does not).
template <typename scalar_t>
static inline void widen(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
}

template <>
inline void widen<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = uint32_t(raw[i]) << 16;
}
