// The experts of a sparse mixture-of-experts layer whose weights are quantized (cpu/quant.cpp)
// for a step's tokens, in one call and one parallel region: each token's row goes to each of
// its chosen experts; the gate and up GEMMs of every chosen expert share the threads, in
// chunks of output features whichever expert they belong to; then each expert's SiLU-and-mul;
// then the down GEMMs likewise; then each token's sum of its picks weighted by the router, in
// float32. Each expert runs the same kernels in the same order as the Python path
// (radixmesh/engine/model/moe.py), so its output is bit for bit the same; what goes is the
// parallel region and the Python call that each of a decode step's small GEMMs paid for.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "entry.h"

namespace {

constexpr int kGroup = 16;       // output features per packed group (cpu/quant.cpp)
constexpr int kChunkGroups = 8;  // groups per work item: 128 output features

// Output groups [first, last) of one expert's weight: gate (0), up (1) or down (2).
struct Item {
  int expert, part, first, last;
};

void add_items(std::vector<Item>& items, int expert, int part, int n) {
  const int groups = (n + kGroup - 1) / kGroup;
  for (int g = 0; g < groups; g += kChunkGroups) {
    items.push_back({expert, part, g, g + kChunkGroups < groups ? g + kChunkGroups : groups});
  }
}

}  // namespace

extern "C" {

// Each token's top-k experts: logits = x @ router^T (float32 sums rounded to bf16, as a bf16
// linear layer rounds them), their softmax in float32, the k most probable (ties: the lower
// expert first), their probabilities rescaled to sum to 1 if `renormalize`. x [T, hidden],
// router [E, hidden] bf16 -> experts [T, k], weights [T, k] float32.
void moe_route_bf16(const uint16_t* x, int tokens, int hidden, const uint16_t* router,
                    int num_experts, int k, int renormalize, int64_t* experts, float* weights,
                    int threads) {
  const int64_t work = static_cast<int64_t>(tokens) * num_experts * hidden;
#pragma omp parallel for schedule(static) num_threads(threads) if (work >= (1 << 20))
  for (int t = 0; t < tokens; ++t) {
    thread_local std::vector<float> probs;
    probs.resize(num_experts);
    const uint16_t* row = x + static_cast<int64_t>(t) * hidden;
    float top = -INFINITY;
    for (int e = 0; e < num_experts; ++e) {
      const uint16_t* w = router + static_cast<int64_t>(e) * hidden;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int h = 0; h < hidden; ++h) sum += radixmesh::load(row[h]) * radixmesh::load(w[h]);
      probs[e] = radixmesh::load(radixmesh::to_bf16(sum));
      top = probs[e] > top ? probs[e] : top;
    }
    float total = 0.0f;
    for (int e = 0; e < num_experts; ++e) total += probs[e] = std::exp(probs[e] - top);
    for (int e = 0; e < num_experts; ++e) probs[e] /= total;
    int64_t* chosen = experts + static_cast<int64_t>(t) * k;
    float* weight = weights + static_cast<int64_t>(t) * k;
    float kept = 0.0f;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < num_experts; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || chosen[i] == e;
        if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
      }
      chosen[j] = best;
      kept += weight[j] = probs[best];
    }
    if (renormalize) {
      for (int j = 0; j < k; ++j) weight[j] /= kept;
    }
  }
}

// x [T, hidden] bf16; experts and weights [T, k] (each token's experts and their router
// weights); gate, up [E] weights of [I, hidden], down [E] of [hidden, I] -> out [T, hidden]
// float32, each token's weighted sum over its k picks.
void moe_quant_bf16(const uint16_t* x, int tokens, int hidden, int k, const int64_t* experts,
                    const float* weights, const QuantWeight* gate, const QuantWeight* up,
                    const QuantWeight* down, int num_experts, float* out, int threads) {
  const int picks = tokens * k, inter = gate[0].n;
  // The picks in expert order, stable: expert e's rows are start[e] .. start[e + 1).
  std::vector<int> start(num_experts + 1, 0), row_of(picks), active;
  for (int p = 0; p < picks; ++p) ++start[experts[p] + 1];
  for (int e = 0; e < num_experts; ++e) {
    if (start[e + 1]) active.push_back(e);
    start[e + 1] += start[e];
  }
  std::vector<int> next(start.begin(), start.end() - 1);
  for (int p = 0; p < picks; ++p) row_of[p] = next[experts[p]]++;
  std::vector<Item> up_items, down_items;
  for (int e : active) {
    add_items(up_items, e, 0, inter);
    add_items(up_items, e, 1, inter);
    add_items(down_items, e, 2, hidden);
  }
  // Rows of x, gate|up, the activation and the experts' outputs, bf16, in expert order; then
  // each expert's quantized rows of x and of the activation (quant_rows_bytes is linear in
  // the rows, so expert e's start at quant_rows_bytes(start[e], ...)).
  const int64_t rows_elems = static_cast<int64_t>(picks) * (2 * hidden + 3 * inter);
  thread_local std::vector<uint16_t> scratch;
  const int64_t qx_bytes = quant_rows_bytes(picks, hidden);
  scratch.resize(rows_elems + (qx_bytes + quant_rows_bytes(picks, inter) + 1) / 2 + 32);
  uint16_t* xs = scratch.data();
  uint16_t* gate_up = xs + static_cast<int64_t>(picks) * hidden;
  uint16_t* act = gate_up + static_cast<int64_t>(picks) * 2 * inter;
  uint16_t* ys = act + static_cast<int64_t>(picks) * inter;
  auto* qx = reinterpret_cast<uint8_t*>(scratch.data() + (rows_elems + 31) / 32 * 32);
  uint8_t* qa = qx + qx_bytes;
  const int n_active = static_cast<int>(active.size());
  const int n_up = static_cast<int>(up_items.size()), n_down = static_cast<int>(down_items.size());

#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int p = 0; p < picks; ++p) {
      std::memcpy(xs + static_cast<int64_t>(row_of[p]) * hidden,
                  x + static_cast<int64_t>(p / k) * hidden, hidden * sizeof(uint16_t));
    }
#pragma omp for schedule(dynamic)
    for (int i = 0; i < n_active; ++i) {
      const int e = active[i], first = start[e], count = start[e + 1] - first;
      quantize_rows_bf16(xs + static_cast<int64_t>(first) * hidden, count, hidden,
                         qx + quant_rows_bytes(first, hidden), 1);
    }
#pragma omp for schedule(dynamic)
    for (int i = 0; i < n_up; ++i) {
      const Item& it = up_items[i];
      const int first = start[it.expert], count = start[it.expert + 1] - first;
      const QuantWeight* w = it.part == 0 ? &gate[it.expert] : &up[it.expert];
      uint16_t* o = gate_up + static_cast<int64_t>(first) * 2 * inter + it.part * inter;
      gemm_quant_groups_bf16(qx + quant_rows_bytes(first, hidden), count, w, o, 2 * inter,
                             it.first, it.last);
    }
#pragma omp for schedule(dynamic)
    for (int i = 0; i < n_active; ++i) {
      const int e = active[i], first = start[e], count = start[e + 1] - first;
      uint16_t* a = act + static_cast<int64_t>(first) * inter;
      silu_mul_bf16_rows(gate_up + static_cast<int64_t>(first) * 2 * inter, a, count, inter, 1);
      quantize_rows_bf16(a, count, inter, qa + quant_rows_bytes(first, inter), 1);
    }
#pragma omp for schedule(dynamic)
    for (int i = 0; i < n_down; ++i) {
      const Item& it = down_items[i];
      const int first = start[it.expert], count = start[it.expert + 1] - first;
      gemm_quant_groups_bf16(qa + quant_rows_bytes(first, inter), count, &down[it.expert],
                             ys + static_cast<int64_t>(first) * hidden, hidden, it.first,
                             it.last);
    }
#pragma omp for schedule(static)
    for (int t = 0; t < tokens; ++t) {
      float* o = out + static_cast<int64_t>(t) * hidden;
      for (int f = 0; f < hidden; ++f) o[f] = 0.0f;
      for (int j = 0; j < k; ++j) {
        const float w = weights[t * k + j];
        const uint16_t* y = ys + static_cast<int64_t>(row_of[t * k + j]) * hidden;
        for (int f = 0; f < hidden; ++f) o[f] += w * radixmesh::load(y[f]);
      }
    }
  }
}

}  // extern "C"
