// The float vector the weight and attention kernels compute in, and their scalar and vector
// loads and stores of float32 and bfloat16. The vector is the CPU's widest: 16 float32 lanes with
// AVX-512, else 8; on AVX2 a 16-float vector takes two of the 16 registers, and the kernels'
// register tiles spilled. bfloat16 is widened exactly (a shift) and rounded to nearest even.
// Included by the kernels in kvpage/model/native/; kvpage/model/native_build.py hashes it into
// each kernel's build key.
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
#define KV_LANES 16
#else
#define KV_LANES 8
#endif

namespace {

typedef float fvec __attribute__((vector_size(KV_LANES * 4)));
typedef uint16_t u16vec __attribute__((vector_size(KV_LANES * 2)));
typedef uint32_t u32vec __attribute__((vector_size(KV_LANES * 4)));
typedef int32_t i32vec __attribute__((vector_size(KV_LANES * 4)));
constexpr int64_t kLanes = KV_LANES;

struct BF16 {
    uint16_t bits;
};

inline fvec load(const float* p) {
    fvec x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

inline fvec load(const BF16* p) {
#if !defined(__AVX512F__) && defined(__AVX2__)
    // GCC widens u16 -> u32 lane by lane here: zero-extend and shift explicitly.
    const __m256i bits =
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
    u16vec half;
    std::memcpy(&half, p, sizeof half);
    u32vec bits = __builtin_convertvector(half, u32vec) << 16;
#endif
    fvec x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

inline void store(float* p, fvec x) { std::memcpy(p, &x, sizeof x); }

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

}  // namespace
