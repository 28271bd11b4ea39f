// bfloat16 linear layers for a decode step's rows on AMX tiles: y = x @ W^T + b, x (M, K) with
// M up to a few dozen, W (N, K) repacked once into the tiles' pair-interleaved layout.
//
// Why: at 8-64 rows the vector kernel (weight_gemv.cpp) is bound by its multiply-adds, and
// oneDNN's AMX GEMM took about as long at 32 rows as at one (a 768 x 32000 head 2.5 ms, the
// weights read at ~20 GB/s) on a 2-core Sapphire Rapids. Here each weight tile is read once per
// block of 32 rows, in address order, and the tile multiply-adds keep up with memory.
//
// Layout: N in blocks of 32 outputs (two 16-column B tiles), K in steps of 32; a block's tiles
// lie contiguously, K step after K step: packed[n / 32][k / 32][2][16][32], where tile row r of
// half h holds, for its 16 outputs j, w[n0 + 16 h + j][k0 + 2 r] and w[..][k0 + 2 r + 1]. Needs
// K and N multiples of 32 (the caller checks). Products of bfloat16 pairs are exact and summed in
// float32 (as TDPBF16PS does, bfloat16 subnormals as zero), the bias added in float32, one
// rounding to nearest even. Built by kvpage/model/native_amx.py where the CPU has AMX.
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <initializer_list>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vectors.h"

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "built only where the compiler targets AMX (kvpage/model/native_amx.py asks torch first)"
#endif

namespace {

constexpr int64_t kBlockN = 32;  // outputs per block: two B tiles
constexpr int64_t kStepK = 32;  // bfloat16 values of K per tile row
constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes
constexpr int64_t kPrefetchTiles = 8;  // 4 K steps ahead in a block's stream

struct TileConfig {  // the tile configuration memory layout, palette 1
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles: 0-1 A (rows 0-15, 16-31 of x), 2-3 B (the two halves of a block), 4-7 C (A i x B j at
// 4 + 2 i + j). `rows` is x's row count in this pass (1..32).
void configure(int64_t rows) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int64_t first = rows < 16 ? rows : 16, second = rows - first;
    for (int t : {0, 4, 5}) cfg.rows[t] = static_cast<uint8_t>(first);
    cfg.colsb[0] = 64;
    cfg.colsb[4] = cfg.colsb[5] = 64;
    if (second > 0) {
        for (int t : {1, 6, 7}) cfg.rows[t] = static_cast<uint8_t>(second);
        cfg.colsb[1] = cfg.colsb[6] = cfg.colsb[7] = 64;
    }
    cfg.rows[2] = cfg.rows[3] = 16;
    cfg.colsb[2] = cfg.colsb[3] = 64;
    _tile_loadconfig(&cfg);
}

// One block of 32 outputs for `rows` (1..32) rows of x: the K loop on tiles, then the epilogue
// from the C tiles through `acc` (32 x 32 float32).
void block(const BF16* tiles, const BF16* bias, const BF16* x, int64_t ldx, int64_t rows,
           int64_t K, int64_t n0, BF16* y, int64_t ldy, float* acc) {
    const bool two = rows > 16;
    _tile_zero(4);
    _tile_zero(5);
    if (two) {
        _tile_zero(6);
        _tile_zero(7);
    }
    const char* b = reinterpret_cast<const char*>(tiles);
    const int64_t steps = K / kStepK;
    for (int64_t s = 0; s < steps; s++, b += 2 * kTileBytes) {
        for (int64_t line = 0; line < 2 * kTileBytes; line += 64)
            _mm_prefetch(b + kPrefetchTiles * kTileBytes + line, _MM_HINT_T0);
        _tile_loadd(0, x + s * kStepK, ldx * 2);
        _tile_loadd(2, b, 64);
        _tile_loadd(3, b + kTileBytes, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
            _tile_loadd(1, x + 16 * ldx + s * kStepK, ldx * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, acc, kBlockN * 4);
    _tile_stored(5, acc + 16, kBlockN * 4);
    if (two) {
        _tile_stored(6, acc + 16 * kBlockN, kBlockN * 4);
        _tile_stored(7, acc + 16 * kBlockN + 16, kBlockN * 4);
    }
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < kBlockN; j++) {
            const float add = bias ? widen(bias[n0 + j]) : 0.0f;
            store(y + m * ldy + n0 + j, acc[m * kBlockN + j] + add);
        }
}

// x: (M, K) rows ldx apart; y: (M, N) rows ldy apart; bias (N,) or null. Rows in passes of 32,
// blocks of 32 outputs split statically over the threads.
void linear(const BF16* packed, const BF16* bias, const BF16* x, int64_t ldx, int64_t M,
            int64_t N, int64_t K, BF16* y, int64_t ldy, int threads) {
    const int64_t blocks = N / kBlockN;
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float acc[32 * kBlockN];
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int64_t rows = M - m0 < 32 ? M - m0 : 32;
            configure(rows);
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < blocks; nb++)
                block(packed + nb * K * kBlockN, bias, x + m0 * ldx, ldx, rows, K, nb * kBlockN,
                      y + m0 * ldy, ldy, acc);
        }
        _tile_release();
    }
}

}  // namespace

extern "C" {

// Whether this process may use the tiles (Linux grants AMX state per process on request).
int kvpage_amx_ready() {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// w (N, K) row-major -> packed (N * K values, the layout above).
void kvpage_amx_pack(const BF16* w, int64_t N, int64_t K, BF16* packed) {
    for (int64_t n0 = 0; n0 < N; n0 += kBlockN)
        for (int64_t k0 = 0; k0 < K; k0 += kStepK)
            for (int64_t h = 0; h < 2; h++)
                for (int64_t r = 0; r < 16; r++)
                    for (int64_t j = 0; j < 16; j++)
                        for (int64_t p = 0; p < 2; p++)
                            *packed++ = w[(n0 + 16 * h + j) * K + k0 + 2 * r + p];
}

// What AmxLinear (kvpage/model/native_amx.py) keeps of one layer: a ctypes Structure of the same
// layout, so that a native caller (decode_step.cpp) can call it like the weight GEMV's plan.
struct AmxPlan {
    const BF16* packed;
    const BF16* bias;  // or null
    int64_t out_features, in_features;
};

// y: (M, out_features) contiguous. The weight GEMV's signature (kvpage_weight_gemv).
void kvpage_amx_run(const AmxPlan* p, const BF16* x, int64_t ldx, int64_t M, BF16* y,
                    int threads) {
    linear(p->packed, p->bias, x, ldx, M, p->out_features, p->in_features, y, p->out_features,
           threads);
}

}  // extern "C"
