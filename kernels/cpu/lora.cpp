// Multi-LoRA on the CPU for the native decoder layer (cpu/layer.cpp): each token's adapter
// adds B_s (A_s x) to a fused projection's bf16 output, in float32 as the Python layer's
// torch path does (x widened, h and the delta in float32, the delta rounded to bf16 before
// the add). A [slots, r, k] holds the targets' A's stacked (r rows in all); B^T [slots, r, n]
// holds each target's B, transposed, at its output columns, over its rows of h (the
// blocks), zeros elsewhere, which are not read. Both are bf16, as the model's weights: a
// step streams every adapter present, and that traffic sets its cost once arithmetic is
// cheap.
//
// The tokens come sorted by adapter: each run of one adapter's tokens is a small GEMM that
// reads that adapter's weights once, whatever the run's length. Both halves are register
// blocked, kTokens tokens at a time: the shrink against kRows rows of A, the expand over up
// to 64 output columns, so each weight loaded feeds several multiply-adds. Threads split
// row blocks of A (shrink), then tiles of output columns (expand), over every run at once:
// one parallel region per call. The vectors are GCC's generic ones, 16 floats: one AVX-512
// register, two AVX2 registers.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "entry.h"

namespace {

using Vec = float __attribute__((vector_size(64)));
using Half = uint16_t __attribute__((vector_size(32)));
using Wide = uint32_t __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kTokens = 4;  // tokens per register block
constexpr int kRows = 4;    // rows of A per shrink block
constexpr int kCols = 64;   // output columns per expand tile: kCols / kLanes vectors

// 16 bf16 values -> 16 floats (exact).
inline Vec widen(const uint16_t* p) {
  Half raw;
  std::memcpy(&raw, p, sizeof raw);
  const Wide bits = __builtin_convertvector(raw, Wide) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline float sum(Vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// h[t][q] = A[q] . x_t for kRows rows of A and kTokens tokens (rows and tokens past the
// ends repeat the last: computed, not written).
void shrink_block(const uint16_t* a, int rows, const uint16_t* const* x, int tokens, int k,
                  float* const* h) {
  const uint16_t* ar[kRows];
  for (int i = 0; i < kRows; ++i) ar[i] = a + static_cast<int64_t>(std::min(i, rows - 1)) * k;
  const uint16_t* xt[kTokens];
  for (int t = 0; t < kTokens; ++t) xt[t] = x[std::min(t, tokens - 1)];
  Vec acc[kRows][kTokens] = {};
  const int body = k - k % kLanes;
  for (int c = 0; c < body; c += kLanes) {
    Vec xv[kTokens];
    for (int t = 0; t < kTokens; ++t) xv[t] = widen(xt[t] + c);
    for (int i = 0; i < kRows; ++i) {
      const Vec av = widen(ar[i] + c);
      for (int t = 0; t < kTokens; ++t) acc[i][t] += av * xv[t];
    }
  }
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < rows; ++i) {
      float s = sum(acc[i][t]);
      for (int c = body; c < k; ++c) s += radixmesh::load(ar[i][c]) * radixmesh::load(xt[t][c]);
      h[t][i] = s;
    }
  }
}

// out_t[c0 .. c0 + 16 * V) += round(h_t . B^T[:, c0 ..]) for kTokens tokens (past the end:
// computed, not written).
template <int V>
void expand_block(const uint16_t* bt, int64_t n, int rank, const float* const* h,
                  int tokens, uint16_t* const* out) {
  const float* ht[kTokens];
  for (int t = 0; t < kTokens; ++t) ht[t] = h[std::min(t, tokens - 1)];
  Vec acc[kTokens][V] = {};
  for (int q = 0; q < rank; ++q) {
    Vec b[V];
    for (int v = 0; v < V; ++v) b[v] = widen(bt + q * n + v * kLanes);
    for (int t = 0; t < kTokens; ++t) {
      const float hq = ht[t][q];
      for (int v = 0; v < V; ++v) acc[t][v] += hq * b[v];
    }
  }
  for (int t = 0; t < tokens; ++t) {
    for (int v = 0; v < V; ++v) {
      uint16_t* o = out[t] + v * kLanes;
      for (int i = 0; i < kLanes; ++i) {
        o[i] = radixmesh::to_bf16(radixmesh::load(o[i]) +
                                  radixmesh::load(radixmesh::to_bf16(acc[t][v][i])));
      }
    }
  }
}

// The same for fewer than 16 columns, one at a time.
void expand_tail(const uint16_t* bt, int64_t n, int rank, const float* const* h, int tokens,
                 uint16_t* const* out, int width) {
  for (int t = 0; t < tokens; ++t) {
    for (int c = 0; c < width; ++c) {
      float acc = 0.f;
      for (int q = 0; q < rank; ++q) acc += h[t][q] * radixmesh::load(bt[q * n + c]);
      out[t][c] = radixmesh::to_bf16(radixmesh::load(out[t][c]) +
                                     radixmesh::load(radixmesh::to_bf16(acc)));
    }
  }
}

void expand_tile(const uint16_t* bt, int64_t n, int rank, const float* const* h, int tokens,
                 uint16_t* const* out, int width) {
  switch (width / kLanes) {
    case 0: break;
    case 1: expand_block<1>(bt, n, rank, h, tokens, out); break;
    case 2: expand_block<2>(bt, n, rank, h, tokens, out); break;
    case 3: expand_block<3>(bt, n, rank, h, tokens, out); break;
    default: expand_block<4>(bt, n, rank, h, tokens, out); break;
  }
  const int done = width - width % kLanes;
  if (done == width) return;
  uint16_t* rest[kTokens];
  for (int t = 0; t < tokens; ++t) rest[t] = out[t] + done;
  expand_tail(bt + done, n, rank, h, tokens, rest, width - done);
}

}  // namespace

extern "C" {

void lora_add_bf16(const LoraProj* p, const int32_t* order, int count, const int32_t* slots,
                   const uint16_t* x, int k, uint16_t* out, int n, int threads) {
  if (p == nullptr || p->a == nullptr || count == 0) return;
  const int r = p->r;
  // Runs of one adapter: runs[g] .. runs[g + 1] in `order`.
  std::vector<int> runs{0};
  for (int j = 1; j < count; ++j) {
    if (slots[order[j]] != slots[order[j - 1]]) runs.push_back(j);
  }
  runs.push_back(count);
  const int64_t groups = static_cast<int64_t>(runs.size()) - 1;
  const int64_t row_blocks = (r + kRows - 1) / kRows;
  std::vector<float> h(static_cast<size_t>(count) * r);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < groups * row_blocks; ++w) {
      const int64_t g = w / row_blocks;
      const int q0 = static_cast<int>(w % row_blocks) * kRows;
      const uint16_t* a = p->a + (slots[order[runs[g]]] * static_cast<int64_t>(r) + q0) * k;
      for (int j = runs[g]; j < runs[g + 1]; j += kTokens) {
        const int tokens = std::min(kTokens, runs[g + 1] - j);
        const uint16_t* xs[kTokens];
        float* hs[kTokens];
        for (int t = 0; t < tokens; ++t) {
          xs[t] = x + static_cast<int64_t>(order[j + t]) * k;
          hs[t] = h.data() + static_cast<int64_t>(j + t) * r + q0;
        }
        shrink_block(a, std::min(kRows, r - q0), xs, tokens, k, hs);
      }
    }
    for (int blk = 0; blk < p->num_blocks; ++blk) {
      const LoraBlock bl = p->blocks[blk];
      const int64_t tiles = (bl.width + kCols - 1) / kCols;
#pragma omp for schedule(static)
      for (int64_t w = 0; w < groups * tiles; ++w) {
        const int64_t g = w / tiles;
        const int c0 = bl.column + static_cast<int>(w % tiles) * kCols;
        const int width = std::min(kCols, bl.column + bl.width - c0);
        const uint16_t* bt = p->bt + (slots[order[runs[g]]] * static_cast<int64_t>(r) + bl.row) * n + c0;
        for (int j = runs[g]; j < runs[g + 1]; j += kTokens) {
          const int tokens = std::min(kTokens, runs[g + 1] - j);
          const float* hs[kTokens];
          uint16_t* os[kTokens];
          for (int t = 0; t < tokens; ++t) {
            hs[t] = h.data() + static_cast<int64_t>(j + t) * r + bl.row;
            os[t] = out + static_cast<int64_t>(order[j + t]) * n + c0;
          }
          expand_tile(bt, n, bl.rank, hs, tokens, os, width);
        }
      }
    }
  }
}

}  // extern "C"
