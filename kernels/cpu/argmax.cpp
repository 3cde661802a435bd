// Row-wise argmax of float32 logits on the CPU, as torch.argmax(dim=-1) answers it: the first
// index of the largest value, and the first NaN where a row holds one. Greedy decoding asks
// it of every row of [batch, vocab] each step; torch's takes ~1 ms for 32 x 49152.
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int64_t first_nan(const float* x, int cols) {
  for (int c = 0; c < cols; ++c) {
    if (std::isnan(x[c])) return c;
  }
  return -1;
}

int64_t argmax_row(const float* x, int cols) {
  int c = 0;
  int64_t best = 0;
  float top = cols > 0 ? x[0] : 0.0f;
  bool nan = false;
#if defined(__AVX512F__)
  if (cols >= 16) {
    __m512 vtop = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i at = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = _mm512_cmp_ps_mask(vtop, vtop, _CMP_UNORD_Q);
    for (c = 16; c + 16 <= cols; c += 16) {
      at = _mm512_add_epi32(at, step);
      const __m512 v = _mm512_loadu_ps(x + c);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, vtop, _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vtop = _mm512_mask_mov_ps(vtop, greater, v);
      vidx = _mm512_mask_mov_epi32(vidx, greater, at);
    }
    nan = unordered != 0;
    top = _mm512_reduce_max_ps(vtop);
    // Lanes holding the maximum: the smallest index among them comes first in the row.
    const __mmask16 tied = _mm512_cmp_ps_mask(vtop, _mm512_set1_ps(top), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(tied, vidx);
  }
#endif
  for (; c < cols; ++c) {
    if (x[c] > top) {
      top = x[c];
      best = c;
    }
    nan = nan || std::isnan(x[c]);
  }
  return nan ? first_nan(x, cols) : best;
}

}  // namespace

extern "C" {

void argmax_rows_f32(const float* x, int64_t* out, int rows, int cols, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
  for (int r = 0; r < rows; ++r) out[r] = argmax_row(x + static_cast<int64_t>(r) * cols, cols);
}

}  // extern "C"
