// float32 <-> bfloat16 (stored as uint16_t) for the native CPU kernels: widening is exact,
// narrowing rounds to nearest-even and keeps NaN a NaN, as torch does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixmesh {

inline float load(float x) { return x; }

inline float load(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t to_bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void store(float* dst, float x) { *dst = x; }

inline void store(uint16_t* dst, float x) { *dst = to_bf16(x); }

}  // namespace radixmesh
