// Linear layers for a few activation rows: y = (x @ W^T) * scale + bias.
//
// Decode multiplies 1..a few dozen rows by every weight, so a step is bound by reading the
// weights once: the kernel streams each weight row from memory exactly once per call, widening
// it to float32 in registers (int8 codes: sign-extend + convert; bfloat16: a shift) and using it
// for every activation row while it is there. Accumulation is float32 in the vector's L lanes
// (16 with AVX-512, else 8; lane j sums k = j mod L, then the lanes are added pairwise),
// products exact for int8 and bfloat16 weights. The epilogue multiplies by the int8
// per-output-channel scale (the weight-only format of kvpage/model/int8.py: activations are
// never quantized), adds the bias, and rounds once to the output dtype (bfloat16: to nearest
// even). Work is split over output channels (tiles of NR rows, contiguous in memory), statically
// over the threads. Weights may come as several
// segments (q, k and v kept as separate tensors): their outputs land side by side in y.
// Built by kvpage/model/native_gemv.py at first use; shapes and dtypes are checked there.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <omp.h>

#include "vectors.h"

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int8_t i8vec __attribute__((vector_size(KV_LANES)));
// Activation rows per register tile (times NR = 4 weight rows, kTileRows): the accumulators,
// the weight vectors and one x vector must fit the register file, or every step spills.
// AVX-512: 16 + 4 + 1 of 32 registers; 16 registers (AVX2): 8 + 4 + 1.
constexpr int kMB = KV_LANES == 16 ? 4 : 2;
constexpr int kMaxSegments = 8;

inline fvec load(const int8_t* p) {
    // GCC scalarises __builtin_convertvector from int8: sign-extend and convert explicitly.
#if defined(__AVX512F__)
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
    fvec out;
    std::memcpy(&out, &x, sizeof out);
    return out;
#else
    i8vec codes;
    std::memcpy(&codes, p, sizeof codes);
    return __builtin_convertvector(__builtin_convertvector(codes, i32vec), fvec);
#endif
}

inline float widen(int8_t x) { return static_cast<float>(x); }

inline float hsum(fvec v) {  // pairwise: (8 +) 4 + 2 + 1 adds
#if KV_LANES == 16
    f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    f32x8 a = v;
#endif
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// The weights are read once, in address order (a tile's rows are adjacent, tiles follow each
// other): a prefetch into L2 this far ahead keeps enough misses in flight. Without it the
// kernel read 10-14 GB/s on one core (int8: 3-4 GB/s: its 16-byte steps leave the hardware
// prefetcher behind), with it 16-19 (bench/int8_weights.py --kernel-sweep, 1 thread).
constexpr int64_t kPrefetchBytes = 16384;

template <typename W>
inline void prefetch(const W* p) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, 0, 2);
}

template <typename X>
struct Rows {  // the activations: M rows of K, row stride ld (K contiguous)
    const X* x;
    int64_t ld;
};

// acc[m][r] = x[m0 + m] . w[r] for MB activation rows and NR weight rows (w: NR rows of K),
// both widened to float32 and multiplied-added in 16 lanes. kStream: w is read from memory
// (prefetch ahead); else it is a tile already widened into L1.
template <int MB, int NR, bool kStream, typename X, typename W>
inline void dot_tile_widened(const Rows<X>& in, int64_t m0, const W* w, int64_t K,
                             float acc[MB][NR]) {
    fvec sum[MB][NR];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < NR; r++) sum[m][r] = fvec{};
    const int64_t body = K / kLanes * kLanes;
    for (int64_t k = 0; k < body; k += kLanes) {
        fvec wv[NR];
        if (kStream && (k * sizeof(W)) % 64 == 0)  // once per cache line of each row
            for (int r = 0; r < NR; r++) prefetch(w + r * K + k);
        for (int r = 0; r < NR; r++) wv[r] = load(w + r * K + k);
        for (int m = 0; m < MB; m++) {
            const fvec xv = load(in.x + (m0 + m) * in.ld + k);
            for (int r = 0; r < NR; r++) sum[m][r] += xv * wv[r];
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < NR; r++) {
            float s = hsum(sum[m][r]);
            const X* xr = in.x + (m0 + m) * in.ld;
            for (int64_t k = body; k < K; k++) s += widen(xr[k]) * widen(w[r * K + k]);
            acc[m][r] = s;
        }
}

#ifdef __AVX512BF16__
// bfloat16 x and w: vdpbf16ps multiplies pairs of bfloat16 (exact products) and adds them into
// 16 float32 lanes, 32 weights per instruction and no widening (oneDNN's bf16 GEMM uses it too;
// like it, the instruction treats bfloat16 subnormals, below 1.2e-38, as zero).
template <int MB, int NR, bool kStream>
inline void dot_tile_bf16(const Rows<BF16>& in, int64_t m0, const BF16* w, int64_t K,
                          float acc[MB][NR]) {
    __m512 sum[MB][NR];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < NR; r++) sum[m][r] = _mm512_setzero_ps();
    const int64_t body = K / (2 * kLanes) * (2 * kLanes);
    for (int64_t k = 0; k < body; k += 2 * kLanes) {
        __m512bh wv[NR];
        if (kStream)
            for (int r = 0; r < NR; r++) prefetch(w + r * K + k);  // 32 bf16: one cache line
        for (int r = 0; r < NR; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
        for (int m = 0; m < MB; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(in.x + (m0 + m) * in.ld + k);
            for (int r = 0; r < NR; r++) sum[m][r] = _mm512_dpbf16_ps(sum[m][r], xv, wv[r]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < NR; r++) {
            fvec v;
            std::memcpy(&v, &sum[m][r], sizeof v);
            float s = hsum(v);
            const BF16* xr = in.x + (m0 + m) * in.ld;
            for (int64_t k = body; k < K; k++) s += widen(xr[k]) * widen(w[r * K + k]);
            acc[m][r] = s;
        }
}
#endif

#ifdef __AVX512BF16__
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

template <int MB, int NR, bool kStream, typename X, typename W>
inline void dot_tile(const Rows<X>& in, int64_t m0, const W* w, int64_t K, float acc[MB][NR]) {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<X, BF16> && std::is_same_v<W, BF16>) {
        dot_tile_bf16<MB, NR, kStream>(in, m0, w, K, acc);
        return;
    }
#endif
    dot_tile_widened<MB, NR, kStream>(in, m0, w, K, acc);
}

template <typename Y, typename W>
struct Segment {
    const W* w;        // (rows, K)
    const Y* scale;    // (rows,) or null
    const Y* bias;     // (rows,) or null
    int64_t rows;
    int64_t out_col;   // where its outputs start in a row of y
};

// y[m0.., r0..] for MB activation rows and NR weight rows `w` (the segment's rows r0.. as they
// lie, or widened into L1): the dot products, then scale, bias and one rounding to Y.
template <int MB, int NR, bool kStream, typename X, typename W, typename Y, typename SW>
inline void rows_block(const Rows<X>& in, int64_t m0, const W* w, const Segment<Y, SW>& seg,
                       int64_t r0, int64_t K, Y* y, int64_t ldy) {
    float acc[MB][NR];
    dot_tile<MB, NR, kStream>(in, m0, w, K, acc);
    for (int r = 0; r < NR; r++) {
        const float scale = seg.scale ? widen(seg.scale[r0 + r]) : 1.0f;
        const float bias = seg.bias ? widen(seg.bias[r0 + r]) : 0.0f;
        for (int m = 0; m < MB; m++)
            store(y + (m0 + m) * ldy + seg.out_col + r0 + r, acc[m][r] * scale + bias);
    }
}

// All M activation rows against NR weight rows `w`, kMB at a time, then the remainder.
template <int NR, bool kStream, typename X, typename W, typename Y, typename SW>
inline void all_rows(const Rows<X>& in, int64_t M, const W* w, const Segment<Y, SW>& seg,
                     int64_t r0, int64_t K, Y* y, int64_t ldy) {
    int64_t m = 0;
    for (; m + kMB <= M; m += kMB) rows_block<kMB, NR, kStream>(in, m, w, seg, r0, K, y, ldy);
    const int64_t left = M - m;
    if constexpr (kMB > 3)
        if (left == 3) return rows_block<3, NR, kStream>(in, m, w, seg, r0, K, y, ldy);
    if constexpr (kMB > 2)
        if (left == 2) return rows_block<2, NR, kStream>(in, m, w, seg, r0, K, y, ldy);
    if (left == 1) rows_block<1, NR, kStream>(in, m, w, seg, r0, K, y, ldy);
}

// int8 codes as bfloat16, exactly: a code has at most 7 significant bits, so its float32 value's
// low 16 bits are zero and the top half is the bfloat16.
inline void store_codes(BF16* p, const int8_t* codes) {
    const fvec f = load(codes);
    u32vec bits;
    std::memcpy(&bits, &f, sizeof bits);
    const u16vec half = __builtin_convertvector(bits >> 16, u16vec);
    std::memcpy(p, &half, sizeof half);
}

inline void store_codes(float* p, const int8_t* codes) { store(p, load(codes)); }

inline void widen_code(BF16* p, int8_t code) { store(p, static_cast<float>(code)); }
inline void widen_code(float* p, int8_t code) { *p = static_cast<float>(code); }

// NR rows of int8 codes widened into `wide` (NR * K, in L1), streaming them in once.
template <typename T>
inline void widen_tile(const int8_t* w, int64_t n, T* wide) {
    const int64_t body = n / kLanes * kLanes;
    for (int64_t i = 0; i < body; i += kLanes) {
        if (i % 64 == 0) prefetch(w + i);
        store_codes(wide + i, w + i);
    }
    for (int64_t i = body; i < n; i++) widen_code(wide + i, w[i]);
}

// One tile: NR weight rows (fewer at a segment's end: one at a time) times all M activation rows.
// int8 weights meeting more than one block of activation rows are widened once into a tile in
// L1 first, so the conversion is paid once per weight, not once per kMB rows: to float32, or to
// bfloat16 for bfloat16 x where vdpbf16ps does 32 multiply-adds an instruction.
template <int NR, typename X, typename Y, typename W>
void tile(const Rows<X>& in, int64_t M, const Segment<Y, W>& seg, int64_t r0, int64_t K, Y* y,
          int64_t ldy) {
    const W* w = seg.w + r0 * K;
    if (r0 + NR > seg.rows) {
        for (int64_t r = r0; r < seg.rows; r++, w += K)
            all_rows<1, true>(in, M, w, seg, r, K, y, ldy);
        return;
    }
    if constexpr (std::is_same_v<W, int8_t>) {
        if (M > kMB) {
            using T = std::conditional_t<kDotBf16 && std::is_same_v<X, BF16>, BF16, float>;
            static thread_local std::vector<T> wide;
            wide.resize(NR * K);
            widen_tile(w, NR * K, wide.data());
            all_rows<NR, false>(in, M, wide.data(), seg, r0, K, y, ldy);
            return;
        }
    }
    all_rows<NR, true>(in, M, w, seg, r0, K, y, ldy);
}

template <int NR, typename X, typename Y, typename W>
void linear_nr(const Rows<X>& in, int64_t M, int64_t K, const Segment<Y, W>* segs, int nseg,
               Y* y, int64_t ldy, int num_threads) {
    int64_t first[kMaxSegments + 1] = {0};  // first[s]: segment s's first tile
    for (int s = 0; s < nseg; s++) first[s + 1] = first[s] + (segs[s].rows + NR - 1) / NR;
    const int64_t tiles = first[nseg];
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        int s = 0;
        while (t >= first[s + 1]) s++;
        tile<NR>(in, M, segs[s], (t - first[s]) * NR, K, y, ldy);
    }
}

// Weight rows per tile: 4, and for one activation row 8 with AVX-512. One row has only NR
// accumulators in flight, and with 32 registers 8 keep more loads and multiply-adds going: the
// 125M model's layers at one row 1.07-1.14x faster (bf16 and fp32, 2 threads, in one process
// against the 4-row build). On AVX2 (16 registers) 8 spill and measured no faster. Each row's
// sum runs in the same order either way; the compiler may fuse its multiply-adds differently
// (float32 x, int8 codes: a few outputs 1 ulp apart).
constexpr int kTileRows = 4;
constexpr int kTileRowsOneX = KV_LANES == 16 ? 8 : kTileRows;

template <typename X, typename Y, typename W>
void linear(const Rows<X>& in, int64_t M, int64_t K, const Segment<Y, W>* segs, int nseg, Y* y,
            int64_t ldy, int num_threads) {
    if (M == 1)
        return linear_nr<kTileRowsOneX>(in, M, K, segs, nseg, y, ldy, num_threads);
    linear_nr<kTileRows>(in, M, K, segs, nseg, y, ldy, num_threads);
}

// What a layer's call does not change: built once by kvpage/model/native_gemv.py (a ctypes
// Structure of the same layout).
struct Plan {
    int32_t kind;  // 0 = float32 x, int8 w; 1 = bfloat16 x, int8 w; 2 = bfloat16 x and w;
                   // 3 = float32 x and w
    int32_t segments;
    int64_t in_features;  // K
    int64_t out_features;  // sum of rows: a row of y
    const void* w[kMaxSegments];  // (rows[s], K) contiguous
    const void* scale[kMaxSegments];  // (rows[s],) in x's dtype, or null
    const void* bias[kMaxSegments];  // (rows[s],) in x's dtype, or null
    int64_t rows[kMaxSegments];
};

template <typename X, typename W>
void run(const Plan& p, const void* x, int64_t ldx, int64_t M, void* y, int num_threads) {
    Segment<X, W> segs[kMaxSegments];
    int64_t col = 0;
    for (int s = 0; s < p.segments; s++) {
        segs[s] = {static_cast<const W*>(p.w[s]), static_cast<const X*>(p.scale[s]),
                   static_cast<const X*>(p.bias[s]), p.rows[s], col};
        col += p.rows[s];
    }
    const Rows<X> in{static_cast<const X*>(x), ldx};
    if constexpr (std::is_same_v<X, BF16> && std::is_same_v<W, int8_t>) {
        if (kDotBf16 && M > kMB) {  // the tiles are widened to bfloat16 instead (see tile)
            linear(in, M, p.in_features, segs, p.segments, static_cast<X*>(y), p.out_features,
                   num_threads);
            return;
        }
        // bfloat16 activations against int8 codes (a few rows, or no bfloat16 dot product):
        // widen x once (M x K floats) rather than in every tile's inner loop; exact.
        static thread_local std::vector<float> wide;
        const int64_t K = p.in_features;
        wide.resize(M * K);
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) wide[m * K + k] = widen(in.x[m * ldx + k]);
        linear(Rows<float>{wide.data(), K}, M, K, segs, p.segments, static_cast<X*>(y),
               p.out_features, num_threads);
    } else {
        linear(in, M, p.in_features, segs, p.segments, static_cast<X*>(y), p.out_features,
               num_threads);
    }
}

}  // namespace

extern "C" int kvpage_gemv_max_segments() { return kMaxSegments; }

extern "C" int kvpage_gemv_lanes() { return KV_LANES; }

// x: (M, K) with row stride ldx, K contiguous, in the plan's x dtype; y: (M, out_features)
// contiguous, same dtype.
extern "C" void kvpage_weight_gemv(const Plan* plan, const void* x, int64_t ldx, int64_t M,
                                   void* y, int num_threads) {
    const Plan& p = *plan;
    if (p.segments < 1 || p.segments > kMaxSegments) return;
    switch (p.kind) {
        case 0: return run<float, int8_t>(p, x, ldx, M, y, num_threads);
        case 1: return run<BF16, int8_t>(p, x, ldx, M, y, num_threads);
        case 2: return run<BF16, BF16>(p, x, ldx, M, y, num_threads);
        case 3: return run<float, float>(p, x, ldx, M, y, num_threads);
    }
}
