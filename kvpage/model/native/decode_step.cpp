// A Llama decode step's per-layer kernel calls (kvpage/model/decode_plan.py) made from one native
// call instead of ten Python-to-C calls a layer.
//
// Why: at batch 1 the plan's Python loop and its ~120 ctypes calls a step (each converting a
// dozen arguments) cost about 1 ms of a 125M model's ~11 ms bfloat16 step, next to kernels that
// take microseconds on one 768-wide row. The kernels themselves are not here: the other native
// libraries' entry points come in as function pointers (`Kernels`, and each layer's linear
// kernels with their plans), called in the order and with the arguments the Python loop passes,
// so the results are the loop's, bit for bit.
// Built by kvpage/model/native_decode_step.py at first use; every address and shape is checked
// there, once per buffer set, pool and weight set.
#include <cstdint>

namespace {

// A linear layer's entry point: the weight GEMV's (weight_gemv.cpp) or the AMX kernel's
// (amx_linear.cpp), each taking its own plan of the layer's weights.
using LinearFn = void (*)(const void* plan, const void* x, int64_t ldx, int64_t m, void* y,
                          int threads);
using RmsNorm = void (*)(int dtype, const void* x, int64_t x_stride, const void* delta,
                         int64_t delta_stride, const void* w, float eps, int64_t n, int64_t c,
                         void* sum, void* out, int threads);
using Rotary = void (*)(int dtype, void* q, int64_t q_stride, int64_t q_heads, void* k,
                        int64_t k_stride, int64_t k_heads, int64_t d, const void* cos,
                        const void* sin, int64_t n, int threads);
using SiluMul = void (*)(int dtype, const void* gate, const void* up, int64_t stride, int64_t c,
                         void* out, int64_t n, int threads);
using PagedWrite = void (*)(int dtype, const void* k, const void* v, int64_t src_stride,
                            void* k_pool, void* v_pool, int64_t block_stride,
                            int64_t token_stride, int64_t head_stride, const int64_t* slots,
                            int64_t n, int64_t kv_heads, int64_t head_dim, int64_t block_size);
using PagedDecode = void (*)(int dtype, const void* q, int64_t q_stride, const void* k,
                             const void* v, int64_t block_stride, int64_t token_stride,
                             int64_t head_stride, const int64_t* tables, const int64_t* lens,
                             const int64_t* starts, void* out, int64_t out_stride, int64_t seqs,
                             int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t max_blocks, float scale, float* scratch,
                             int64_t scratch_per_thread, int threads);

}  // namespace

extern "C" {

// The other libraries' entry points (a ctypes Structure of the same layout).
struct Kernels {
    RmsNorm rms_norm;
    Rotary rotary;
    SiluMul silu_mul;
    PagedWrite paged_write;
    PagedDecode paged_decode;
};

struct Linear {
    LinearFn run;
    const void* plan;
};

// What one layer's calls read that no other layer shares.
struct Layer {
    Linear qkv, out, gate_up, down;
    const void* input_norm;  // RMSNorm weights, (c,) in the step's dtype
    const void* post_norm;
    float input_eps;
    float post_eps;
    void* k_pool;  // this layer's (blocks, B, KVH, D) pools
    void* v_pool;
};

// One step: the model's shape, the buffers (m rows each, contiguous), the pool's layout and
// this step's slots, block tables, lengths and rotary rows.
struct Step {
    int32_t dtype;  // 0: float32, 1: bfloat16
    int32_t threads;
    int64_t layers, m, c, heads, kv_heads, head_dim, intermediate;
    void* x;  // (m, c): the embedded tokens in, the residual stream after
    void* qkv;  // (m, (heads + 2 kv_heads) head_dim)
    void* attn;  // (m, heads head_dim)
    void* o;  // (m, c)
    void* h;  // (m, c): the normalised input of the next projection
    void* gate_up;  // (m, 2 intermediate)
    void* act;  // (m, intermediate)
    void* down;  // (m, c)
    void* hidden;  // (m, c): the final norm's output
    const void* final_norm;
    float final_eps;
    float scale;  // attention's 1 / sqrt(head_dim)
    const void* cos;  // (m, head_dim)
    const void* sin;
    const int64_t* slots;  // (m,): where each row's K and V go
    const int64_t* tables;  // (m, max_blocks)
    const int64_t* lens;  // (m,)
    int64_t max_blocks, block_size, block_stride, token_stride, head_stride;
    float* scratch;  // threads * scratch_per_thread floats, for the attention kernel
    int64_t scratch_per_thread;
    const Layer* layer;  // (layers,)
};

void kvpage_decode_step(const Kernels* kernels, const Step* step) {
    const Kernels& f = *kernels;
    const Step& s = *step;
    const int dt = s.dtype, th = s.threads;
    const int64_t m = s.m, c = s.c, d = s.head_dim, inter = s.intermediate;
    const int64_t q_width = s.heads * d, width = (s.heads + 2 * s.kv_heads) * d;
    const int64_t elem = dt == 0 ? 4 : 2;
    char* qkv = static_cast<char*>(s.qkv);
    char* k_rows = qkv + q_width * elem;
    char* v_rows = qkv + (s.heads + s.kv_heads) * d * elem;
    const char* up = static_cast<const char*>(s.gate_up) + inter * elem;
    f.rms_norm(dt, s.x, c, nullptr, 0, s.layer[0].input_norm, s.layer[0].input_eps, m, c,
               nullptr, s.h, th);
    for (int64_t i = 0; i < s.layers; i++) {
        const Layer& l = s.layer[i];
        l.qkv.run(l.qkv.plan, s.h, c, m, s.qkv, th);
        f.rotary(dt, qkv, width, s.heads, k_rows, width, s.kv_heads, d, s.cos, s.sin, m, th);
        f.paged_write(dt, k_rows, v_rows, width, l.k_pool, l.v_pool, s.block_stride,
                      s.token_stride, s.head_stride, s.slots, m, s.kv_heads, d, s.block_size);
        f.paged_decode(dt, qkv, width, l.k_pool, l.v_pool, s.block_stride, s.token_stride,
                       s.head_stride, s.tables, s.lens, nullptr, s.attn, q_width, m, s.heads,
                       s.kv_heads, d, s.block_size, s.max_blocks, s.scale, s.scratch,
                       s.scratch_per_thread, th);
        l.out.run(l.out.plan, s.attn, q_width, m, s.o, th);
        f.rms_norm(dt, s.x, c, s.o, c, l.post_norm, l.post_eps, m, c, s.x, s.h, th);  // x += o
        l.gate_up.run(l.gate_up.plan, s.h, c, m, s.gate_up, th);
        f.silu_mul(dt, s.gate_up, up, 2 * inter, inter, s.act, m, th);
        l.down.run(l.down.plan, s.act, inter, m, s.down, th);
        // x += down, then the next layer's input norm, or after the last the final norm
        const bool last = i + 1 == s.layers;
        f.rms_norm(dt, s.x, c, s.down, c, last ? s.final_norm : s.layer[i + 1].input_norm,
                   last ? s.final_eps : s.layer[i + 1].input_eps, m, c, s.x,
                   last ? s.hidden : s.h, th);
    }
}

}  // extern "C"
