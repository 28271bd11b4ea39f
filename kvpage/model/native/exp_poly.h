// e^x on a GCC float vector, Cephes' single-precision polynomial: within 2 ulp of expf for x in
// [-87.3, 88.72] (the caller clamps and handles the ends: expf's subnormals and overflow).
// Shared by the attention kernel's softmax and the small ops' silu; included by the kernels in
// kvpage/model/native/, and hashed into each kernel's build key by kvpage/model/native_build.py.
#pragma once
#include <cstring>

namespace {

// V: a float vector type, I: the int32 vector of the same lanes.
template <class V, class I>
inline V exp_in_range(V x) {
    const V round = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const V n = (x * 1.44269504088896341f + round) - round;
    const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
    V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // 2^n as two exact factors: n reaches 128 just below expf's overflow, -126 at -87.3.
    const I whole = __builtin_convertvector(n, I), half = whole >> 1;
    const I bits_a = (half + 127) << 23, bits_b = (whole - half + 127) << 23;
    V scale_a, scale_b;
    std::memcpy(&scale_a, &bits_a, sizeof scale_a);
    std::memcpy(&scale_b, &bits_b, sizeof scale_b);
    return p * scale_a * scale_b;
}

}  // namespace
