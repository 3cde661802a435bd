// Multi-LoRA on the CPU for the native decoder layer (cpu/layer.cpp): each token's adapter
// adds B_s (A_s x) to a fused projection's bf16 output, in float32 as the Python layer's
// torch path does (x widened, h and the delta in float32, the delta rounded to bf16 before
// the add). A [slots, r, k] holds the targets' A's stacked (r rows in all); B [slots, n, r]
// holds each target's B at its output columns, over its rows of h (the blocks), zeros
// elsewhere, which are not read. The tokens come sorted by adapter, so a thread's run of
// tokens reads one adapter's weights from its cache.
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "entry.h"

extern "C" {

void lora_add_bf16(const LoraProj* p, const int32_t* order, int count, const int32_t* slots,
                   const uint16_t* x, int k, uint16_t* out, int n, int threads) {
  if (p == nullptr || p->a == nullptr || count == 0) return;
  const int r = p->r;
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 1 && threads > 1)
  for (int j = 0; j < count; ++j) {
    thread_local std::vector<float> xf, h;
    xf.resize(k);
    h.resize(r);
    const int64_t i = order[j];
    const int64_t s = slots[i];
    const uint16_t* xi = x + i * k;
    for (int c = 0; c < k; ++c) xf[c] = radixmesh::load(xi[c]);
    const float* a = p->a + s * r * k;
    for (int q = 0; q < r; ++q) {
      const float* row = a + static_cast<int64_t>(q) * k;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int c = 0; c < k; ++c) sum += row[c] * xf[c];
      h[q] = sum;
    }
    const float* b = p->b + s * n * r;
    uint16_t* oi = out + i * n;
    for (int blk = 0; blk < p->num_blocks; ++blk) {
      const LoraBlock& bl = p->blocks[blk];
      const float* hb = h.data() + bl.row;
      for (int col = bl.column; col < bl.column + bl.width; ++col) {
        const float* brow = b + static_cast<int64_t>(col) * r + bl.row;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int q = 0; q < bl.rank; ++q) sum += brow[q] * hb[q];
        const float delta = radixmesh::load(radixmesh::to_bf16(sum));
        oi[col] = radixmesh::to_bf16(radixmesh::load(oi[col]) + delta);
      }
    }
  }
}

}  // extern "C"
