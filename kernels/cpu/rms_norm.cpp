// RMSNorm over the last dimension on the CPU: out = x / sqrt(mean(x^2) + eps) * w, computed in
// float32 and rounded once to the input type, as torch's rms_norm does. Rows are split over
// threads only when there are enough of them to pay for it.
#include <cmath>
#include <cstdint>

#include "bf16.h"
#include "entry.h"

namespace {

using radixmesh::load;
using radixmesh::store;

// Rows x dim below which one thread does the whole tensor.
constexpr int64_t kParallelElems = 1 << 16;

template <typename T>
void norm_row(const T* x, const T* w, T* out, int dim, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < dim; ++d) sum += load(x[d]) * load(x[d]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int d = 0; d < dim; ++d) store(out + d, load(x[d]) * inv * load(w[d]));
}

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int rows, int dim, float eps, int threads) {
  const int used = static_cast<int64_t>(rows) * dim >= kParallelElems ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(used) if (used > 1)
  for (int r = 0; r < rows; ++r) {
    const int64_t at = static_cast<int64_t>(r) * dim;
    norm_row(x + at, w, out + at, dim, eps);
  }
}

}  // namespace

extern "C" {

void rms_norm_f32(const float* x, const float* w, float* out, int rows, int dim, float eps,
                  int threads) {
  rms_norm(x, w, out, rows, dim, eps, threads);
}

void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int rows, int dim,
                   float eps, int threads) {
  rms_norm(x, w, out, rows, dim, eps, threads);
}

}  // extern "C"
