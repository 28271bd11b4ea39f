// Decode attention that reads K/V blocks where they lie in the paged pool.
//
// One query token per sequence. A work item is (sequence, KV head): its G = H / KVH query heads
// walk the sequence's block table once, so each K/V row is read once per step and never copied.
// Scores, softmax and the weighted sum are float32 whatever the storage dtype (bfloat16 is
// widened on load, the output rounded to nearest even once). head_dim must be a multiple of 16:
// rows are processed as 16-float vectors (GCC vector extensions, so the same source compiles to
// AVX-512, AVX2 or SSE). Built by kvpage/model/native_attention.py at first use; shapes and
// strides are checked there.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

struct BF16 {
    uint16_t bits;
};

inline f32x16 load(const float* p) {
    f32x16 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

inline f32x16 load(const BF16* p) {
    u16x16 half;
    std::memcpy(&half, p, sizeof half);
    u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    f32x16 x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

inline float widen(float x) { return x; }

inline float widen(BF16 x) {
    uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline void store(float* p, float x) { *p = x; }

inline void store(BF16* p, float x) {  // round to nearest even, as torch does; NaN stays quiet
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        p->bits = static_cast<uint16_t>((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    p->bits = static_cast<uint16_t>(bits >> 16);
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline float sum_lanes(f32x16 x) {  // a tree of halving adds: 4 adds, not 15
    const f32x8 s8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const f32x4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) +
                     __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

struct Pool {  // one layer's K or V: element (block, token, head, d)
    int64_t block_stride, token_stride, head_stride;
};

struct Shape {
    int64_t seqs, heads, kv_heads, head_dim, block_size, max_blocks;
};

// Scratch of one thread, in floats: G * D query, G * D accumulators, G * max_len scores.
inline int64_t scratch_floats(int64_t G, int64_t D, int64_t max_len) {
    return 2 * G * D + G * max_len;
}

template <typename T>
void attend_one(const T* q, const T* k, const T* v, const Pool& pool, const int64_t* table,
                int64_t len, int64_t seq, int64_t kv_head, const Shape& sh, float scale, T* out,
                float* scratch) {
    const int64_t G = sh.heads / sh.kv_heads, D = sh.head_dim, B = sh.block_size;
    const int64_t chunks = D / kLanes, max_len = sh.max_blocks * B;
    f32x16* qv = reinterpret_cast<f32x16*>(scratch);  // (G, chunks), scale applied
    f32x16* acc = qv + G * chunks;                    // (G, chunks)
    float* scores = scratch + 2 * G * D;              // (G, max_len)
    const int64_t first_row = (seq * sh.heads + kv_head * G) * D;
    for (int64_t i = 0; i < G * chunks; i++) qv[i] = load(q + first_row + i * kLanes) * scale;
    for (int64_t t = 0; t < len; t++) {
        const T* kr = k + table[t / B] * pool.block_stride + (t % B) * pool.token_stride +
                      kv_head * pool.head_stride;
        for (int64_t g = 0; g < G; g++) {
            f32x16 dot = qv[g * chunks] * load(kr);
            for (int64_t c = 1; c < chunks; c++) dot += qv[g * chunks + c] * load(kr + c * kLanes);
            scores[g * max_len + t] = sum_lanes(dot);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float* row = scores + g * max_len;
        float top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) top = row[t] > top ? row[t] : top;
        for (int64_t t = 0; t < len; t++) sum += (row[t] = std::exp(row[t] - top));
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) row[t] *= inv;
    }
    for (int64_t i = 0; i < G * chunks; i++) acc[i] = f32x16{};
    for (int64_t t = 0; t < len; t++) {
        const T* vr = v + table[t / B] * pool.block_stride + (t % B) * pool.token_stride +
                      kv_head * pool.head_stride;
        for (int64_t c = 0; c < chunks; c++) {
            const f32x16 row = load(vr + c * kLanes);
            for (int64_t g = 0; g < G; g++) acc[g * chunks + c] += scores[g * max_len + t] * row;
        }
    }
    const float* result = reinterpret_cast<const float*>(acc);
    for (int64_t i = 0; i < G * D; i++) store(out + first_row + i, result[i]);
}

template <typename T>
void attend(const T* q, const T* k, const T* v, const Pool& pool, const int64_t* tables,
            const int64_t* lens, const Shape& sh, float scale, T* out, float* scratch,
            int64_t scratch_per_thread, int num_threads) {
    const int64_t items = sh.seqs * sh.kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t seq = item / sh.kv_heads, kv_head = item % sh.kv_heads;
        float* mine = scratch + omp_get_thread_num() * scratch_per_thread;
        attend_one(q, k, v, pool, tables + seq * sh.max_blocks, lens[seq], seq, kv_head, sh,
                   scale, out, mine);
    }
}

}  // namespace

extern "C" int64_t kvpage_scratch_floats(int64_t heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t max_len) {
    // + kLanes: the vectors in the scratch are aligned by rounding its start up (see below)
    return scratch_floats(heads / kv_heads, head_dim, max_len) + kLanes;
}

// dtype: 0 = float32, 1 = bfloat16. scratch: num_threads * scratch_per_thread floats, each
// thread's share 64-byte aligned when the whole is (torch allocations are).
extern "C" void kvpage_paged_decode(int dtype, const void* q, const void* k, const void* v,
                                    int64_t block_stride, int64_t token_stride,
                                    int64_t head_stride, const int64_t* tables,
                                    const int64_t* lens, void* out, int64_t seqs, int64_t heads,
                                    int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, float scale, float* scratch,
                                    int64_t scratch_per_thread, int num_threads) {
    const Pool pool{block_stride, token_stride, head_stride};
    const Shape sh{seqs, heads, kv_heads, head_dim, block_size, max_blocks};
    const int64_t per_thread = scratch_per_thread / kLanes * kLanes;
    if (dtype == 0)
        attend(static_cast<const float*>(q), static_cast<const float*>(k),
               static_cast<const float*>(v), pool, tables, lens, sh, scale,
               static_cast<float*>(out), scratch, per_thread, num_threads);
    else
        attend(static_cast<const BF16*>(q), static_cast<const BF16*>(k),
               static_cast<const BF16*>(v), pool, tables, lens, sh, scale,
               static_cast<BF16*>(out), scratch, per_thread, num_threads);
}
