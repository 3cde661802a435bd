// Elementwise steps of a decoder layer on the CPU, each one pass instead of several torch ops,
// rounding exactly where torch rounds so that outputs equal torch's:
//  - rotary: rotate-half RoPE in place on q and k heads,
//      x' = round(round(x * cos) + round(rotate_half(x) * sin)) (round: to x's type);
//  - silu_mul: out = round(round(silu(gate)) * up) from [gate | up] rows.
#include <cmath>
#include <cstdint>

#include "bf16.h"
#include "entry.h"

// a * b + c must round twice, as torch's separate ops do: no fused multiply-adds here.
#pragma GCC optimize("fp-contract=off")
#include "vec.h"

namespace {

using radixmesh::load;
using radixmesh::store;

// Elements below which one thread does the whole tensor.
constexpr int64_t kParallelElems = 1 << 15;

inline float round_to(float x, float) { return x; }
inline float round_to(float x, uint16_t) { return load(radixmesh::to_bf16(x)); }

// x [tokens, heads, dim] with rows `stride` elements apart; cos/sin [positions, dim].
template <typename T>
void rotary(T* x, const int64_t* positions, const T* cos, const T* sin, int tokens, int heads,
            int64_t stride, int dim, int threads) {
  const int half = dim / 2;
  const int used = static_cast<int64_t>(tokens) * heads * dim >= kParallelElems ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(used) if (used > 1)
  for (int t = 0; t < tokens; ++t) {
    const T* c = cos + positions[t] * dim;
    const T* s = sin + positions[t] * dim;
    for (int h = 0; h < heads; ++h) {
      T* row = x + t * stride + static_cast<int64_t>(h) * dim;
      for (int d = 0; d < half; ++d) {
        const float lo = load(row[d]), hi = load(row[d + half]);
        const float a_lo = round_to(lo * load(c[d]), T{});
        const float b_lo = round_to(-hi * load(s[d]), T{});
        const float a_hi = round_to(hi * load(c[d + half]), T{});
        const float b_hi = round_to(lo * load(s[d + half]), T{});
        store(row + d, a_lo + b_lo);
        store(row + d + half, a_hi + b_hi);
      }
    }
  }
}

}  // namespace

extern "C" {

void rotary_f32(float* x, const int64_t* positions, const float* cos, const float* sin,
                int tokens, int heads, int64_t stride, int dim, int threads) {
  rotary(x, positions, cos, sin, tokens, heads, stride, dim, threads);
}

void rotary_bf16(uint16_t* x, const int64_t* positions, const uint16_t* cos,
                 const uint16_t* sin, int tokens, int heads, int64_t stride, int dim,
                 int threads) {
  rotary(x, positions, cos, sin, tokens, heads, stride, dim, threads);
}

void silu_mul_bf16_rows(const uint16_t* x, uint16_t* out, int rows, int width, int threads) {
  const int used = static_cast<int64_t>(rows) * width >= kParallelElems ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(used) if (used > 1)
  for (int r = 0; r < rows; ++r) {
    const uint16_t* gate = x + static_cast<int64_t>(r) * 2 * width;
    const uint16_t* up = gate + width;
    uint16_t* o = out + static_cast<int64_t>(r) * width;
    int d = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; d + 16 <= width; d += 16) {
      const __m512 g = radixmesh::load16(gate + d);
      const __m512 e = radixmesh::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
      // Round silu to bf16 first, as torch's separate silu and mul do.
      const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));
      radixmesh::store16(o + d, _mm512_mul_ps(rounded, radixmesh::load16(up + d)));
    }
#endif
    for (; d < width; ++d) {
      const float g = load(gate[d]);
      const float silu = load(radixmesh::to_bf16(g / (1.0f + std::exp(-g))));
      store(o + d, silu * load(up[d]));
    }
  }
}

}  // extern "C"
