// A decode tape's replay (kvpage.model.decode_tape): the recorded kernel calls in order, from
// one native call. Each call is its entry point, the kind of its signature (the kernels' own,
// as kvpage/model/native_*.py bind them) and its arguments: integers and addresses in i[],
// floats in f[], each in the order they are passed.
#include <cstdint>

namespace {

struct Call {
    void* fn;
    int64_t kind;
    int64_t i[24];
    float f[2];
};

using P = void*;
using L = int64_t;

}  // namespace

#define I_(k) static_cast<int>(c.i[k])
#define L_(k) c.i[k]
#define P_(k) reinterpret_cast<void*>(c.i[k])

extern "C" int64_t kvpage_tape_call_bytes() { return sizeof(Call); }

extern "C" void kvpage_tape_replay(const Call* calls, int64_t n) {
    for (int64_t k = 0; k < n; ++k) {
        const Call& c = calls[k];
        switch (c.kind) {
            case 0:  // rms_norm: iplplpfllppi
                reinterpret_cast<void (*)(int, P, L, P, L, P, float, L, L, P, P, int)>(c.fn)(
                    I_(0), P_(1), L_(2), P_(3), L_(4), P_(5), c.f[0], L_(6), L_(7), P_(8), P_(9),
                    I_(10));
                break;
            case 1:  // rotary: ipllpllllppli
                reinterpret_cast<void (*)(int, P, L, L, P, L, L, L, L, P, P, L, int)>(c.fn)(
                    I_(0), P_(1), L_(2), L_(3), P_(4), L_(5), L_(6), L_(7), L_(8), P_(9), P_(10),
                    L_(11), I_(12));
                break;
            case 2:  // silu_mul: ippllpli
                reinterpret_cast<void (*)(int, P, P, L, L, P, L, int)>(c.fn)(
                    I_(0), P_(1), P_(2), L_(3), L_(4), P_(5), L_(6), I_(7));
                break;
            case 3:  // a linear kernel (weight GEMV, AMX): ppllpi
                reinterpret_cast<void (*)(P, P, L, L, P, int)>(c.fn)(P_(0), P_(1), L_(2), L_(3),
                                                                      P_(4), I_(5));
                break;
            case 4:  // paged_decode: iplpplllpppplllllllfpli
                reinterpret_cast<void (*)(int, P, L, P, P, L, L, L, P, P, P, P, L, L, L, L, L, L,
                                          L, float, P, L, int)>(c.fn)(
                    I_(0), P_(1), L_(2), P_(3), P_(4), L_(5), L_(6), L_(7), P_(8), P_(9), P_(10),
                    P_(11), L_(12), L_(13), L_(14), L_(15), L_(16), L_(17), L_(18), c.f[0],
                    P_(19), L_(20), I_(21));
                break;
            case 5:  // paged_write: ipplpplllpllll
                reinterpret_cast<void (*)(int, P, P, L, P, P, L, L, L, P, L, L, L, L)>(c.fn)(
                    I_(0), P_(1), P_(2), L_(3), P_(4), P_(5), L_(6), L_(7), L_(8), P_(9), L_(10),
                    L_(11), L_(12), L_(13));
                break;
            case 6:  // layer_norm: iplplppfllppi
                reinterpret_cast<void (*)(int, P, L, P, L, P, P, float, L, L, P, P, int)>(c.fn)(
                    I_(0), P_(1), L_(2), P_(3), L_(4), P_(5), P_(6), c.f[0], L_(7), L_(8), P_(9),
                    P_(10), I_(11));
                break;
            case 7:  // gelu_new: ipllpli
                reinterpret_cast<void (*)(int, P, L, L, P, L, int)>(c.fn)(
                    I_(0), P_(1), L_(2), L_(3), P_(4), L_(5), I_(6));
                break;
        }
    }
}
