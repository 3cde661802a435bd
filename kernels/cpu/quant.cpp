// GEMM over weights kept in a GGUF block quantization: out[M, N] = x[M, K] @ w[N, K]^T
// (+ bias) (+ residual[M, N], after rounding, as gemm.cpp adds it), every batch size.
//
// Each weight value is scale * (u - zero) + min: u an unsigned 4- or 8-bit integer, scale
// and min per block of 16 or 32 inputs, zero a constant of the type (native_quant.py turns
// each GGUF type into this form without loss). x is quantized per row and block of 32 inputs
// to int8 with one float scale (quantize_rows_*), and the integer products of u and x run 64
// at a time (AVX512-VNNI), 32 (AVX2) or one by one (any CPU). As in gemm.cpp, vector lanes
// hold output features, so a block's sums need no horizontal add: each is taken off its zero
// point in integers (symmetric types lose nothing there), scaled into a float accumulator,
// and the min term uses x's exact float block sums.
//
// Packed weight, output features in groups of 16 (N padded with zero weights):
//   q      [N/16][K/32][chunks][16][4] bytes. 8 bits: chunk c (0..7) holds inputs 4c..4c+3
//          of the block; 4 bits: chunk c (0..3) holds inputs 4c..4c+3 in its low nibbles and
//          4c+16..4c+19 in its high ones.
//   scale  [N/16][K/block][16] float16 (types whose scales are float16 in the file) or float
//          (the K-quants, whose scales are products); min likewise, or null when the type
//          has none.
// Each row of every tile is computed alone, in the same order at any M: a request's output
// does not depend on the batch it runs in.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "entry.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RM_QUANT_ISA 3
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define RM_QUANT_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define RM_QUANT_ISA 1
#else
#define RM_QUANT_ISA 0
#endif

#if RM_QUANT_ISA > 0
#include <immintrin.h>
#endif

namespace {

using radixmesh::load;
using radixmesh::store;

// IEEE float16 -> float32, exact (subnormals, infinities and NaN included).
inline float half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, normalized
    int shift = 0;
    uint32_t m = man;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int kGroup = 16;  // output features per packed group
constexpr int kBlock = 32;  // inputs per block of quantized x

// x quantized: int8 values, a scale per 32 inputs, the sums of the int8 values per 16 inputs
// and of the original floats per 32.
struct Rows {
  int8_t* q;
  float* d;
  int32_t* isum;
  float* fsum;
  int m, k;

  Rows(void* buf, int m_, int k_) : m(m_), k(k_) {
    auto* p = static_cast<char*>(buf);
    const int64_t n = static_cast<int64_t>(m) * k;
    q = reinterpret_cast<int8_t*>(p);
    d = reinterpret_cast<float*>(p + n);
    isum = reinterpret_cast<int32_t*>(p + n + n / kBlock * 4);
    fsum = reinterpret_cast<float*>(p + n + n / kBlock * 4 + n / 16 * 4);  // [n / kBlock]
  }
};

// ---- instruction sets: lanes of int32 sums and float accumulators --------------------

#if RM_QUANT_ISA == 3
struct Isa {
  static constexpr int L = 16;
  static constexpr int kWideShift = 0;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I high(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  template <bool Wide>
  static I dot(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
  static I izero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F to_f(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F loadf(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F set(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif RM_QUANT_ISA >= 1
struct Isa {
  static constexpr int L = 8;
  // Without VNNI, wide bytes (above 127) go through the sign trick (block_dots), which
  // yields the sum of (u - 128) * x: the caller's zero point is shifted to match.
  static constexpr int kWideShift = RM_QUANT_ISA == 2 ? 0 : 128;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I low(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I high(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
#if RM_QUANT_ISA == 2
  template <bool Wide>
  static I dot(I acc, I u, I x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
#endif
  static I izero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F to_f(I v) { return _mm256_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F loadf(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F set(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#else
struct Isa {  // one feature at a time: its four bytes of a chunk in a uint32
  static constexpr int L = 1;
  static constexpr int kWideShift = 0;
  using I = int32_t;
  using F = float;
  static uint32_t load(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static uint32_t low(uint32_t v) { return v & 0x0f0f0f0fu; }
  static uint32_t high(uint32_t v) { return (v >> 4) & 0x0f0f0f0fu; }
  static const int8_t* bcast(const int8_t* p) { return p; }
  template <bool Wide>
  static I dot(I acc, uint32_t u, const int8_t* x) {
    for (int i = 0; i < 4; ++i) acc += static_cast<int32_t>((u >> (8 * i)) & 0xff) * x[i];
    return acc;
  }
  static I izero() { return 0; }
  static I add(I a, I b) { return a + b; }
  static I sub(I a, int32_t b) { return a - b; }
  static F fzero() { return 0.0f; }
  static F to_f(I v) { return static_cast<float>(v); }
  static F loadf(const float* p) { return *p; }
  static F loadf(const uint16_t* p) { return half(*p); }
  static F set(float v) { return v; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static void storef(float* p, F v) { *p = v; }
};
#endif

constexpr int kTileRows = Isa::L == 16 ? 8 : 4;

// 4-byte chunks of 16 features per 32-input block: 4 bits hold two quads a byte.
constexpr int chunks(int bits) { return bits == 4 ? 4 : 8; }

// Where a tile's sums go: out = (sum + bias), rounded to the output type, + residual
// (rounded again), bf16 or float32 alike.
struct Epilogue {
  const void* bias;      // [N] or null
  const void* residual;  // [M, ldo] or null
  void* out;             // [M, ldo]
  int ldo;
  bool bf16;

  template <typename T>
  void store_row(const float* sums, int64_t at, int n0, int width) const {
    const T* b = static_cast<const T*>(bias);
    const T* res = static_cast<const T*>(residual);
    T* o = static_cast<T*>(out);
    for (int f = 0; f < width; ++f) {
      const float v = b == nullptr ? sums[f] : sums[f] + load(b[n0 + f]);
      if (res == nullptr) {
        store(o + at + f, v);
      } else {
        T rounded;
        store(&rounded, v);
        store(o + at + f, load(rounded) + load(res[at + f]));
      }
    }
  }

  void row(const float* sums, int m, int n0, int width) const {
    const int64_t at = static_cast<int64_t>(m) * ldo + n0;
    if (bf16) {
      store_row<uint16_t>(sums, at, n0, width);
    } else {
      store_row<float>(sums, at, n0, width);
    }
  }
};

#if RM_QUANT_ISA == 1
// AVX2 without VNNI: VPMADDUBSW gives 16-bit sums of two products, and VPMADDWD (by ones)
// widens them. Where the values are narrow, several products' 16-bit sums are added before
// one widening (u < 16: all eight of a 4-bit block, 16 products a lane, |sum| <= 30480; u <
// 32: four; u < 64: two), so a block costs about half the multiplies. Wide bytes (Q8_0) go
// through the sign trick, the weight's half of it once per chunk for all the rows.
template <int R, int Bits, int Sub, bool Wide, int kSets>
inline void block_dots(const uint8_t* q, const int8_t* const* xq, int j, int s,
                       __m256i (&ia)[kSets][R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    __m256i p[R];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = Isa::load(q + c * 64);
      const __m256i lo = Isa::low(v), hi = Isa::high(v);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = xq[r] + j * kBlock + 4 * c;
        const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, Isa::bcast(xb)),
                                              _mm256_maddubs_epi16(hi, Isa::bcast(xb + 16)));
        p[r] = c == 0 ? both : _mm256_add_epi16(p[r], both);
      }
    }
    for (int r = 0; r < R; ++r) ia[0][r] = _mm256_madd_epi16(p[r], ones);
  } else if constexpr (Wide) {
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_xor_si256(Isa::load(q + c * 64), _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i mag = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_sign_epi8(Isa::bcast(xq[r] + j * kBlock + 4 * c), w);
        ia[c % kSets][r] = _mm256_add_epi32(ia[c % kSets][r],
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(mag, x), ones));
      }
    }
  } else {
    constexpr int kPer = 8 / Sub;
    constexpr int kRun = Sub == 2 ? 2 : 4;  // chunks whose 16-bit sums cannot overflow
    for (int c0 = s * kPer; c0 < (s + 1) * kPer; c0 += kRun) {
      __m256i p[R];
      for (int c = c0; c < c0 + kRun; ++c) {
        const __m256i v = Isa::load(q + c * 64);
        for (int r = 0; r < R; ++r) {
          const __m256i d = _mm256_maddubs_epi16(v, Isa::bcast(xq[r] + j * kBlock + 4 * c));
          p[r] = c == c0 ? d : _mm256_add_epi16(p[r], d);
        }
      }
      for (int r = 0; r < R; ++r) ia[0][r] = _mm256_add_epi32(ia[0][r], _mm256_madd_epi16(p[r], ones));
    }
  }
}
#else
// The integer dot products of block j (sub-block s) for R rows, into ia.
template <int R, int Bits, int Sub, bool Wide, int kSets>
inline void block_dots(const uint8_t* q, const int8_t* const* xq, int j, int s,
                       typename Isa::I (&ia)[kSets][R]) {
  using I = typename Isa::I;
  if constexpr (Bits == 4) {
    for (int c = 0; c < 4; ++c) {
      const auto v = Isa::load(q + c * 64);
      const auto lo = Isa::low(v), hi = Isa::high(v);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = xq[r] + j * kBlock + 4 * c;
        ia[0][r] = Isa::template dot<false>(ia[0][r], lo, Isa::bcast(xb));
        ia[kSets - 1][r] = Isa::template dot<false>(ia[kSets - 1][r], hi, Isa::bcast(xb + 16));
      }
    }
  } else {
    constexpr int kPer = 8 / Sub;
    for (int c = s * kPer; c < (s + 1) * kPer; ++c) {
      const auto v = Isa::load(q + c * 64);
      for (int r = 0; r < R; ++r) {
        I& a = ia[c % kSets][r];
        a = Isa::template dot<Wide>(a, v, Isa::bcast(xq[r] + j * kBlock + 4 * c));
      }
    }
  }
}
#endif

// Rows m0..m0+R-1 of x against features h*L .. h*L+L-1 of group g, whose packed values
// start at q (in w, or unpacked to 8 bits).
template <int R, int Bits, int Sub, bool Wide, bool Min, typename S>
void tile(const QuantWeight& w, const uint8_t* q, const Rows& x, int g, int h, int m0,
          const Epilogue& ep) {
  using I = typename Isa::I;
  using F = typename Isa::F;
  constexpr int L = Isa::L;
  constexpr int kChunks = chunks(Bits);
  constexpr int kSets = R <= 2 ? 2 : 1;  // independent integer chains for short tiles
  static_assert(!(Min && Sub == 2), "x's float sums are kept per 32 inputs");
  const int kb = w.k / kBlock;
  const int zero = w.zero - (Wide ? Isa::kWideShift : 0);
  q += h * L * 4;
  const int64_t scale_at = static_cast<int64_t>(g) * kb * Sub * kGroup + h * L;
  const S* sc = static_cast<const S*>(w.scale) + scale_at;
  const S* mn = Min ? static_cast<const S*>(w.min) + scale_at : nullptr;
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q + static_cast<int64_t>(m0 + r) * x.k;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Isa::fzero();
  for (int j = 0; j < kb; ++j, q += kChunks * 64) {
    for (int s = 0; s < Sub; ++s, sc += kGroup) {
      I ia[kSets][R];
      for (int t = 0; t < kSets; ++t)
        for (int r = 0; r < R; ++r) ia[t][r] = Isa::izero();
      block_dots<R, Bits, Sub, Wide, kSets>(q, xq, j, s, ia);
      const F scale = Isa::loadf(sc);
      for (int r = 0; r < R; ++r) {
        const int64_t block = static_cast<int64_t>(m0 + r) * kb + j;
        I total = kSets == 2 ? Isa::add(ia[0][r], ia[1][r]) : ia[0][r];
        if (!Min && zero != 0) {  // the types with a min have no zero point
          const int32_t* is = x.isum + block * 2;
          total = Isa::sub(total, zero * (Sub == 2 ? is[s] : is[0] + is[1]));
        }
        acc[r] = Isa::fma(Isa::to_f(total), Isa::mul(scale, Isa::set(x.d[block])), acc[r]);
        if constexpr (Min) acc[r] = Isa::fma(Isa::loadf(mn), Isa::set(x.fsum[block]), acc[r]);
      }
      if constexpr (Min) mn += kGroup;
    }
  }
  float lanes[L];
  const int n0 = g * kGroup + h * L;
  const int width = w.n - n0 < L ? w.n - n0 : L;
  for (int r = 0; r < R; ++r) {
    Isa::storef(lanes, acc[r]);
    ep.row(lanes, m0 + r, n0, width);
  }
}

// Every row against group g (values at q): tiles of kTileRows rows, then of 4, 2 and 1.
template <int Bits, int Sub, bool Wide, bool Min, typename S>
void rows(const QuantWeight& w, const uint8_t* q, const Rows& x, int g, const Epilogue& ep) {
  for (int h = 0; h < kGroup / Isa::L; ++h) {
    int m0 = 0;
    for (; m0 + kTileRows <= x.m; m0 += kTileRows) {
      tile<kTileRows, Bits, Sub, Wide, Min, S>(w, q, x, g, h, m0, ep);
    }
    if (kTileRows > 4 && m0 + 4 <= x.m) {
      tile<4, Bits, Sub, Wide, Min, S>(w, q, x, g, h, m0, ep);
      m0 += 4;
    }
    if (m0 + 2 <= x.m) {
      tile<2, Bits, Sub, Wide, Min, S>(w, q, x, g, h, m0, ep);
      m0 += 2;
    }
    if (m0 < x.m) tile<1, Bits, Sub, Wide, Min, S>(w, q, x, g, h, m0, ep);
  }
}

// With VNNI, a 4-bit group that several row tiles pass over is unpacked once to the 8-bit
// layout (chunk c's low nibbles become chunk c, its high ones chunk c + 4) rather than in
// every tile. The integer sums are the same either way, so the output does not change.
constexpr bool kUnpackOnce = RM_QUANT_ISA >= 2;

const uint8_t* unpack_group(const QuantWeight& w, int g) {
  thread_local std::vector<uint8_t> wide;
  const int kb = w.k / kBlock;
  wide.resize(static_cast<size_t>(kb) * chunks(8) * 64);
  const uint8_t* q = w.q + static_cast<int64_t>(g) * kb * chunks(4) * 64;
  for (int j = 0; j < kb * chunks(4); ++j) {
    const uint8_t* in = q + j * 64;
    uint8_t* out = wide.data() + (j / 4 * 8 + j % 4) * 64;
    for (int i = 0; i < 64; ++i) {
      out[i] = in[i] & 15;
      out[i + 4 * 64] = in[i] >> 4;
    }
  }
  return wide.data();
}

template <int Bits, int Sub, bool Wide, bool Min, typename S>
void features(const QuantWeight& w, const Rows& x, int g, const Epilogue& ep) {
  const int kb = w.k / kBlock;
  if (Bits == 4 && kUnpackOnce && x.m >= 2 * kTileRows) {
    rows<8, Sub, Wide, Min, S>(w, unpack_group(w, g), x, g, ep);
  } else {
    rows<Bits, Sub, Wide, Min, S>(w, w.q + static_cast<int64_t>(g) * kb * chunks(Bits) * 64, x, g,
                                  ep);
  }
}

using GroupFn = void (*)(const QuantWeight&, const Rows&, int, const Epilogue&);

// The formats native_quant.py packs: 4 bits (Q4_0, Q4_1, Q4_K), 8 bits per 32 (Q8_0: wide;
// Q5_0, Q5_1, Q5_K) and 8 bits per 16 (Q6_K), with float16 or float scales.
template <typename S>
GroupFn pick_scales(const QuantWeight& w) {
  const bool min = w.min != nullptr;
  if (w.bits == 4) return min ? features<4, 1, false, true, S> : features<4, 1, false, false, S>;
  if (w.block == 16) return features<8, 2, false, false, S>;
  if (w.zero >= 128) return features<8, 1, true, false, S>;
  return min ? features<8, 1, false, true, S> : features<8, 1, false, false, S>;
}

void gemm(const void* xbuf, int m, const QuantWeight* w, const Epilogue& ep, int threads) {
  const Rows x(const_cast<void*>(xbuf), m, w->k);
  const GroupFn fn = w->half_scales ? pick_scales<uint16_t>(*w) : pick_scales<float>(*w);
  const int groups = (w->n + kGroup - 1) / kGroup;
  // Guided, as gemm_bf16's blocks: a thread taken away leaves its last groups to the others.
#pragma omp parallel for schedule(guided) num_threads(threads)
  for (int g = 0; g < groups; ++g) fn(*w, x, g, ep);
}

// One row of 32-input blocks: int8 values rounded to nearest-even, the block's scale, the
// int8 sums per 16 (quantize_row) and the float sum (float_sums). The vector paths round the
// same products the same way (the default rounding mode is nearest-even), and the float sums
// are added in one order everywhere, one input after another per 16: every path stores the
// same bytes.

// N blocks' sums at once: 2N independent chains of adds keep the adder busy.
template <int N>
void float_sums(const float* x, float* fsum) {
  float lo[N] = {}, hi[N] = {};
  for (int i = 0; i < 16; ++i) {
    for (int b = 0; b < N; ++b) {
      lo[b] += x[b * kBlock + i];
      hi[b] += x[b * kBlock + 16 + i];
    }
  }
  for (int b = 0; b < N; ++b) fsum[b] = lo[b] + hi[b];
}

void float_sums(const float* x, int k, float* fsum) {
  int b = 0;
  for (; b + 4 <= k / kBlock; b += 4) float_sums<4>(x + b * kBlock, fsum + b);
  for (; b < k / kBlock; ++b) float_sums<1>(x + b * kBlock, fsum + b);
}

#if RM_QUANT_ISA == 3
inline void widen(const uint16_t* x, __m512 (&v)[2]) {
  for (int i = 0; i < 2; ++i) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * i));
    v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
inline void widen(const float* x, __m512 (&v)[2]) {
  for (int i = 0; i < 2; ++i) v[i] = _mm512_loadu_ps(x + 16 * i);
}

// x's values widened to float go to f, for float_sums.
template <typename T>
void quantize_row(const T* x, int k, int8_t* q, float* d, int32_t* isum, float* f) {
  for (int b = 0; b < k / kBlock; ++b) {
    __m512 v[2];
    widen(x + b * kBlock, v);
    _mm512_storeu_ps(f + b * kBlock, v[0]);
    _mm512_storeu_ps(f + b * kBlock + 16, v[1]);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    for (int i = 0; i < 2; ++i) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * i), _mm512_cvtepi32_epi8(qi));
      isum[b * 2 + i] = _mm512_reduce_add_epi32(qi);
    }
  }
}
#elif RM_QUANT_ISA >= 1
inline void widen(const uint16_t* x, __m256 (&v)[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * i));
    v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
inline void widen(const float* x, __m256 (&v)[4]) {
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
}

inline float max8(__m256 v) {
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_max_ps(r, _mm_movehdup_ps(r)));
}

inline int32_t sum8(__m256i v) {
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
  return _mm_cvtsi128_si32(_mm_add_epi32(r, _mm_shuffle_epi32(r, 1)));
}

template <typename T>
void quantize_row(const T* x, int k, int8_t* q, float* d, int32_t* isum, float* f) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    widen(x + b * kBlock, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(f + b * kBlock + 8 * i, v[i]);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = max8(a);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    // The packs interleave 128-bit lanes: the permute puts the 32 bytes back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    isum[b * 2] = sum8(_mm256_add_epi32(qi[0], qi[1]));
    isum[b * 2 + 1] = sum8(_mm256_add_epi32(qi[2], qi[3]));
  }
}
#else
template <typename T>
void quantize_row(const T* x, int k, int8_t* q, float* d, int32_t* isum, float* f) {
  for (int b = 0; b < k / kBlock; ++b) {
    float* v = f + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      v[i] = load(x[b * kBlock + i]);
      amax = std::fabs(v[i]) > amax ? std::fabs(v[i]) : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    for (int half = 0; half < 2; ++half) {
      int32_t is = 0;
      for (int i = half * 16; i < half * 16 + 16; ++i) {
        const int8_t qi = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        q[b * kBlock + i] = qi;
        is += qi;
      }
      isum[b * 2 + half] = is;
    }
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int m, int k, void* buf, int threads) {
  const Rows rows(buf, m, k);
  const int kb = k / kBlock;
  const int used = static_cast<int64_t>(m) * k >= (1 << 16) ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(used)
  for (int r = 0; r < m; ++r) {
    thread_local std::vector<float> wide;
    wide.resize(k);
    quantize_row(x + static_cast<int64_t>(r) * k, k, rows.q + static_cast<int64_t>(r) * k,
                 rows.d + static_cast<int64_t>(r) * kb, rows.isum + static_cast<int64_t>(r) * 2 * kb,
                 wide.data());
    float_sums(wide.data(), k, rows.fsum + static_cast<int64_t>(r) * kb);
  }
}

inline float scale_of(const QuantWeight& w, const void* p, int64_t at) {
  return w.half_scales ? half(static_cast<const uint16_t*>(p)[at]) : static_cast<const float*>(p)[at];
}

// Row n of the weight as floats (then rounded to T).
template <typename T>
void dequantize_rows(const QuantWeight* w, const int64_t* rows, int count, T* out, int threads) {
  const int kb = w->k / kBlock, per_block = chunks(w->bits), sub = kBlock / w->block;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int i = 0; i < count; ++i) {
    const int64_t n = rows[i], g = n / kGroup, f = n % kGroup;
    T* dst = out + static_cast<int64_t>(i) * w->k;
    for (int j = 0; j < kb; ++j) {
      const uint8_t* blk = w->q + (g * kb + j) * per_block * 64 + f * 4;
      for (int e = 0; e < kBlock; ++e) {
        int u;
        if (w->bits == 4) {
          const uint8_t byte = blk[(e % 16) / 4 * 64 + e % 4];
          u = e < 16 ? byte & 15 : byte >> 4;
        } else {
          u = blk[e / 4 * 64 + e % 4];
        }
        const int64_t at = (g * kb * sub + j * sub + e / w->block) * kGroup + f;
        float v = scale_of(*w, w->scale, at) * static_cast<float>(u - w->zero);
        if (w->min != nullptr) v += scale_of(*w, w->min, at);
        store(dst + j * kBlock + e, v);
      }
    }
  }
}

}  // namespace

extern "C" {

// Which instruction set the quantized kernels were built for: 3 AVX512-VNNI, 2 AVX-VNNI,
// 1 AVX2, 0 portable C++.
int quant_isa() { return RM_QUANT_ISA; }

// Bytes of the buffer quantize_rows_* fills for m rows of k inputs (k a multiple of 32).
int64_t quant_rows_bytes(int m, int k) {
  const int64_t n = static_cast<int64_t>(m) * k;
  return n + n / kBlock * 8 + n / 16 * 4;
}

void quantize_rows_bf16(const uint16_t* x, int m, int k, void* buf, int threads) {
  quantize_rows(x, m, k, buf, threads);
}

void quantize_rows_f32(const float* x, int m, int k, void* buf, int threads) {
  quantize_rows(x, m, k, buf, threads);
}

void gemm_quant_bf16(const void* xbuf, int m, const QuantWeight* w, const uint16_t* bias,
                     const uint16_t* residual, uint16_t* out, int ldo, int threads) {
  gemm(xbuf, m, w, Epilogue{bias, residual, out, ldo, true}, threads);
}

// Output groups [first, last) of x @ w^T (16 features each) into out [m, ldo], bf16, on the
// calling thread: for callers that share several weights' groups among their own threads
// (cpu/moe.cpp). The same sums as gemm_quant_bf16's.
void gemm_quant_groups_bf16(const void* xbuf, int m, const QuantWeight* w, uint16_t* out,
                            int ldo, int first, int last) {
  const Rows x(const_cast<void*>(xbuf), m, w->k);
  const GroupFn fn = w->half_scales ? pick_scales<uint16_t>(*w) : pick_scales<float>(*w);
  const Epilogue ep{nullptr, nullptr, out, ldo, true};
  for (int g = first; g < last; ++g) fn(*w, x, g, ep);
}

void gemm_quant_f32(const void* xbuf, int m, const QuantWeight* w, const float* bias,
                    const float* residual, float* out, int ldo, int threads) {
  gemm(xbuf, m, w, Epilogue{bias, residual, out, ldo, false}, threads);
}

void dequantize_rows_bf16(const QuantWeight* w, const int64_t* rows, int count, uint16_t* out,
                          int threads) {
  dequantize_rows(w, rows, count, out, threads);
}

void dequantize_rows_f32(const QuantWeight* w, const int64_t* rows, int count, float* out,
                         int threads) {
  dequantize_rows(w, rows, count, out, threads);
}

}  // extern "C"
