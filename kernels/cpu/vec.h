// Vector helpers shared by the native CPU kernels. AVX-512: exp, 16-way horizontal sums, bf16
// loads and stores of 16 floats. AVX2: exp of 8 floats, 8 bf16 values widened, a horizontal
// sum.
#pragma once

namespace radixmesh {

// e^x = 2^n * e^r, n = round(x / ln 2): ln 2 in two parts (r = x - n ln 2 without losing
// bits), and e^r's degree-6 Taylor coefficients, highest first.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpTaylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

}  // namespace radixmesh

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>

namespace radixmesh {

// e^x for 16 floats: 2^n * e^r with |r| <= ln(2) / 2 (relative error ~1e-7). NaN stays NaN;
// e^-inf is 0, e^inf is inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // max/min return x when it is NaN
  x = _mm512_min_ps(_mm512_set1_ps(200.0f), x);  // beyond 88.7: +inf from scalef
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// Element i of the result is the sum of v[i]'s 16 elements (v[0..15] are overwritten).
inline __m512 sum16x16(__m512* v) {
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                       _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// 16 bf16 values -> 16 floats (exact).
inline __m512 widen16(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

inline __m512 load16(const uint16_t* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats -> 16 bf16 values, rounded to nearest-even.
inline void store16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

}  // namespace radixmesh

#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BF16__))
#include <immintrin.h>

#include <cstdint>

namespace radixmesh {

// e^x for 8 floats, as exp16 (2^n * e^r, degree-6 Taylor polynomial): x is held to
// [-87.3, 88.7] so that 2^n is a normal float built in its exponent bits (below, e^x is
// ~1e-38 rather than 0 or a subnormal; above, it would overflow anyway). NaN stays NaN.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // max/min return x when it is NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// 8 bf16 values -> 8 floats (exact).
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace radixmesh

#endif
