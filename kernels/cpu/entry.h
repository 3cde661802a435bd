// The bf16 entry points of the native kernels that cpu/layer.cpp and cpu/moe.cpp compose;
// each kernel's source includes this too, so a definition that drifts from its declaration
// fails to build.
// QuantWeight is a quantized weight as cpu/quant.cpp packs it (native_quant._QuantWeight).
#pragma once

#include <cstdint>

extern "C" {
struct QuantWeight {
  const uint8_t* q;
  const void* scale;  // float16 (half_scales) or float
  const void* min;    // likewise, or null
  int n, k;
  int bits;   // 4 or 8
  int block;  // inputs per scale: 16 or 32
  int zero;   // subtracted from every packed value
  int half_scales;
};

// LoRA (cpu/lora.cpp): a fused projection's adapters in float32, a [slots, r, k] and
// B transposed, bt [slots, r, n]; each block maps a target's output columns
// [column, column + width) to its rows [row, row + rank) of h = A x.
struct LoraBlock {
  int column, width, row, rank;
};
struct LoraProj {
  const uint16_t* a;  // bf16, or null: no adapter targets this projection
  const uint16_t* bt;
  int r;
  const LoraBlock* blocks;
  int num_blocks;
};

void lora_add_bf16(const LoraProj* p, const int32_t* order, int count, const int32_t* slots,
                   const uint16_t* x, int k, uint16_t* out, int n, int threads);
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int rows, int dim,
                   float eps, int threads);
void gemm_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias,
               const uint16_t* residual, uint16_t* out, int m, int n, int k, int threads);
void rotary_bf16(uint16_t* x, const int64_t* positions, const uint16_t* cos,
                 const uint16_t* sin, int tokens, int heads, int64_t stride, int dim,
                 int threads);
void decode_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                           const int64_t* index, const int64_t* lens, uint16_t* out,
                           int batch, int width, int hq, int hkv, int dim, float scale,
                           int threads);
void silu_mul_bf16_rows(const uint16_t* x, uint16_t* out, int rows, int width, int threads);
int64_t quant_rows_bytes(int m, int k);
void quantize_rows_bf16(const uint16_t* x, int m, int k, void* buf, int threads);
void gemm_quant_bf16(const void* xbuf, int m, const QuantWeight* w, const uint16_t* bias,
                     const uint16_t* residual, uint16_t* out, int ldo, int threads);
void moe_route_bf16(const uint16_t* x, int tokens, int hidden, const uint16_t* router,
                    int num_experts, int k, int renormalize, int64_t* experts, float* weights,
                    int threads);
void moe_quant_bf16(const uint16_t* x, int tokens, int hidden, int k, const int64_t* experts,
                    const float* weights, const QuantWeight* gate, const QuantWeight* up,
                    const QuantWeight* down, int num_experts, float* out, int threads);
void gemm_quant_groups_bf16(const void* xbuf, int m, const QuantWeight* w, uint16_t* out,
                            int ldo, int first, int last);
}
