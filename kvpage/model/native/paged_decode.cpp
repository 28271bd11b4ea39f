// Decode attention that reads K/V blocks where they lie in the paged pool.
//
// One query token per sequence. A work item is (sequence, KV head): its G = H / KVH query heads
// walk the sequence's block table once, so each K/V row is read once per step and never copied.
// Scores, softmax and the weighted sum are float32 whatever the storage dtype (bfloat16 is
// widened on load, the output rounded to nearest even once). head_dim is a multiple of 16 up to
// 128: rows are processed as vectors of L floats, L = 16 with AVX-512 and 8 otherwise (GCC
// vector extensions; a 16-float vector on AVX2 is two registers, and the tile's accumulators
// then spilled: 8 lanes ran a 190-row decode ~2x faster there), head_dim = L * C. Built by
// kvpage/model/native_attention.py at first use; shapes and strides are checked there.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "exp_poly.h"
#include "vectors.h"

namespace {

// L dot products' partial lanes -> one vector of their sums, lane j = sum of v[j]: L - 1 adds
// of whole vectors instead of L horizontal reductions (each a chain of dependent shuffles).
#if KV_LANES == 16
inline fvec sum_each(const fvec* v) {
    fvec w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)  // lanes 0-7: token 2i's 8 partials, 8-15: token 2i+1's
        w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  // 4 partials of tokens 4i..4i+3
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  // 2 partials of tokens 8i..8i+7
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}
#else
inline fvec sum_each(const fvec* v) {
    fvec w[4], x[2];
    for (int i = 0; i < 4; i++)  // lanes 0-3: token 2i's 4 partials, 4-7: token 2i+1's
        w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)  // 2 partials of tokens 4i..4i+3
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// e^x for x <= 0 (scores minus their maximum), within 2 ulp of expf (exp_poly.h), 0 below
// -87.3 where expf is subnormal or 0 (a softmax weight of < 1e-38).
inline fvec exp_nonpositive(fvec x) {
    const fvec lowest = fvec{} - 87.3f;
    const i32vec underflow = x < lowest;
    x = x < lowest ? lowest : x;
    fvec e = exp_in_range<fvec, i32vec>(x);
    i32vec bits;
    std::memcpy(&bits, &e, sizeof bits);
    bits &= ~underflow;
    std::memcpy(&e, &bits, sizeof e);
    return e;
}

inline float max_lanes(fvec x) {
    float top = x[0];
    for (int i = 1; i < kLanes; i++) top = x[i] > top ? x[i] : top;
    return top;
}

inline float sum_lanes(fvec x) {
    float sum = 0.0f;
    for (int i = 0; i < kLanes; i++) sum += x[i];
    return sum;
}

struct Pool {  // one layer's K or V: element (block, token, head, d)
    int64_t block_stride, token_stride, head_stride;
};

struct Shape {
    int64_t seqs, heads, kv_heads, head_dim, block_size, max_blocks;
    int64_t q_stride, out_stride;  // elements from one sequence's q (out) row to the next
};

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Scratch of one thread, in floats: G * D query, G * L dot vectors, a tile of L rows widened
// to float32 (bfloat16 storage), G rows of padded scores, the rows' int64 offsets.
inline int64_t scratch_floats(int64_t G, int64_t D, int64_t max_len) {
    return G * D + G * kLanes * kLanes + kLanes * D + (G + 2) * padded(max_len);
}

// Softmax of one row of scores in place; lanes past len are left as they are.
inline void softmax_row(float* row, int64_t len) {
    const int64_t full = len / kLanes * kLanes;
    const int64_t lane_of_tail = len - full;
    fvec tail = fvec{} - INFINITY;
    for (int64_t i = 0; i < lane_of_tail; i++) tail[i] = row[full + i];
    fvec top = tail;
    for (int64_t t = 0; t < full; t += kLanes) {
        const fvec x = load(row + t);
        top = x > top ? x : top;
    }
    const float m = max_lanes(top);
    fvec sum = exp_nonpositive(tail - m);  // -inf lanes -> 0
    for (int64_t i = 0; i < lane_of_tail; i++) row[full + i] = sum[i];
    for (int64_t t = 0; t < full; t += kLanes) {
        const fvec e = exp_nonpositive(load(row + t) - m);
        store(row + t, e);
        sum += e;
    }
    const float inv = 1.0f / sum_lanes(sum);
    for (int64_t t = 0; t < len; t++) row[t] *= inv;
}

// Where each of a sequence's rows of one KV head starts in the pool, walking its block table.
// Rows [start, len) of the sequence, from offsets[0]: a sliding window starts past row 0.
// Block by block: a division per row cost a third of a 185-row decode.
inline void row_offsets(const Pool& pool, const int64_t* table, int64_t start, int64_t len,
                        int64_t B, int64_t kv_head, int64_t* offsets) {
    int64_t t = start;
    for (int64_t block = start / B; t < len; block++) {
        const int64_t base = table[block] * pool.block_stride + kv_head * pool.head_stride;
        const int64_t stop = (block + 1) * B < len ? (block + 1) * B : len;
        for (int64_t at = base + (t - block * B) * pool.token_stride; t < stop; t++) {
            *offsets++ = at;
            at += pool.token_stride;
        }
    }
}

// The tile's n rows as float32 rows: float32 storage where it lies; bfloat16 widened once into
// `tile` (n rows of D), so that the G query heads sharing the rows do not widen them G times.
template <int C>
inline void tile_rows(const float* base, const int64_t* offsets, int64_t n, float*,
                      const float** rows) {
    for (int64_t j = 0; j < n; j++) rows[j] = base + offsets[j];
}

template <int C>
inline void tile_rows(const BF16* base, const int64_t* offsets, int64_t n, float* tile,
                      const float** rows) {
    for (int64_t j = 0; j < n; j++) {
        const BF16* src = base + offsets[j];
        float* dst = tile + j * C * kLanes;
        for (int c = 0; c < C; c++) store(dst + c * kLanes, load(src + c * kLanes));
        rows[j] = dst;
    }
}

// The next tile's rows (up to L of them, `left` remain), into L1 while this tile computes: the
// rows of one KV head lie a token stride apart, and the block table scatters them further.
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* offsets, int64_t left, int64_t D) {
    const int64_t n = left < kLanes ? left : kLanes;
    for (int64_t j = 0; j < n; j++) {
        const char* row = reinterpret_cast<const char*>(base + offsets[j]);
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
            __builtin_prefetch(row + b, 0, 3);
    }
}

// One (sequence, KV head): its G query heads over the sequence's rows. Tiles of L rows are read
// G times each while they sit in L1; C = head_dim / L is a compile-time constant so that a row
// and a head's accumulators stay in registers.
template <int C, typename T>
void attend_one(const T* q, const T* k, const T* v, const Pool& pool, const int64_t* table,
                int64_t start, int64_t end, int64_t seq, int64_t kv_head, const Shape& sh,
                float scale, T* out, float* scratch) {
    const int64_t len = end - start;  // the rows it attends to
    const int64_t G = sh.heads / sh.kv_heads, D = C * kLanes;
    const int64_t row_len = padded(sh.max_blocks * sh.block_size);
    fvec* qv = reinterpret_cast<fvec*>(scratch);  // (G, C), scale applied
    fvec* dots = qv + G * C;                        // (L,) partial lanes of a tile's dots
    float* tile = scratch + G * D + kLanes * kLanes;    // (L, D) widened rows
    float* scores = tile + kLanes * D;                  // (G, row_len)
    const float* rows[kLanes];
    int64_t* offsets = reinterpret_cast<int64_t*>(scores + G * row_len);  // (row_len,)
    row_offsets(pool, table, start, end, sh.block_size, kv_head, offsets);
    const int64_t first_head = kv_head * G * D;
    const T* q_row = q + seq * sh.q_stride + first_head;
    for (int64_t i = 0; i < G * C; i++) qv[i] = load(q_row + i * kLanes) * scale;
    for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
        const int64_t n = len - t0 < kLanes ? len - t0 : kLanes;
        prefetch_rows(k, offsets + t0 + kLanes, len - t0 - kLanes, D);
        tile_rows<C>(k, offsets + t0, n, tile, rows);
        for (int64_t g = 0; g < G; g++) {
            fvec qg[C];  // in registers: the stores to dots may alias qv in the scratch
            for (int c = 0; c < C; c++) qg[c] = qv[g * C + c];
            for (int64_t j = 0; j < n; j++) {
                const float* kr = rows[j];
                fvec dot = qg[0] * load(kr);
                for (int c = 1; c < C; c++) dot += qg[c] * load(kr + c * kLanes);
                dots[j] = dot;
            }
            for (int64_t j = n; j < kLanes; j++) dots[j] = fvec{};
            store(scores + g * row_len + t0, sum_each(dots));
        }
    }
    for (int64_t g = 0; g < G; g++) softmax_row(scores + g * row_len, len);
    fvec* acc = qv;  // the query is spent: (G, C) accumulators
    for (int64_t i = 0; i < G * C; i++) acc[i] = fvec{};
    for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
        const int64_t n = len - t0 < kLanes ? len - t0 : kLanes;
        prefetch_rows(v, offsets + t0 + kLanes, len - t0 - kLanes, D);
        tile_rows<C>(v, offsets + t0, n, tile, rows);
        for (int64_t g = 0; g < G; g++) {
            fvec a[C];
            for (int c = 0; c < C; c++) a[c] = acc[g * C + c];
            const float* p = scores + g * row_len + t0;
            for (int64_t j = 0; j < n; j++) {
                const float* vr = rows[j];
                for (int c = 0; c < C; c++) a[c] += p[j] * load(vr + c * kLanes);
            }
            for (int c = 0; c < C; c++) acc[g * C + c] = a[c];
        }
    }
    const float* result = reinterpret_cast<const float*>(acc);
    T* out_row = out + seq * sh.out_stride + first_head;
    for (int64_t i = 0; i < G * D; i++) store(out_row + i, result[i]);
}

// One K or V row of C vectors, widened.
template <int C, typename T>
inline void load_row(const T* p, fvec* row) {
    for (int c = 0; c < C; c++) row[c] = load(p + c * kLanes);
}

// attend_one for a compile-time G: each K and V row is loaded (and widened) once into registers
// and used there by all G query heads, the heads' queries and accumulators held in registers
// too (a 560-row bfloat16 decode ran ~1.5x faster). The same arithmetic in the same order as
// attend_one, so the same results.
template <int C, int G, typename T>
void attend_one_g(const T* q, const T* k, const T* v, const Pool& pool, const int64_t* table,
                  int64_t start, int64_t end, int64_t seq, int64_t kv_head, const Shape& sh,
                  float scale, T* out, float* scratch) {
    const int64_t len = end - start;
    constexpr int64_t D = C * kLanes;
    const int64_t row_len = padded(sh.max_blocks * sh.block_size);
    fvec* dots = reinterpret_cast<fvec*>(scratch);  // (G, L) partial lanes of a tile's dots
    float* scores = scratch + G * kLanes * kLanes;  // (G, row_len)
    int64_t* offsets = reinterpret_cast<int64_t*>(scores + G * row_len);  // (row_len,)
    row_offsets(pool, table, start, end, sh.block_size, kv_head, offsets);
    const int64_t first_head = kv_head * G * D;
    const T* q_row = q + seq * sh.q_stride + first_head;
    fvec qv[G][C];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) qv[g][c] = load(q_row + (g * C + c) * kLanes) * scale;
    for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
        const int64_t n = len - t0 < kLanes ? len - t0 : kLanes;
        prefetch_rows(k, offsets + t0 + kLanes, len - t0 - kLanes, D);
        for (int64_t j = 0; j < n; j++) {
            fvec row[C];
            load_row<C>(k + offsets[t0 + j], row);
            for (int g = 0; g < G; g++) {
                fvec dot = qv[g][0] * row[0];
                for (int c = 1; c < C; c++) dot += qv[g][c] * row[c];
                dots[g * kLanes + j] = dot;
            }
        }
        for (int g = 0; g < G; g++) {
            for (int64_t j = n; j < kLanes; j++) dots[g * kLanes + j] = fvec{};
            store(scores + g * row_len + t0, sum_each(dots + g * kLanes));
        }
    }
    for (int g = 0; g < G; g++) softmax_row(scores + g * row_len, len);
    fvec acc[G][C];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = fvec{};
    for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
        const int64_t n = len - t0 < kLanes ? len - t0 : kLanes;
        prefetch_rows(v, offsets + t0 + kLanes, len - t0 - kLanes, D);
        for (int64_t j = 0; j < n; j++) {
            fvec row[C];
            load_row<C>(v + offsets[t0 + j], row);
            for (int g = 0; g < G; g++) {
                const float p = scores[g * row_len + t0 + j];
                for (int c = 0; c < C; c++) acc[g][c] += p * row[c];
            }
        }
    }
    T* out_row = out + seq * sh.out_stride + first_head;
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            for (int64_t i = 0; i < kLanes; i++)
                store(out_row + (g * C + c) * kLanes + i, acc[g][c][i]);
}

template <int C, typename T>
void attend(const T* q, const T* k, const T* v, const Pool& pool, const int64_t* tables,
            const int64_t* lens, const int64_t* starts, const Shape& sh, float scale, T* out,
            float* scratch, int64_t scratch_per_thread, int num_threads) {
    const int64_t items = sh.seqs * sh.kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t seq = item / sh.kv_heads, kv_head = item % sh.kv_heads;
        float* mine = scratch + omp_get_thread_num() * scratch_per_thread;
        const int64_t start = starts == nullptr ? 0 : starts[seq];
        const int64_t* table = tables + seq * sh.max_blocks;
        // The group sizes of common models, where the group's queries fit the registers
        // (G x C vectors: more would spill, and only lengthen the build); others: any G.
        switch (sh.heads / sh.kv_heads) {
#define KV_GROUP(g)                                                                           \
    case g:                                                                                   \
        if constexpr (g * C <= 32)                                                            \
            attend_one_g<C, g>(q, k, v, pool, table, start, lens[seq], seq, kv_head, sh,     \
                               scale, out, mine);                                             \
        else                                                                                  \
            attend_one<C>(q, k, v, pool, table, start, lens[seq], seq, kv_head, sh, scale,   \
                          out, mine);                                                         \
        break;
            KV_GROUP(1) KV_GROUP(2) KV_GROUP(3) KV_GROUP(4) KV_GROUP(8)
#undef KV_GROUP
            default:
                attend_one<C>(q, k, v, pool, table, start, lens[seq], seq, kv_head, sh, scale,
                              out, mine);
        }
    }
}

template <typename T>
void attend_any(const T* q, const T* k, const T* v, const Pool& pool, const int64_t* tables,
                const int64_t* lens, const int64_t* starts, const Shape& sh, float scale, T* out,
                float* scratch, int64_t scratch_per_thread, int num_threads) {
#define KV_CASE(c)                                                                       \
    case c:                                                                              \
        return attend<c>(q, k, v, pool, tables, lens, starts, sh, scale, out, scratch,  \
                         scratch_per_thread, num_threads);
    switch (sh.head_dim / kLanes) {
        KV_CASE(1) KV_CASE(2) KV_CASE(3) KV_CASE(4) KV_CASE(5) KV_CASE(6) KV_CASE(7) KV_CASE(8)
#if KV_LANES == 8
        KV_CASE(9) KV_CASE(10) KV_CASE(11) KV_CASE(12) KV_CASE(13) KV_CASE(14) KV_CASE(15)
        KV_CASE(16)
#endif
    }
#undef KV_CASE
}

}  // namespace

extern "C" int64_t kvpage_scratch_floats(int64_t heads, int64_t kv_heads, int64_t head_dim,
                                         int64_t max_len) {
    // + kLanes: the vectors in the scratch are aligned by rounding its start up (see below)
    return scratch_floats(heads / kv_heads, head_dim, max_len) + kLanes;
}

// dtype: 0 = float32, 1 = bfloat16. q: one row of heads * head_dim per sequence, rows q_stride
// elements apart (a view of a fused qkv output); out likewise, out_stride apart. scratch:
// num_threads * scratch_per_thread floats, each thread's share 64-byte aligned when the whole is
// (torch allocations are). starts: per sequence the first row it attends to (a sliding
// window), or NULL for row 0.
extern "C" void kvpage_paged_decode(int dtype, const void* q, int64_t q_stride, const void* k,
                                    const void* v, int64_t block_stride, int64_t token_stride,
                                    int64_t head_stride, const int64_t* tables,
                                    const int64_t* lens, const int64_t* starts, void* out,
                                    int64_t out_stride, int64_t seqs, int64_t heads,
                                    int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                    int64_t max_blocks, float scale, float* scratch,
                                    int64_t scratch_per_thread, int num_threads) {
    const Pool pool{block_stride, token_stride, head_stride};
    const Shape sh{seqs, heads, kv_heads, head_dim, block_size, max_blocks, q_stride, out_stride};
    const int64_t per_thread = scratch_per_thread / kLanes * kLanes;
    if (dtype == 0)
        attend_any(static_cast<const float*>(q), static_cast<const float*>(k),
               static_cast<const float*>(v), pool, tables, lens, starts, sh, scale,
               static_cast<float*>(out), scratch, per_thread, num_threads);
    else
        attend_any(static_cast<const BF16*>(q), static_cast<const BF16*>(k),
               static_cast<const BF16*>(v), pool, tables, lens, starts, sh, scale,
               static_cast<BF16*>(out), scratch, per_thread, num_threads);
}

// The new tokens' K and V rows into their slots (slot = block * block_size + offset) of one
// layer's pools, as KVStorage.write's index_copy_ does: n rows of kv_heads * head_dim elements
// (heads contiguous), k and v rows src_stride elements apart. Slots are checked by the caller.
extern "C" void kvpage_paged_write(int dtype, const void* k, const void* v, int64_t src_stride,
                                   void* k_pool, void* v_pool, int64_t block_stride,
                                   int64_t token_stride, int64_t head_stride,
                                   const int64_t* slots, int64_t n, int64_t kv_heads,
                                   int64_t head_dim, int64_t block_size) {
    const int64_t elem = dtype == 0 ? 4 : 2;
    const char* src[2] = {static_cast<const char*>(k), static_cast<const char*>(v)};
    char* dst[2] = {static_cast<char*>(k_pool), static_cast<char*>(v_pool)};
    for (int64_t i = 0; i < n; i++) {
        const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
        const int64_t at = block * block_stride + offset * token_stride;
        for (int kv = 0; kv < 2; kv++)
            for (int64_t h = 0; h < kv_heads; h++)
                std::memcpy(dst[kv] + (at + h * head_stride) * elem,
                            src[kv] + (i * src_stride + h * head_dim) * elem, head_dim * elem);
    }
}
