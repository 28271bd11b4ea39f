// A mixed batch's LoRA deltas in one call per projection (an SGMV, as Punica's and vLLM's LoRA
// kernels): y[i] += (x[i] A_s^T) (scale B_s^T) for every row i whose sequence runs with the
// adapter in slot s, and nothing for a base row.
//
// Why: the stacked-table formulation (kvpage/lora/apply.py's torch path) multiplies every row
// by every slot's factors and masks the others' columns away, so a batch mixing L adapters
// does L times the arithmetic it needs; at 32 decode rows x 4 adapters of rank 16 that was a
// quarter of a 125M model's step. Here each row meets only its own adapter's rank columns.
//
// Layout (kvpage/lora/tables.py): `a` is (slots * R, in), slot s's A at rows [s R, s R + r_s);
// `b` is (slots * R, out), slot s's scale * B^T at the same rows. `rows` and `slots` list the
// adapter rows grouped by slot (m of them), `ranks` each slot's rank. `t` is (m, R) scratch.
// Float32 throughout, each row's delta accumulated in float32 over the rank and added to y once.
// Step one splits the rows over the threads, step two the output columns, so each thread's
// slice of B stays in its cache across the rows.
#include <cstdint>
#include <omp.h>

#include "vectors.h"

namespace {

constexpr int64_t kVectors = 16;  // accumulators of step two: 16 of the 32 AVX-512 registers
constexpr int64_t kColumnTile = kVectors * kLanes;  // output columns per task of step two

float lanes_sum(fvec v) {
    float sum = 0.0f;
    for (int64_t lane = 0; lane < kLanes; ++lane) sum += v[lane];
    return sum;
}

// t[j] = x . a[j] for j < rank: four rank rows at a time share each load of x, and their four
// independent sums keep the FMA pipeline busy where one dependent chain would wait on each add.
void project(const float* x, const float* a, int64_t in, int64_t rank, float* t) {
    int64_t j = 0;
    for (; j + 4 <= rank; j += 4) {
        const float* a0 = a + j * in;
        fvec s0 = {}, s1 = {}, s2 = {}, s3 = {};
        int64_t k = 0;
        for (; k + kLanes <= in; k += kLanes) {
            const fvec xv = load(x + k);
            s0 += xv * load(a0 + k);
            s1 += xv * load(a0 + in + k);
            s2 += xv * load(a0 + 2 * in + k);
            s3 += xv * load(a0 + 3 * in + k);
        }
        float r0 = lanes_sum(s0), r1 = lanes_sum(s1), r2 = lanes_sum(s2), r3 = lanes_sum(s3);
        for (; k < in; ++k) {
            r0 += x[k] * a0[k];
            r1 += x[k] * a0[in + k];
            r2 += x[k] * a0[2 * in + k];
            r3 += x[k] * a0[3 * in + k];
        }
        t[j] = r0, t[j + 1] = r1, t[j + 2] = r2, t[j + 3] = r3;
    }
    for (; j < rank; ++j) {
        const float* aj = a + j * in;
        fvec s = {};
        int64_t k = 0;
        for (; k + kLanes <= in; k += kLanes) s += load(x + k) * load(aj + k);
        float r = lanes_sum(s);
        for (; k < in; ++k) r += x[k] * aj[k];
        t[j] = r;
    }
}

// y[0:width] += sum_j t[j] b[j][0:width] (b's rows `out` apart), the sum kept in registers
// over j and added to y once.
void expand(float* y, const float* b, int64_t out, const float* t, int64_t rank, int64_t width) {
    if (width == kColumnTile) {
        fvec acc[kVectors] = {};
        for (int64_t j = 0; j < rank; ++j) {
            const fvec tj = fvec{} + t[j];
            const float* bj = b + j * out;
#pragma GCC unroll 16
            for (int64_t v = 0; v < kVectors; ++v) acc[v] += tj * load(bj + v * kLanes);
        }
#pragma GCC unroll 16
        for (int64_t v = 0; v < kVectors; ++v) store(y + v * kLanes, load(y + v * kLanes) + acc[v]);
        return;
    }
    for (int64_t c = 0; c < width; ++c) {  // the last, narrower tile of a projection
        float sum = 0.0f;
        for (int64_t j = 0; j < rank; ++j) sum += t[j] * b[j * out + c];
        y[c] += sum;
    }
}

}  // namespace

extern "C" void kvpage_lora_delta(int64_t m, int64_t in, int64_t out, const float* x, int64_t ldx,
                                  float* y, int64_t ldy, const float* a, const float* b,
                                  int64_t max_rank, const int64_t* rows, const int64_t* slots,
                                  const int64_t* ranks, float* t) {
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t k = 0; k < m; ++k) {
            const int64_t s = slots[k];
            project(x + rows[k] * ldx, a + s * max_rank * in, in, ranks[s], t + k * max_rank);
        }
        const int64_t tiles = (out + kColumnTile - 1) / kColumnTile;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t lo = tile * kColumnTile;
            const int64_t width = out - lo < kColumnTile ? out - lo : kColumnTile;
            for (int64_t k = 0; k < m; ++k) {
                const int64_t s = slots[k];
                float* yk = y + rows[k] * ldy + lo;
                expand(yk, b + s * max_rank * out + lo, out, t + k * max_rank, ranks[s], width);
            }
        }
    }
}
