// Multi-LoRA on the CPU for the native decoder layer (cpu/layer.cpp): each token's adapter
// adds B_s (A_s x) to a fused projection's bf16 output, in float32 as the Python layer's
// torch path does (x widened, h and the delta in float32, the delta rounded to bf16 before
// the add). A [slots, r, k] holds the targets' A's stacked (r rows in all); B^T [slots, r, n]
// holds each target's B, transposed, at its output columns, over its rows of h (the
// blocks), zeros elsewhere, which are not read.
//
// The tokens come sorted by adapter: each run of one adapter's tokens is a small GEMM that
// reads that adapter's weights once, whatever the run's length. Threads split the rows of A
// (shrink), then tiles of output columns (expand), over every run at once: one parallel
// region per call.
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "entry.h"

namespace {

constexpr int kCols = 64;  // output columns per tile of the expand

float dot(const float* a, const float* b, int n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
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
  std::vector<float> xf(static_cast<size_t>(count) * k), h(static_cast<size_t>(count) * r);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int j = 0; j < count; ++j) {
      const uint16_t* row = x + static_cast<int64_t>(order[j]) * k;
      float* dst = xf.data() + static_cast<int64_t>(j) * k;
      for (int c = 0; c < k; ++c) dst[c] = radixmesh::load(row[c]);
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < groups * r; ++w) {
      const int64_t g = w / r, q = w % r;
      const int64_t s = slots[order[runs[g]]];
      const float* a = p->a + (s * r + q) * k;
      for (int j = runs[g]; j < runs[g + 1]; ++j) {
        h[static_cast<int64_t>(j) * r + q] = dot(a, xf.data() + static_cast<int64_t>(j) * k, k);
      }
    }
    for (int blk = 0; blk < p->num_blocks; ++blk) {
      const LoraBlock bl = p->blocks[blk];
      // Tiles of kCols columns: their rows of B stay in L1 while each token's row of the
      // tile is written, contiguously.
      const int64_t tiles = (bl.width + kCols - 1) / kCols;
#pragma omp for schedule(static)
      for (int64_t w = 0; w < groups * tiles; ++w) {
        const int64_t g = w / tiles;
        const int c0 = bl.column + static_cast<int>(w % tiles) * kCols;
        const int c1 = c0 + kCols < bl.column + bl.width ? c0 + kCols : bl.column + bl.width;
        const int64_t s = slots[order[runs[g]]];
        const float* bt = p->bt + (s * r + bl.row) * n;
        float acc[kCols];
        for (int j = runs[g]; j < runs[g + 1]; ++j) {
          const float* hj = h.data() + static_cast<int64_t>(j) * r + bl.row;
          for (int c = 0; c < c1 - c0; ++c) acc[c] = 0.f;
          for (int q = 0; q < bl.rank; ++q) {  // acc += h[q] * B^T[q] over the tile
            const float hq = hj[q];
            const float* row = bt + static_cast<int64_t>(q) * n + c0;
#pragma omp simd
            for (int c = 0; c < c1 - c0; ++c) acc[c] += hq * row[c];
          }
          uint16_t* o = out + static_cast<int64_t>(order[j]) * n + c0;
          for (int c = 0; c < c1 - c0; ++c) {
            o[c] = radixmesh::to_bf16(radixmesh::load(o[c]) +
                                      radixmesh::load(radixmesh::to_bf16(acc[c])));
          }
        }
      }
    }
  }
}

}  // extern "C"
