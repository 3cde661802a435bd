// Linear layer for one or two rows on the CPU: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16.
//
// Decoding a few requests reads every weight once per step for very few rows of x, so the
// step is bound by memory bandwidth: each weight row is streamed once and multiplied by
// all M rows of x while it is in registers. Threads split the output features. Needs
// AVX512-BF16 and K a multiple of 32; linear_bf16_supported() says whether this build has it.
#include <cstdint>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RM_AVX512_BF16 1
#endif

namespace {

// Past two rows oneDNN's packed GEMM is as fast or faster (measured).
constexpr int kMaxRows = 2;
constexpr int kBlock = 16;  // output features per task

#ifdef RM_AVX512_BF16
using radixmesh::load;
using radixmesh::to_bf16;

template <int M>
void rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int n0,
          int n1, int n, int k) {
  for (int j = n0; j < n1; ++j) {
    const uint16_t* wr = w + static_cast<int64_t>(j) * k;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int d = 0; d < k; d += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + d);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + d);
        acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
      }
    }
    const float b = bias ? load(bias[j]) : 0.0f;
    for (int m = 0; m < M; ++m) {
      out[static_cast<int64_t>(m) * n + j] = to_bf16(_mm512_reduce_add_ps(acc[m]) + b);
    }
  }
}

template <int M>
void run(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int n,
         int k, int threads) {
  const int blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int blk = 0; blk < blocks; ++blk) {
    const int n0 = blk * kBlock;
    const int n1 = n0 + kBlock < n ? n0 + kBlock : n;
    rows<M>(x, w, bias, out, n0, n1, n, k);
  }
}
#endif

}  // namespace

extern "C" {

int linear_bf16_supported(int m, int k) {
#ifdef RM_AVX512_BF16
  return m >= 1 && m <= kMaxRows && k % 32 == 0;
#else
  (void)m;
  (void)k;
  return 0;
#endif
}

void linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                 int m, int n, int k, int threads) {
#ifdef RM_AVX512_BF16
  switch (m) {
    case 1: run<1>(x, w, bias, out, n, k, threads); break;
    case 2: run<2>(x, w, bias, out, n, k, threads); break;
    default: break;
  }
#else
  (void)x, (void)w, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)threads;
#endif
}

}  // extern "C"
