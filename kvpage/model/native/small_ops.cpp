// The small per-token ops of a decoder layer, each one pass instead of a chain of torch ops:
// RMSNorm (optionally after the residual add; Gemma's with a float32 weight), LayerNorm likewise
// (GPT-2's), rotary embedding applied to q and k in place, a gated MLP's activation(gate) * up
// (SiLU, GELU-tanh) and GPT-2's gelu_new.
//
// At batch 1 a 125M model's decode step runs ~40 torch ops per layer besides its matmuls, and
// each op's dispatch costs more than its arithmetic on a 768-wide row. The numerics follow the
// torch code they replace (kvpage/model/layers.py) operation by operation, each intermediate
// rounded to the activation dtype where torch rounds it, so only the order of the sum of squares
// differs (float32, 16 lanes then pairwise). Built with -ffp-contract=off so that a * b + c is
// never fused into one rounding where torch rounds twice. Shapes and dtypes are checked in
// kvpage/model/native_small_ops.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "exp_poly.h"

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int64_t kParallelElements = 1 << 16;  // below this a step runs on one thread

struct F32 {
    using T = float;
    static float get(const float* p) { return *p; }
    static void put(float* p, float x) { *p = x; }
    static float round(float x) { return x; }
};

struct BF16 {
    using T = uint16_t;
    static float get(const uint16_t* p) {
        uint32_t bits = static_cast<uint32_t>(*p) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    }
    static uint16_t bits(float x) {  // to nearest even, as torch rounds
        uint32_t u;
        std::memcpy(&u, &x, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
        return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    static void put(uint16_t* p, float x) { *p = bits(x); }
    static float round(float x) {
        uint16_t b = bits(x);
        return get(&b);
    }
};

inline f32x16 load16(const float* p) {
    f32x16 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

inline f32x16 load16(const uint16_t* p) {
    u16x16 half;
    std::memcpy(&half, p, sizeof half);
    u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    f32x16 x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

inline void store16(float* p, f32x16 x) { std::memcpy(p, &x, sizeof x); }

inline f32x16 round16(f32x16 x, F32) { return x; }

// To the nearest bfloat16 (even on a tie; NaN stays quiet), as BF16::bits, kept widened.
inline f32x16 round16(f32x16 x, BF16) {
    u32x16 u;
    std::memcpy(&u, &x, sizeof u);
    const i32x16 nan = (u & 0x7fffffffu) > 0x7f800000u;
    u = nan ? u | 0x400000u : u + 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    f32x16 y;
    std::memcpy(&y, &u, sizeof y);
    return y;
}

inline void store16(uint16_t* p, f32x16 x) {
    u32x16 u;
    const f32x16 rounded = round16(x, BF16{});
    std::memcpy(&u, &rounded, sizeof u);
    const u16x16 half = __builtin_convertvector(u >> 16, u16x16);
    std::memcpy(p, &half, sizeof half);
}

// sum of x[i]^2 over c values, the values as the dtype holds them widened to float32
template <class D>
float sum_squares(const typename D::T* x, int64_t c) {
    f32x16 acc = {};
    int64_t i = 0;
    for (; i + kLanes <= c; i += kLanes) {
        f32x16 v = load16(x + i);
        acc += v * v;
    }
    float lanes[kLanes];
    std::memcpy(lanes, &acc, sizeof lanes);
    for (int64_t width = kLanes / 2; width > 0; width /= 2)
        for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    float total = lanes[0];
    for (; i < c; ++i) {
        float v = D::get(x + i);
        total += v * v;
    }
    return total;
}

// The row a norm reads: x, or sum = round(x + delta) where a residual is added first.
template <class D>
const typename D::T* add_residual(const typename D::T* x, const typename D::T* delta, int64_t c,
                                  typename D::T* sum) {
    if (delta == nullptr) return x;
    const int64_t vectors = c / kLanes * kLanes;
    for (int64_t i = 0; i < vectors; i += kLanes)
        store16(sum + i, load16(x + i) + load16(delta + i));
    for (int64_t i = vectors; i < c; ++i) D::put(sum + i, D::get(x + i) + D::get(delta + i));
    return sum;
}

// One row: [sum = round(x + delta)]; out = round(w * round(s * rsqrt(mean(s^2) + eps))) with s
// the row (or the sum), as RMSNorm.forward computes it in float32 and rounds twice.
template <class D>
void norm_row(const typename D::T* x, const typename D::T* delta, const typename D::T* w,
              float eps, int64_t c, typename D::T* sum, typename D::T* out) {
    const typename D::T* s = add_residual<D>(x, delta, c, sum);
    const int64_t vectors = c / kLanes * kLanes;  // the rest of the row one value at a time
    const float r = 1.0f / std::sqrt(sum_squares<D>(s, c) / static_cast<float>(c) + eps);
    for (int64_t i = 0; i < vectors; i += kLanes)
        store16(out + i, load16(w + i) * round16(load16(s + i) * r, D{}));
    for (int64_t i = vectors; i < c; ++i)
        D::put(out + i, D::get(w + i) * D::round(D::get(s + i) * r));
}

// Gemma's RMSNorm, one row: out = round(s * rsqrt(mean(s^2) + eps) * w) with w float32 (the
// caller's 1 + weight): GemmaRMSNorm multiplies in float32 and rounds once, at the end.
template <class D>
void norm_row_wide(const typename D::T* x, const typename D::T* delta, const float* w, float eps,
                   int64_t c, typename D::T* sum, typename D::T* out) {
    const typename D::T* s = add_residual<D>(x, delta, c, sum);
    const int64_t vectors = c / kLanes * kLanes;  // the rest of the row one value at a time
    const float r = 1.0f / std::sqrt(sum_squares<D>(s, c) / static_cast<float>(c) + eps);
    for (int64_t i = 0; i < vectors; i += kLanes)
        store16(out + i, load16(s + i) * r * load16(w + i));
    for (int64_t i = vectors; i < c; ++i) D::put(out + i, D::get(s + i) * r * w[i]);
}

// A norm kernel's rows: x and the residual (row-strided, the residual optional), the sum
// (optional) and the output (contiguous, c wide).
template <class D>
struct NormRows {
    using T = typename D::T;
    const void* xs;
    int64_t x_stride;
    const void* deltas;
    int64_t delta_stride;
    void* sums;
    void* outs;
    int64_t c;

    const T* x(int64_t row) const { return static_cast<const T*>(xs) + row * x_stride; }
    const T* delta(int64_t row) const {
        return deltas == nullptr ? nullptr : static_cast<const T*>(deltas) + row * delta_stride;
    }
    T* sum(int64_t row) const { return sums == nullptr ? nullptr : static_cast<T*>(sums) + row * c; }
    T* out(int64_t row) const { return static_cast<T*>(outs) + row * c; }
};

// wide: w is float32 and the row is rounded once (norm_row_wide), else w is the rows' dtype.
template <class D, bool wide>
void rms_norm(const void* x, int64_t x_stride, const void* delta, int64_t delta_stride,
              const void* w, float eps, int64_t n, int64_t c, void* sum, void* out, int threads) {
    const NormRows<D> rows{x, x_stride, delta, delta_stride, sum, out, c};
#pragma omp parallel for num_threads(threads) if (n * c >= kParallelElements && threads > 1)
    for (int64_t row = 0; row < n; ++row) {
        if constexpr (wide)
            norm_row_wide<D>(rows.x(row), rows.delta(row), static_cast<const float*>(w), eps, c,
                             rows.sum(row), rows.out(row));
        else
            norm_row<D>(rows.x(row), rows.delta(row), static_cast<const typename D::T*>(w), eps,
                        c, rows.sum(row), rows.out(row));
    }
}

// One row of LayerNorm (GPT-2's): [sum = round(x + delta)]; out = round((s - mean) * rstd * w + b)
// in float32, rounded once as torch's layer_norm rounds; mean and variance of the row as the
// dtype holds it (two passes: the variance of s - mean).
template <class D>
void layer_norm_row(const typename D::T* x, const typename D::T* delta, const typename D::T* w,
                    const typename D::T* b, float eps, int64_t c, typename D::T* sum,
                    typename D::T* out) {
    const typename D::T* s = add_residual<D>(x, delta, c, sum);
    const int64_t vectors = c / kLanes * kLanes;  // the rest of the row one value at a time
    f32x16 acc = {};
    for (int64_t i = 0; i < vectors; i += kLanes) acc += load16(s + i);
    float total = 0.0f;
    for (int64_t j = 0; j < kLanes; ++j) total += acc[j];
    for (int64_t i = vectors; i < c; ++i) total += D::get(s + i);
    const float mean = total / static_cast<float>(c);
    f32x16 sq = {};
    for (int64_t i = 0; i < vectors; i += kLanes) {
        const f32x16 d = load16(s + i) - mean;
        sq += d * d;
    }
    float squares = 0.0f;
    for (int64_t j = 0; j < kLanes; ++j) squares += sq[j];
    for (int64_t i = vectors; i < c; ++i) {
        const float d = D::get(s + i) - mean;
        squares += d * d;
    }
    const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(c) + eps);
    for (int64_t i = 0; i < vectors; i += kLanes)
        store16(out + i, (load16(s + i) - mean) * rstd * load16(w + i) + load16(b + i));
    for (int64_t i = vectors; i < c; ++i)
        D::put(out + i, (D::get(s + i) - mean) * rstd * D::get(w + i) + D::get(b + i));
}

template <class D>
void layer_norm(const void* x, int64_t x_stride, const void* delta, int64_t delta_stride,
                const void* w, const void* b, float eps, int64_t n, int64_t c, void* sum,
                void* out, int threads) {
    using T = typename D::T;
    const NormRows<D> rows{x, x_stride, delta, delta_stride, sum, out, c};
#pragma omp parallel for num_threads(threads) if (n * c >= kParallelElements && threads > 1)
    for (int64_t row = 0; row < n; ++row) {
        layer_norm_row<D>(rows.x(row), rows.delta(row), static_cast<const T*>(w),
                          static_cast<const T*>(b), eps, c, rows.sum(row), rows.out(row));
    }
}

// x = round(round(x * cos) + round(rotate_half(x) * sin)) for every head of one row, in place:
// apply_rotary's q * cos + _rotate_half(q) * sin, each op rounded as torch rounds it.
template <class D>
void rotate_heads(typename D::T* x, int64_t heads, int64_t d, int64_t head_stride,
                  const typename D::T* cos, const typename D::T* sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; ++h) {
        typename D::T* v = x + h * head_stride;
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {  // 16 pairs at a time, rounded as below
            const f32x16 a = load16(v + i), b = load16(v + i + half);
            const f32x16 lo = round16(round16(a * load16(cos + i), D{}) +
                                          round16(-b * load16(sin + i), D{}),
                                      D{});
            const f32x16 hi = round16(round16(b * load16(cos + i + half), D{}) +
                                          round16(a * load16(sin + i + half), D{}),
                                      D{});
            store16(v + i, lo);
            store16(v + i + half, hi);
        }
        for (; i < half; ++i) {
            const float a = D::get(v + i), b = D::get(v + i + half);
            const float lo = D::round(D::round(a * D::get(cos + i)) +
                                      D::round(-b * D::get(sin + i)));
            const float hi = D::round(D::round(b * D::get(cos + i + half)) +
                                      D::round(a * D::get(sin + i + half)));
            D::put(v + i, lo);
            D::put(v + i + half, hi);
        }
    }
}

template <class D>
void rotary(void* q, int64_t q_stride, int64_t q_heads, void* k, int64_t k_stride,
            int64_t k_heads, int64_t d, int64_t head_stride, const void* cos, const void* sin,
            int64_t n, int threads) {
    using T = typename D::T;
    T* qs = static_cast<T*>(q);
    T* ks = static_cast<T*>(k);
    const T* cs = static_cast<const T*>(cos);
    const T* ss = static_cast<const T*>(sin);
#pragma omp parallel for num_threads(threads) if (n * (q_heads + k_heads) * d >= kParallelElements && threads > 1)
    for (int64_t row = 0; row < n; ++row) {
        rotate_heads<D>(qs + row * q_stride, q_heads, d, head_stride, cs + row * d, ss + row * d);
        rotate_heads<D>(ks + row * k_stride, k_heads, d, head_stride, cs + row * d, ss + row * d);
    }
}

// e^x for 16 floats, within 2 ulp of expf (exp_poly.h): +inf past expf's overflow, 0 below
// -87.3 (where expf is subnormal or 0; 1 + e^x is 1 either way).
inline f32x16 exp16(f32x16 x) {
    const i32x16 overflow = x > 88.7228394f, underflow = x < -87.3f;
    x = underflow ? f32x16{} - 87.3f : x;
    x = overflow ? f32x16{} : x;
    const f32x16 e = exp_in_range<f32x16, i32x16>(x);
    return overflow ? f32x16{} + INFINITY : (underflow ? f32x16{} : e);
}

// out = round(round(silu(g)) * u) over one row of c: SwiGLU's silu(gate) * up as torch computes
// it, silu(g) = g / (1 + exp(-g)) in float32 and rounded to the dtype, then the product rounded.
// 16 lanes at a time (a scalar expf per element cost 5x torch's vectorised silu at 32 rows).
template <class D>
void silu_mul_row(const typename D::T* g, const typename D::T* u, int64_t c, typename D::T* out) {
    int64_t i = 0;
    for (; i + kLanes <= c; i += kLanes) {
        const f32x16 x = load16(g + i);
        const f32x16 silu = round16(x / (1.0f + exp16(-x)), D{});
        store16(out + i, silu * load16(u + i));
    }
    for (; i < c; ++i) {
        const float x = D::get(g + i);
        const float silu = D::round(x / (1.0f + std::exp(-x)));
        D::put(out + i, silu * D::get(u + i));
    }
}

// tanh for 16 floats as Cephes' tanhf (within 2 ulp): an odd polynomial below |y| = 0.625,
// 1 - 2 / (e^2|y| + 1) with y's sign above, exactly +-1 above 8.664339742 (where torch's
// tanh, SLEEF's, returns +-1: 1 + tanh(y) is then 0 on both sides).
inline f32x16 tanh16(f32x16 y) {
    const f32x16 z = y < 0.0f ? -y : y;
    const f32x16 s = y * y;
    f32x16 p = s * -5.70498872745e-3f + 2.06390887954e-2f;
    p = p * s - 5.37397155531e-2f;
    p = p * s + 1.33314422036e-1f;
    p = p * s - 3.33332819422e-1f;
    const f32x16 small = p * s * y + y;
    const f32x16 large = 1.0f - 2.0f / (exp16(z + z) + 1.0f);
    const f32x16 one = z > 8.664339742f ? f32x16{} + 1.0f : large;
    return z > 0.625f ? (y < 0.0f ? -one : one) : small;
}

// out = round(round(gelu_tanh(g)) * u): GeGLU's F.gelu(gate, approximate="tanh") * up as torch
// computes it in float32, 0.5 g (1 + tanh(b (g + k g^3))) operation by operation (its tanh and
// this one within an ulp or two), the gelu rounded to the dtype, then the product.
template <class D>
void gelu_tanh_mul_row(const typename D::T* g, const typename D::T* u, int64_t c,
                       typename D::T* out) {
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
    int64_t i = 0;
    for (; i + kLanes <= c; i += kLanes) {
        const f32x16 x = load16(g + i);
        const f32x16 inner = kBeta * (x + kKappa * (x * x * x));
        const f32x16 gelu = round16(0.5f * x * (1.0f + tanh16(inner)), D{});
        store16(out + i, gelu * load16(u + i));
    }
    for (; i < c; ++i) {
        const float x = D::get(g + i);
        const float inner = kBeta * (x + kKappa * (x * x * x));
        const float t = std::fabs(inner) > 8.664339742f ? std::copysign(1.0f, inner)
                                                        : std::tanh(inner);
        const float gelu = D::round(0.5f * x * (1.0f + t));
        D::put(out + i, gelu * D::get(u + i));
    }
}

// out = GPT-2's gelu_new(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) as torch computes
// its ops on the dtype one by one: every product, sum and the tanh rounded to it (x^3 as
// (x * x) * x, each rounded: torch's pow(x, 3)).
template <class D>
void gelu_new_row(const typename D::T* g, int64_t c, typename D::T* out) {
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
    const D d{};
    int64_t i = 0;
    for (; i + kLanes <= c; i += kLanes) {
        const f32x16 x = load16(g + i);
        const f32x16 cube = round16(round16(x * x, d) * x, d);
        const f32x16 inner = round16(kBeta * round16(x + round16(kKappa * cube, d), d), d);
        const f32x16 one_plus = round16(1.0f + round16(tanh16(inner), d), d);
        store16(out + i, round16(0.5f * x, d) * one_plus);
    }
    for (; i < c; ++i) {
        const float x = D::get(g + i);
        const float cube = D::round(D::round(x * x) * x);
        const float inner = D::round(kBeta * D::round(x + D::round(kKappa * cube)));
        const float t = std::fabs(inner) > 8.664339742f ? std::copysign(1.0f, inner)
                                                        : std::tanh(inner);
        D::put(out + i, D::round(0.5f * x) * D::round(1.0f + D::round(t)));
    }
}

template <class D>
void gelu_new(const void* x, int64_t stride, int64_t c, void* out, int64_t n, int threads) {
    using T = typename D::T;
    const T* xs = static_cast<const T*>(x);
    T* outs = static_cast<T*>(out);
#pragma omp parallel for num_threads(threads) if (n * c >= kParallelElements && threads > 1)
    for (int64_t row = 0; row < n; ++row) gelu_new_row<D>(xs + row * stride, c, outs + row * c);
}

// row: silu_mul_row or gelu_tanh_mul_row
template <class D, void (*row_fn)(const typename D::T*, const typename D::T*, int64_t,
                                  typename D::T*)>
void gated_mul(const void* gate, const void* up, int64_t stride, int64_t c, void* out,
               int64_t n, int threads) {
    using T = typename D::T;
    const T* gs = static_cast<const T*>(gate);
    const T* us = static_cast<const T*>(up);
    T* outs = static_cast<T*>(out);
#pragma omp parallel for num_threads(threads) if (n * c >= kParallelElements && threads > 1)
    for (int64_t row = 0; row < n; ++row)
        row_fn(gs + row * stride, us + row * stride, c, outs + row * c);
}

}  // namespace

// A gated activation's entry point: its float32 or bfloat16 row kernel by `dtype` (0: float32).
template <auto RowF32, auto RowBF16>
void gated_mul_of(int dtype, const void* gate, const void* up, int64_t stride, int64_t c,
                  void* out, int64_t n, int threads) {
    if (dtype == 0)
        gated_mul<F32, RowF32>(gate, up, stride, c, out, n, threads);
    else
        gated_mul<BF16, RowBF16>(gate, up, stride, c, out, n, threads);
}

extern "C" {

// dtype 0: float32, 1: bfloat16, 2: bfloat16 rows with a float32 weight, rounded once (Gemma's
// norm; float32 rows with a float32 weight are 0: the same products). delta and sum null: a
// plain RMSNorm of x; otherwise sum = x + delta (written, contiguous rows of c) and
// out = RMSNorm(sum). out: contiguous rows.
void kvpage_rms_norm(int dtype, const void* x, int64_t x_stride, const void* delta,
                     int64_t delta_stride, const void* w, float eps, int64_t n, int64_t c,
                     void* sum, void* out, int threads) {
    if (dtype == 0)
        rms_norm<F32, false>(x, x_stride, delta, delta_stride, w, eps, n, c, sum, out, threads);
    else if (dtype == 1)
        rms_norm<BF16, false>(x, x_stride, delta, delta_stride, w, eps, n, c, sum, out, threads);
    else
        rms_norm<BF16, true>(x, x_stride, delta, delta_stride, w, eps, n, c, sum, out, threads);
}

// LayerNorm with weight w and bias b (the rows' dtype), as kvpage_rms_norm (dtype 0 or 1).
void kvpage_layer_norm(int dtype, const void* x, int64_t x_stride, const void* delta,
                       int64_t delta_stride, const void* w, const void* b, float eps, int64_t n,
                       int64_t c, void* sum, void* out, int threads) {
    if (dtype == 0)
        layer_norm<F32>(x, x_stride, delta, delta_stride, w, b, eps, n, c, sum, out, threads);
    else
        layer_norm<BF16>(x, x_stride, delta, delta_stride, w, b, eps, n, c, sum, out, threads);
}

// q: n rows of q_heads heads (heads head_stride apart, rows q_stride apart), k likewise; the
// first d values of each head rotate (d < head_stride: a partial rotary factor), the rest stay;
// cos, sin: (n, d) contiguous. Rotates both in place.
void kvpage_rotary(int dtype, void* q, int64_t q_stride, int64_t q_heads, void* k,
                   int64_t k_stride, int64_t k_heads, int64_t d, int64_t head_stride,
                   const void* cos, const void* sin, int64_t n, int threads) {
    if (dtype == 0)
        rotary<F32>(q, q_stride, q_heads, k, k_stride, k_heads, d, head_stride, cos, sin, n,
                    threads);
    else
        rotary<BF16>(q, q_stride, q_heads, k, k_stride, k_heads, d, head_stride, cos, sin, n,
                     threads);
}

// gate, up: n rows of c values, rows `stride` apart (the halves of a fused gate/up output);
// out: (n, c) contiguous.
void kvpage_silu_mul(int dtype, const void* gate, const void* up, int64_t stride, int64_t c,
                     void* out, int64_t n, int threads) {
    gated_mul_of<silu_mul_row<F32>, silu_mul_row<BF16>>(dtype, gate, up, stride, c, out, n,
                                                        threads);
}

// gelu_tanh(gate) * up, as kvpage_silu_mul (the decode tape replays both as one signature).
void kvpage_gelu_tanh_mul(int dtype, const void* gate, const void* up, int64_t stride, int64_t c,
                          void* out, int64_t n, int threads) {
    gated_mul_of<gelu_tanh_mul_row<F32>, gelu_tanh_mul_row<BF16>>(dtype, gate, up, stride, c,
                                                                  out, n, threads);
}

// x: n rows of c values, rows `stride` apart; out = gelu_new(x): (n, c) contiguous.
void kvpage_gelu_new(int dtype, const void* x, int64_t stride, int64_t c, void* out, int64_t n,
                     int threads) {
    if (dtype == 0)
        gelu_new<F32>(x, stride, c, out, n, threads);
    else
        gelu_new<BF16>(x, stride, c, out, n, threads);
}

}  // extern "C"
