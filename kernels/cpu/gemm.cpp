// bf16 GEMM on the CPU, every linear layer at every batch size:
// out[M, N] = x[M, K] @ w[N, K]^T (+ bias) (+ residual[M, N], after rounding, as torch's
// separate add rounds).
//
// The weight is packed once (see native.pack_gemm_weight) as [N/32][K/2][32][2]: for each
// block of 32 output features and each pair of K, the 32 features' two values side by side,
// so one 64-byte load feeds VDPBF16PS for 16 features at once. A tile of up to 8 rows of x
// by 32 features keeps its 16 accumulators in registers for the whole K loop; x's pairs are
// broadcast from memory. No horizontal sums are needed. Threads split the feature blocks;
// each block's weights stay in cache while every row tile passes over them, and the row
// tiles share out prefetching the thread's next block into L2, so that the weights stream
// from memory evenly rather than in a burst at each block's first tile.
#include <cstdint>

#include "entry.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RM_AVX512_BF16 1
#endif

namespace {

#ifdef RM_AVX512_BF16
using radixmesh::widen16;

struct Epilogue {
  const uint16_t* bias;      // [N] or null
  const uint16_t* residual;  // [M, N] or null
};

constexpr int kRows = 8;       // rows of x per tile
constexpr int kFeatures = 32;  // output features per packed block

template <int R>
void tile(const uint16_t* x, const uint16_t* wp, const Epilogue& ep, uint16_t* out, int m0,
          int n0, int n, int k, const uint16_t* next, int part, int parts) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const int pairs = k / 2;
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x) + static_cast<int64_t>(m0) * pairs;
  // Few rows make few accumulator chains: give them a second set (odd pairs) so that
  // successive VDPBF16PS do not wait on each other.
  constexpr int kSets = R <= 2 ? 2 : 1;
  __m512 lo2[R], hi2[R];
  for (int r = 0; r < R; ++r) lo2[r] = hi2[r] = _mm512_setzero_ps();
  int p = 0;
  for (; p + kSets <= pairs; p += kSets) {
    for (int set = 0; set < kSets; ++set) {
      if (next != nullptr && (p + set) % parts == part) {
        __builtin_prefetch(next + (p + set) * 64, 0, 2);
        __builtin_prefetch(next + (p + set) * 64 + 32, 0, 2);
      }
    }
    for (int set = 0; set < kSets; ++set) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + (p + set) * 64);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + (p + set) * 64 + 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv =
            (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r * pairs + p + set]));
        __m512& a = set == 0 ? lo[r] : lo2[r];
        __m512& b = set == 0 ? hi[r] : hi2[r];
        a = _mm512_dpbf16_ps(a, xv, w0);
        b = _mm512_dpbf16_ps(b, xv, w1);
      }
    }
  }
  for (; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + p * 64);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + p * 64 + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r * pairs + p]));
      lo[r] = _mm512_dpbf16_ps(lo[r], xv, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], xv, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm512_add_ps(lo[r], lo2[r]);
    hi[r] = _mm512_add_ps(hi[r], hi2[r]);
  }
  // Bias, rounding to bf16 and the residual sixteen features at a time; masks cut the last
  // block at N.
  const int width = n - n0 < kFeatures ? n - n0 : kFeatures;
  const __mmask16 mlo = static_cast<__mmask16>(width >= 16 ? 0xffff : (1u << width) - 1);
  const int high = width - 16;
  const __mmask16 mhi = static_cast<__mmask16>(high >= 16 ? 0xffff : high <= 0 ? 0 : (1u << high) - 1);
  __m512 blo = _mm512_setzero_ps(), bhi = _mm512_setzero_ps();
  if (ep.bias != nullptr) {
    blo = widen16(_mm256_maskz_loadu_epi16(mlo, ep.bias + n0));
    bhi = widen16(_mm256_maskz_loadu_epi16(mhi, ep.bias + n0 + 16));
  }
  for (int r = 0; r < R; ++r) {
    const int64_t at = static_cast<int64_t>(m0 + r) * n + n0;
    __m256i vlo = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(lo[r], blo));
    __m256i vhi = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(hi[r], bhi));
    if (ep.residual != nullptr) {
      const __m512 rlo = widen16(_mm256_maskz_loadu_epi16(mlo, ep.residual + at));
      const __m512 rhi = widen16(_mm256_maskz_loadu_epi16(mhi, ep.residual + at + 16));
      vlo = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(widen16(vlo), rlo));
      vhi = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(widen16(vhi), rhi));
    }
    _mm256_mask_storeu_epi16(out + at, mlo, vlo);
    _mm256_mask_storeu_epi16(out + at + 16, mhi, vhi);
  }
}

void block(const uint16_t* x, const uint16_t* wp, const Epilogue& ep, uint16_t* out, int m,
           int n0, int n, int k, const uint16_t* next) {
  const int parts = (m + kRows - 1) / kRows;
  int m0 = 0;
  for (; m0 + kRows <= m; m0 += kRows) {
    tile<kRows>(x, wp, ep, out, m0, n0, n, k, next, m0 / kRows, parts);
  }
  switch (m - m0) {
    case 1: tile<1>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    case 2: tile<2>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    case 3: tile<3>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    case 4: tile<4>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    case 5: tile<5>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    case 6: tile<6>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    case 7: tile<7>(x, wp, ep, out, m0, n0, n, k, next, parts - 1, parts); break;
    default: break;
  }
}
#endif

}  // namespace

extern "C" {

int gemm_bf16_supported(int k) {
#ifdef RM_AVX512_BF16
  return k % 2 == 0;
#else
  (void)k;
  return 0;
#endif
}

// wp: the packed weight, N rounded up to a multiple of 32 features (zeros past N).
void gemm_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias,
               const uint16_t* residual, uint16_t* out, int m, int n, int k, int threads) {
#ifdef RM_AVX512_BF16
  const int blocks = (n + kFeatures - 1) / kFeatures;
  const int64_t block_elems = static_cast<int64_t>(kFeatures) * k;
  const Epilogue ep{bias, residual};
  // Guided: contiguous runs of blocks, shrinking toward the end, so that a thread the OS
  // takes away (another process on these cores: the mesh's services, a client) leaves its
  // last blocks to the others instead of holding up the whole step.
#pragma omp parallel for schedule(guided) num_threads(threads)
  for (int b = 0; b < blocks; ++b) {
    block(x, wp + b * block_elems, ep, out, m, b * kFeatures, n, k,
          b + 1 < blocks ? wp + (b + 1) * block_elems : nullptr);
  }
#else
  (void)x, (void)wp, (void)bias, (void)residual, (void)out, (void)m, (void)n, (void)k, (void)threads;
#endif
}

}  // extern "C"
