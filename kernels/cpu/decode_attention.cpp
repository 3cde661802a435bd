// Decode attention on the CPU: one query token per row of q over its K/V rows in the pool.
//
// q [B, Hq, D] and out [B, Hq, D] are contiguous; each pool is [slots, Hkv, D], contiguous;
// query b reads index row b (rows `width` apart; width 0: every query shares row 0) up to
// lens[b] slots. Query head j reads KV head j / (Hq / Hkv). Softmax runs in float32; bf16
// values are widened to float32 (exact) and rounded to nearest-even on store, as torch
// does. A request's prompt tokens run here too: width 0 over its slots, lens prefix+1..
// prefix+n (native.extend_attention).
//
// bf16 with D a multiple of 32 (up to 256) and up to 8 query heads per KV head takes the
// AVX512-BF16 path: per (request, KV head), each K and V row of that head is read once for
// all of its query heads. Scores of 16 keys are summed at once (sum16x16), exp is
// vectorized, and the weighted sum of V takes two keys per VDPBF16PS: the softmax weights
// are rounded to bf16 there (as flash attention rounds them on GPUs), V rows go in as
// stored.
// Everything else takes the portable path: a key at a time, a task per request (or per
// request and KV head when there are few), AVX2 dot products and exp for bf16 where the CPU
// has them.
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "entry.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RM_AVX512_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RM_AVX2 1
#endif

namespace {

using radixmesh::load;
using radixmesh::store;

// Rows are scattered over the pool: fetch this many ahead so their cache misses overlap.
constexpr int kAhead = 16;

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

#if defined(RM_AVX512_BF16) || defined(RM_AVX2)
// The vector dot and axpy below take head dims in whole vectors; these, the rest, in order.
float dot_scalar(const uint16_t* a, const uint16_t* b, int dim) {
  float sum = 0.0f;
  for (int d = 0; d < dim; ++d) sum += load(a[d]) * load(b[d]);
  return sum;
}

void axpy_scalar(float* acc, float p, const uint16_t* row, int dim) {
  for (int d = 0; d < dim; ++d) acc[d] += p * load(row[d]);
}
#endif

#ifdef RM_AVX512_BF16
template <>
float dot(const uint16_t* a, const uint16_t* b, int dim) {
  if (dim % 32 != 0) return dot_scalar(a, b, dim);
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
  if (dim % 16 != 0) return axpy_scalar(acc, p, row, dim);
  const __m512 scale = _mm512_set1_ps(p);
  for (int d = 0; d < dim; d += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(scale, x, _mm512_loadu_ps(acc + d)));
  }
}
#elif defined(RM_AVX2)
template <>
float dot(const uint16_t* a, const uint16_t* b, int dim) {
  if (dim % 16 != 0) return dot_scalar(a, b, dim);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int d = 0; d < dim; d += 16) {
    acc0 = _mm256_fmadd_ps(radixmesh::load8(a + d), radixmesh::load8(b + d), acc0);
    acc1 = _mm256_fmadd_ps(radixmesh::load8(a + d + 8), radixmesh::load8(b + d + 8), acc1);
  }
  return radixmesh::sum8(_mm256_add_ps(acc0, acc1));
}

template <>
void axpy(float* acc, float p, const uint16_t* row, int dim) {
  if (dim % 8 != 0) return axpy_scalar(acc, p, row, dim);
  const __m256 scale = _mm256_set1_ps(p);
  for (int d = 0; d < dim; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(scale, radixmesh::load8(row + d),
                                              _mm256_loadu_ps(acc + d)));
  }
}

#endif

// s[0, len) = e^(s - top), summed. bf16 on AVX2 takes the vector exp (exp8); float32 keeps
// std::exp, which its exactness tests compare against.
template <typename T>
float exp_sum(float* s, int len, float top) {
  float total = 0.0f;
  int l = 0;
#ifdef RM_AVX2
  if constexpr (sizeof(T) == 2) {
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; l + 8 <= len; l += 8) {
      const __m256 e = radixmesh::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), vtop));
      _mm256_storeu_ps(s + l, e);
      sum = _mm256_add_ps(sum, e);
    }
    total = radixmesh::sum8(sum);
  }
#endif
  for (; l < len; ++l) {
    s[l] = std::exp(s[l] - top);
    total += s[l];
  }
  return total;
}

// Prefetch every cache line of one slot's row span into L2 (not L1: L2 tracks more misses at
// once, which is what scattered rows need; measured 1.2-1.4x over L1 prefetches).
template <typename T>
inline void prefetch_row(const T* row, int elems) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int off = 0; off < elems * static_cast<int>(sizeof(T)); off += 64) {
    __builtin_prefetch(p + off, 0, 2);
  }
}

// One request, the query heads of KV heads h0..h1-1: K rows then V rows, each slot's span of
// those heads read once.
template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* slots, int len, T* out,
            int hq, int hkv, int dim, float scale, int h0, int h1) {
  const int group = hq / hkv;
  const int row_elems = hkv * dim;
  const int j0 = h0 * group, heads = (h1 - h0) * group;
  const int span = (h1 - h0) * dim;
  q += j0 * dim;
  out += j0 * dim;
  std::vector<float> scores(static_cast<size_t>(heads) * len);
  std::vector<float> acc(static_cast<size_t>(heads) * dim, 0.0f);
  std::vector<float> total(heads, 0.0f);
  for (int l = 0; l < len; ++l) {
    if (l + kAhead < len) prefetch_row(k + slots[l + kAhead] * row_elems + h0 * dim, span);
    const T* row = k + slots[l] * row_elems;
    for (int j = 0; j < heads; ++j) {
      scores[static_cast<size_t>(j) * len + l] =
          dot(q + j * dim, row + ((j0 + j) / group) * dim, dim) * scale;
    }
  }
  for (int j = 0; j < heads; ++j) {
    float* s = scores.data() + static_cast<size_t>(j) * len;
    float top = -INFINITY;
    for (int l = 0; l < len; ++l) top = s[l] > top ? s[l] : top;
    total[j] = exp_sum<T>(s, len, top);
  }
  for (int l = 0; l < len; ++l) {
    if (l + kAhead < len) prefetch_row(v + slots[l + kAhead] * row_elems + h0 * dim, span);
    const T* row = v + slots[l] * row_elems;
    for (int j = 0; j < heads; ++j) {
      axpy(acc.data() + j * dim, scores[static_cast<size_t>(j) * len + l],
           row + ((j0 + j) / group) * dim, dim);
    }
  }
  for (int j = 0; j < heads; ++j) {
    const float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;
    for (int d = 0; d < dim; ++d) store(out + j * dim + d, acc[j * dim + d] * inv);
  }
}

#ifdef RM_AVX512_BF16
constexpr int kMaxGroup = 8;   // query heads per KV head on the fast path
constexpr int kMaxChunks = 16; // D / 16 on the fast path

// One request's query heads [g, D] over one KV head (at `head` within each pool row);
// `fetch` elements of each row from `head` on are prefetched ahead.
template <int C>  // C = D / 16
void attend_head(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                 const int64_t* slots, int len, uint16_t* out, int g, int row_elems,
                 int head, int fetch, float scale) {
  constexpr int dim = C * 16;
  const int padded = (len + 15) & ~15;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(g) * padded);
  float* scores = buffer.data();
  __m512bh qv[kMaxGroup][C / 2];
  for (int j = 0; j < g; ++j) {
    for (int c = 0; c < C / 2; ++c) {
      qv[j][c] = (__m512bh)_mm512_loadu_si512(q + j * dim + 32 * c);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 part[kMaxGroup][16];
  for (int l0 = 0; l0 < len; l0 += 16) {
    const int n = len - l0 < 16 ? len - l0 : 16;
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        for (int j = 0; j < g; ++j) part[j][i] = _mm512_setzero_ps();
        continue;
      }
      const int l = l0 + i;
      if (l + kAhead < len) prefetch_row(k + slots[l + kAhead] * row_elems + head, fetch);
      const uint16_t* row = k + slots[l] * row_elems + head;
      __m512bh kv[C / 2];
      for (int c = 0; c < C / 2; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
      for (int j = 0; j < g; ++j) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < C / 2; ++c) acc = _mm512_dpbf16_ps(acc, qv[j][c], kv[c]);
        part[j][i] = acc;
      }
    }
    for (int j = 0; j < g; ++j) {
      _mm512_storeu_ps(scores + j * padded + l0,
                       _mm512_mul_ps(radixmesh::sum16x16(part[j]), vscale));
    }
  }
  // Softmax numerators in place; keys past len are masked off.
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - (padded - 16))) - 1);
  float inv[kMaxGroup];
  for (int j = 0; j < g; ++j) {
    float* s = scores + j * padded;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int l = 0; l < padded; l += 16) {
      const __mmask16 m = l + 16 <= len ? 0xffff : tail;
      top = _mm512_mask_max_ps(top, m, top, _mm512_loadu_ps(s + l));
    }
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int l = 0; l < padded; l += 16) {
      const __mmask16 m = l + 16 <= len ? 0xffff : tail;
      const __m512 e = _mm512_maskz_mov_ps(
          m, radixmesh::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), vtop)));
      _mm512_storeu_ps(s + l, e);
      total = _mm512_add_ps(total, e);
    }
    const float sum = _mm512_reduce_add_ps(total);
    inv[j] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // P as bf16, two keys to a 32-bit pair (zeros past len), and V two rows at a time,
  // interleaved so that one VDPBF16PS adds both keys' terms for 16 dims: accumulator
  // 2c + s of a head holds dims 32c + 8i + 4s + t in lane 4i + t.
  const int pairs = (len + 1) / 2, pstride = padded / 2;
  thread_local std::vector<uint32_t> pbuf;
  pbuf.resize(static_cast<size_t>(g) * pstride);
  for (int j = 0; j < g; ++j) {
    const float* s = scores + j * padded;
    uint16_t* pj = reinterpret_cast<uint16_t*>(pbuf.data() + j * pstride);
    for (int l = 0; l < padded; l += 16) {
      radixmesh::store16(pj + l, _mm512_mul_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(inv[j])));
    }
  }
  __m512 acc[kMaxGroup][C];
  for (int j = 0; j < g; ++j) {
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < pairs; ++i) {
    const int l = 2 * i;
    if (l + kAhead < len) prefetch_row(v + slots[l + kAhead] * row_elems + head, fetch);
    if (l + 1 + kAhead < len) prefetch_row(v + slots[l + 1 + kAhead] * row_elems + head, fetch);
    const uint16_t* a = v + slots[l] * row_elems + head;
    const uint16_t* b = l + 1 < len ? v + slots[l + 1] * row_elems + head : nullptr;
    for (int c = 0; c < C / 2; ++c) {
      const __m512i va = _mm512_loadu_si512(a + 32 * c);
      const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(va, vb);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(va, vb);
      for (int j = 0; j < g; ++j) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pbuf[j * pstride + i]));
        acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], p, lo);
        acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], p, hi);
      }
    }
  }
  // Back to dim order: dims 32c .. 32c + 15 from lanes 0-7 of both accumulators, then 16-31.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int j = 0; j < g; ++j) {
    for (int c = 0; c < C / 2; ++c) {
      radixmesh::store16(out + j * dim + 32 * c,
                         _mm512_permutex2var_ps(acc[j][2 * c], first, acc[j][2 * c + 1]));
      radixmesh::store16(out + j * dim + 32 * c + 16,
                         _mm512_permutex2var_ps(acc[j][2 * c], second, acc[j][2 * c + 1]));
    }
  }
}

using HeadFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*, int,
                        uint16_t*, int, int, int, int, float);

HeadFn head_fn(int dim) {
  switch (dim) {
    case 32: return attend_head<2>;
    case 64: return attend_head<4>;
    case 96: return attend_head<6>;
    case 128: return attend_head<8>;
    case 160: return attend_head<10>;
    case 192: return attend_head<12>;
    case 224: return attend_head<14>;
    case 256: return attend_head<kMaxChunks>;
    default: return nullptr;
  }
}

// The fast path, if it takes this shape; false leaves the work to the portable one.
bool decode_fast(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* index,
                 const int64_t* lens, uint16_t* out, int batch, int width, int hq, int hkv,
                 int dim, float scale, int threads) {
  const int group = hq / hkv;
  const HeadFn fn = head_fn(dim);
  if (fn == nullptr || group > kMaxGroup) return false;
  const int row_elems = hkv * dim;
  // A task per request, its KV heads in turn: the first fetches whole rows into cache for
  // the rest. With too few requests to share out, a task per (request, KV head) instead.
  const int heads = batch >= 2 * threads ? hkv : 1;
  const int per_request = hkv / heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int task = 0; task < batch * per_request; ++task) {
    const int b = task / per_request, h0 = task % per_request * heads;
    for (int h = h0; h < h0 + heads; ++h) {
      const int64_t first = (static_cast<int64_t>(b) * hq + h * group) * dim;
      fn(q + first, k, v, index + static_cast<int64_t>(b) * width, static_cast<int>(lens[b]),
         out + first, group, row_elems, h * dim, heads > 1 && h == 0 ? row_elems : dim, scale);
    }
  }
  return true;
}
#endif

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* index, const int64_t* lens,
            T* out, int batch, int width, int hq, int hkv, int dim, float scale,
            int threads) {
  // A task per request; with too few requests to share out, a task per (request, KV head).
  const int parts = batch >= 2 * threads ? 1 : hkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int task = 0; task < batch * parts; ++task) {
    const int b = task / parts, h0 = task % parts * (hkv / parts);
    const int64_t first = static_cast<int64_t>(b) * hq * dim;
    attend(q + first, k, v, index + static_cast<int64_t>(b) * width, static_cast<int>(lens[b]),
           out + first, hq, hkv, dim, scale, h0, h0 + hkv / parts);
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
#ifdef RM_AVX512_BF16
  if (decode_fast(q, k, v, index, lens, out, batch, width, hq, hkv, dim, scale, threads)) return;
#endif
  decode(q, k, v, index, lens, out, batch, width, hq, hkv, dim, scale, threads);
}

}  // extern "C"
