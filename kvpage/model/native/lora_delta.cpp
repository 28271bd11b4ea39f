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
// Float32 throughout, the products accumulated in float32 and added to y once per rank column
// (the order of a GEMM's k loop). Step one splits the rows over the threads, step two the
// output columns, so each thread's slice of B stays in its cache across the rows.
#include <cstdint>
#include <omp.h>

#include "vectors.h"

namespace {

constexpr int64_t kColumnTile = 256;  // output columns per task of step two

float dot(const float* x, const float* a, int64_t n) {
    fvec acc = {};
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) acc += load(x + k) * load(a + k);
    float sum = 0.0f;
    for (int64_t lane = 0; lane < kLanes; ++lane) sum += acc[lane];
    for (; k < n; ++k) sum += x[k] * a[k];
    return sum;
}

void axpy(float* y, const float* b, float t, int64_t n) {
    const fvec tv = fvec{} + t;
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) store(y + k, load(y + k) + tv * load(b + k));
    for (; k < n; ++k) y[k] += t * b[k];
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
            const float* xk = x + rows[k] * ldx;
            for (int64_t j = 0; j < ranks[s]; ++j)
                t[k * max_rank + j] = dot(xk, a + (s * max_rank + j) * in, in);
        }
        const int64_t tiles = (out + kColumnTile - 1) / kColumnTile;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t lo = tile * kColumnTile;
            const int64_t width = out - lo < kColumnTile ? out - lo : kColumnTile;
            for (int64_t k = 0; k < m; ++k) {
                const int64_t s = slots[k];
                float* yk = y + rows[k] * ldy + lo;
                for (int64_t j = 0; j < ranks[s]; ++j)
                    axpy(yk, b + (s * max_rank + j) * out + lo, t[k * max_rank + j], width);
            }
        }
    }
}
