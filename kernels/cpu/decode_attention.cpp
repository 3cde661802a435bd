// Decode attention on the CPU: one query token per request over its K/V rows in the pool.
//
// q [B, Hq, D] and out [B, Hq, D] are contiguous; each pool is [slots, Hkv, D], contiguous;
// index [B, W] lists each request's slots (the first lens[b] are live). Query head j reads
// KV head j / (Hq / Hkv). One task per request reads each of its K rows once
// and each V row once, whole (every KV head), for all of its query heads; softmax runs in
// float32.
// bf16 values are widened to float32 (exact) and rounded to nearest-even on store, as
// torch does. With AVX512-BF16 the bf16 dot products run on VDPBF16PS.
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RM_AVX512_BF16 1
#endif

namespace {

using radixmesh::load;
using radixmesh::store;

// Rows are scattered over the pool: fetch this many ahead so their cache misses overlap.
constexpr int kAhead = 8;

template <typename T>
float dot(const T* a, const T* b, int dim) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < dim; ++d) sum += load(a[d]) * load(b[d]);
  return sum;
}

// acc[0, dim) += p * row
template <typename T>
void axpy(float* acc, float p, const T* row, int dim) {
#pragma omp simd
  for (int d = 0; d < dim; ++d) acc[d] += p * load(row[d]);
}

#ifdef RM_AVX512_BF16
template <>
float dot(const uint16_t* a, const uint16_t* b, int dim) {
  if (dim % 32 != 0) {
    float sum = 0.0f;
    for (int d = 0; d < dim; ++d) sum += load(a[d]) * load(b[d]);
    return sum;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int d = 0; d < dim; d += 32) {
    const __m512i x = _mm512_loadu_si512(a + d);
    const __m512i y = _mm512_loadu_si512(b + d);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
  }
  return _mm512_reduce_add_ps(acc);
}

template <>
void axpy(float* acc, float p, const uint16_t* row, int dim) {
  if (dim % 16 != 0) {
    for (int d = 0; d < dim; ++d) acc[d] += p * load(row[d]);
    return;
  }
  const __m512 scale = _mm512_set1_ps(p);
  for (int d = 0; d < dim; d += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(scale, x, _mm512_loadu_ps(acc + d)));
  }
}
#endif

// Prefetch every cache line of one slot's K or V row (all KV heads).
template <typename T>
inline void prefetch_row(const T* row, int elems) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int off = 0; off < elems * static_cast<int>(sizeof(T)); off += 64) {
    __builtin_prefetch(p + off);
  }
}

// One request, every query head: K rows then V rows, each slot's row read once in full.
template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* slots, int len, T* out,
            int hq, int hkv, int dim, float scale) {
  const int group = hq / hkv;
  const int row_elems = hkv * dim;
  std::vector<float> scores(static_cast<size_t>(hq) * len);
  std::vector<float> acc(static_cast<size_t>(hq) * dim, 0.0f);
  std::vector<float> total(hq, 0.0f);
  for (int l = 0; l < len; ++l) {
    if (l + kAhead < len) prefetch_row(k + slots[l + kAhead] * row_elems, row_elems);
    const T* row = k + slots[l] * row_elems;
    for (int j = 0; j < hq; ++j) {
      scores[static_cast<size_t>(j) * len + l] =
          dot(q + j * dim, row + (j / group) * dim, dim) * scale;
    }
  }
  for (int j = 0; j < hq; ++j) {
    float* s = scores.data() + static_cast<size_t>(j) * len;
    float top = -INFINITY;
    for (int l = 0; l < len; ++l) top = s[l] > top ? s[l] : top;
    for (int l = 0; l < len; ++l) {
      s[l] = std::exp(s[l] - top);
      total[j] += s[l];
    }
  }
  for (int l = 0; l < len; ++l) {
    if (l + kAhead < len) prefetch_row(v + slots[l + kAhead] * row_elems, row_elems);
    const T* row = v + slots[l] * row_elems;
    for (int j = 0; j < hq; ++j) {
      axpy(acc.data() + j * dim, scores[static_cast<size_t>(j) * len + l],
           row + (j / group) * dim, dim);
    }
  }
  for (int j = 0; j < hq; ++j) {
    const float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;
    for (int d = 0; d < dim; ++d) store(out + j * dim + d, acc[j * dim + d] * inv);
  }
}

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* index, const int64_t* lens,
            T* out, int batch, int width, int hq, int hkv, int dim, float scale,
            int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int b = 0; b < batch; ++b) {
    const int64_t first = static_cast<int64_t>(b) * hq * dim;
    attend(q + first, k, v, index + static_cast<int64_t>(b) * width, static_cast<int>(lens[b]),
           out + first, hq, hkv, dim, scale);
  }
}

}  // namespace

extern "C" {

void decode_attention_f32(const float* q, const float* k, const float* v, const int64_t* index,
                          const int64_t* lens, float* out, int batch, int width, int hq,
                          int hkv, int dim, float scale, int threads) {
  decode(q, k, v, index, lens, out, batch, width, hq, hkv, dim, scale, threads);
}

void decode_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                           const int64_t* index, const int64_t* lens, uint16_t* out,
                           int batch, int width, int hq, int hkv, int dim, float scale,
                           int threads) {
  decode(q, k, v, index, lens, out, batch, width, hq, hkv, dim, scale, threads);
}

}  // extern "C"
