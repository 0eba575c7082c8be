// Ember's kernel prelude: included at the top of every generated translation unit.
// It compiles under NVRTC (device code) and, with EMBER_HOST defined, under a host C++20
// compiler, where `host_shim.h` runs each CUDA block on host threads (see emulate.rs).
// Nothing here includes CUDA headers: NVRTC finds none next to torch's libnvrtc.

#ifndef EMBER_HOST
#define EMBER_DEV __device__ __forceinline__
#define EMBER_MEMBER __device__ __forceinline__
typedef unsigned long long ember_u64;
#else
#define EMBER_DEV static inline
#define EMBER_MEMBER inline
#endif

typedef long long i64;

// ---- storage conversions for 16-bit floats (computed in f32) ----
#ifndef EMBER_HOST
EMBER_DEV float ember_h2f(unsigned short h) {
    float f;
    asm("{cvt.f32.f16 %0, %1;}" : "=f"(f) : "h"(h));
    return f;
}
EMBER_DEV unsigned short ember_f2h(float f) {
    unsigned short h;
    asm("{cvt.rn.f16.f32 %0, %1;}" : "=h"(h) : "f"(f));
    return h;
}
EMBER_DEV float ember_b2f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
EMBER_DEV unsigned short ember_f2b(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}
EMBER_DEV float ember_bits_f(unsigned int u) { return __uint_as_float(u); }
#define EMBER_INF __int_as_float(0x7f800000)
#define EMBER_NAN __int_as_float(0x7fffffff)
#define EMBER_INF64 __longlong_as_double(0x7ff0000000000000LL)
#define EMBER_NAN64 __longlong_as_double(0x7ff8000000000000LL)
#endif

// ---- math in the compute type (float for f16/bf16/f32, double for f64) ----
EMBER_DEV float ember_exp(float x) { return expf(x); }
EMBER_DEV double ember_exp(double x) { return exp(x); }
EMBER_DEV float ember_log(float x) { return logf(x); }
EMBER_DEV double ember_log(double x) { return log(x); }
EMBER_DEV float ember_sqrt(float x) { return sqrtf(x); }
EMBER_DEV double ember_sqrt(double x) { return sqrt(x); }
EMBER_DEV float ember_rsqrt(float x) { return 1.0f / sqrtf(x); }
EMBER_DEV double ember_rsqrt(double x) { return 1.0 / sqrt(x); }
EMBER_DEV float ember_tanh(float x) { return tanhf(x); }
EMBER_DEV double ember_tanh(double x) { return tanh(x); }
EMBER_DEV float ember_erf(float x) { return erff(x); }
EMBER_DEV double ember_erf(double x) { return erf(x); }
EMBER_DEV float ember_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
EMBER_DEV double ember_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
EMBER_DEV float ember_gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
EMBER_DEV double ember_gelu(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752)); }
EMBER_DEV float ember_gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}
EMBER_DEV double ember_gelu_tanh(double x) {
    return 0.5 * x * (1.0 + tanh(0.79788456080286536 * (x + 0.044715 * x * x * x)));
}
template <typename T> EMBER_DEV T ember_sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x); }
template <typename T> EMBER_DEV bool ember_isnan(T x) { return x != x; }
EMBER_DEV float ember_round(float x) { return rintf(x); }
EMBER_DEV double ember_round(double x) { return rint(x); }
// NaN-propagating max/min, as torch's maximum/minimum.
template <typename T> EMBER_DEV T ember_fmax(T a, T b) { return (a != a || b != b) ? a + b : (b > a ? b : a); }
template <typename T> EMBER_DEV T ember_fmin(T a, T b) { return (a != a || b != b) ? a + b : (b < a ? b : a); }
template <typename T> EMBER_DEV T ember_imax(T a, T b) { return b > a ? b : a; }
template <typename T> EMBER_DEV T ember_imin(T a, T b) { return b < a ? b : a; }
// Python-style remainder and floor division.
EMBER_DEV float ember_frem(float a, float b) { float m = fmodf(a, b); return (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) ? m + b : m; }
EMBER_DEV double ember_frem(double a, double b) { double m = fmod(a, b); return (m != 0.0 && ((b < 0.0) != (m < 0.0))) ? m + b : m; }
EMBER_DEV float ember_ffloordiv(float a, float b) {
    if (b == 0.0f) return a / b;
    float m = fmodf(a, b);
    float d = (a - m) / b;
    if (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) d -= 1.0f;
    if (d != 0.0f) { float f = floorf(d); if (d - f > 0.5f) f += 1.0f; return f; }
    return copysignf(0.0f, a / b);
}
EMBER_DEV double ember_ffloordiv(double a, double b) {
    if (b == 0.0) return a / b;
    double m = fmod(a, b);
    double d = (a - m) / b;
    if (m != 0.0 && ((b < 0.0) != (m < 0.0))) d -= 1.0;
    if (d != 0.0) { double f = floor(d); if (d - f > 0.5) f += 1.0; return f; }
    return copysign(0.0, a / b);
}
template <typename T> EMBER_DEV T ember_idiv(T a, T b) { return b == 0 ? T(0) : T(a / b); }
template <typename T> EMBER_DEV T ember_ifloordiv(T a, T b) {
    if (b == 0) return T(0);
    T q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? T(q - 1) : q;
}
template <typename T> EMBER_DEV T ember_irem(T a, T b) {
    if (b == 0) return T(0);
    T r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? T(r + b) : r;
}
template <typename T> EMBER_DEV T ember_ifmod(T a, T b) { return b == 0 ? T(0) : T(a % b); }
template <typename T> EMBER_DEV T ember_ipow(T base, T e) {
    if (e < 0) return base == 1 ? T(1) : (base == -1 ? ((e % 2 == 0) ? T(1) : T(-1)) : T(0));
    T r = 1;
    while (e > 0) { if (e & 1) r = T(r * base); base = T(base * base); e >>= 1; }
    return r;
}

// ---- index arithmetic on dims (Python floor semantics, as `Dim`) ----
EMBER_DEV i64 ember_dfloordiv(i64 a, i64 b) { i64 q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
EMBER_DEV i64 ember_dmod(i64 a, i64 b) { i64 r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
EMBER_DEV i64 ember_dmin(i64 a, i64 b) { return a < b ? a : b; }
EMBER_DEV i64 ember_dmax(i64 a, i64 b) { return a > b ? a : b; }

// An index read from a tensor: negative counts from the end; out of range records the
// failing node in meta[0] (the host raises) and reads element 0 instead.
EMBER_DEV i64 ember_index(i64* meta, i64 i, i64 n, i64 node) {
    if (i < 0) i += n;
    if (i < 0 || i >= n) {
#ifndef EMBER_HOST
        atomicCAS((ember_u64*)meta, 0ull, (ember_u64)(node + 1));
#else
        i64 expected = 0;
        __atomic_compare_exchange_n(meta, &expected, node + 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
#endif
        return 0;
    }
    return i;
}

// ---- block-wide reductions (blockDim.x a power of two, at most 1024) ----
// Every thread of the block must call these; they end with the result in every thread.
template <typename T, typename F>
EMBER_DEV T ember_block_reduce(T v, T* smem, F combine) {
    const unsigned t = threadIdx.x;
    smem[t] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) smem[t] = combine(smem[t], smem[t + s]);
        __syncthreads();
    }
    T r = smem[0];
    __syncthreads();
    return r;
}

// (value, index) pairs for argmax/argmin: the first extreme wins, NaN counts as extreme.
// An index of -1 marks "no element yet" and loses to anything.
template <typename T>
EMBER_DEV bool ember_arg_better(T a, i64 ia, T b, i64 ib, bool is_max) {
    if (ia < 0) return false;
    if (ib < 0) return true;
    bool an = a != a, bn = b != b;
    if (an || bn) return an && (!bn || ia < ib);
    if (a == b) return ia < ib;
    return is_max ? a > b : a < b;
}
template <typename T>
EMBER_DEV void ember_block_argreduce(T* v, i64* i, T* sv, i64* si, bool is_max) {
    const unsigned t = threadIdx.x;
    sv[t] = *v;
    si[t] = *i;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s && ember_arg_better(sv[t + s], si[t + s], sv[t], si[t], is_max)) {
            sv[t] = sv[t + s];
            si[t] = si[t + s];
        }
        __syncthreads();
    }
    *v = sv[0];
    *i = si[0];
    __syncthreads();
}

struct EmberSum { template <typename T> EMBER_MEMBER T operator()(T a, T b) const { return a + b; } };
struct EmberProd { template <typename T> EMBER_MEMBER T operator()(T a, T b) const { return a * b; } };
struct EmberFMax { template <typename T> EMBER_MEMBER T operator()(T a, T b) const { return ember_fmax(a, b); } };
struct EmberFMin { template <typename T> EMBER_MEMBER T operator()(T a, T b) const { return ember_fmin(a, b); } };
struct EmberIMax { template <typename T> EMBER_MEMBER T operator()(T a, T b) const { return ember_imax(a, b); } };

struct EmberIMin { template <typename T> EMBER_MEMBER T operator()(T a, T b) const { return ember_imin(a, b); } };

// ---- packed loads: 16 bytes at once (8 f16/bf16 or 4 f32), for bandwidth-bound sums ----
struct alignas(16) ember_pack { unsigned int w[4]; };
// The sum of the products of the 8 16-bit floats two packs hold, `load` widening each.
template <typename F>
EMBER_DEV float ember_pack_dot_16(ember_pack a, ember_pack b, F load) {
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) {
        s += load((unsigned short)(a.w[j] & 0xffffu)) * load((unsigned short)(b.w[j] & 0xffffu));
        s += load((unsigned short)(a.w[j] >> 16)) * load((unsigned short)(b.w[j] >> 16));
    }
    return s;
}
struct EmberLoadBf16 { EMBER_MEMBER float operator()(unsigned short x) const { return ember_b2f(x); } };
struct EmberLoadF16 { EMBER_MEMBER float operator()(unsigned short x) const { return ember_h2f(x); } };
EMBER_DEV float ember_pack_dot_bf16(ember_pack a, ember_pack b) {
    return ember_pack_dot_16(a, b, EmberLoadBf16());
}
EMBER_DEV float ember_pack_dot_f16(ember_pack a, ember_pack b) {
    return ember_pack_dot_16(a, b, EmberLoadF16());
}
EMBER_DEV float ember_pack_dot_f32(ember_pack a, ember_pack b) {
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) s += ember_bits_f(a.w[j]) * ember_bits_f(b.w[j]);
    return s;
}

// An RMS norm computed inside the product that reads it (`folded_norm.rs`): the sum of
// the squares of a pack of the norm's input, then the product's terms with each value
// normalized as the norm's own kernels round it — `round((x · rstd) · w)`, or with
// `round_first` (transformers' 16-bit norms) `round(round(x · rstd) · w)`, `round` to the
// stored type — before it multiplies `b`. Without a norm weight (`has_w` false) `w` is
// not read. Each 32-bit word holds two 16-bit values (low half first) or one f32.
template <typename F>
EMBER_DEV float ember_pack_sumsq_16(ember_pack x, F load) {
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) {
        const float lo = load((unsigned short)(x.w[j] & 0xffffu));
        const float hi = load((unsigned short)(x.w[j] >> 16));
        s += lo * lo;
        s += hi * hi;
    }
    return s;
}
template <typename F, typename R>
EMBER_DEV float ember_pack_norm_dot_16(ember_pack x, ember_pack w, ember_pack b, float rstd,
                                       bool has_w, bool round_first, F load, R round) {
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < 2; ++h) {
            const unsigned sh = 16 * h;
            float v = load((unsigned short)((x.w[j] >> sh) & 0xffffu)) * rstd;
            if (round_first) v = round(v);
            if (has_w) v = v * load((unsigned short)((w.w[j] >> sh) & 0xffffu));
            s += round(v) * load((unsigned short)((b.w[j] >> sh) & 0xffffu));
        }
    }
    return s;
}
struct EmberRoundBf16 { EMBER_MEMBER float operator()(float v) const { return ember_b2f(ember_f2b(v)); } };
struct EmberRoundF16 { EMBER_MEMBER float operator()(float v) const { return ember_h2f(ember_f2h(v)); } };
EMBER_DEV float ember_pack_sumsq_bf16(ember_pack x) { return ember_pack_sumsq_16(x, EmberLoadBf16()); }
EMBER_DEV float ember_pack_sumsq_f16(ember_pack x) { return ember_pack_sumsq_16(x, EmberLoadF16()); }
EMBER_DEV float ember_pack_sumsq_f32(ember_pack x) {
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) s += ember_bits_f(x.w[j]) * ember_bits_f(x.w[j]);
    return s;
}
EMBER_DEV float ember_pack_norm_dot_bf16(ember_pack x, ember_pack w, ember_pack b, float rstd,
                                         bool has_w, bool round_first) {
    return ember_pack_norm_dot_16(x, w, b, rstd, has_w, round_first, EmberLoadBf16(), EmberRoundBf16());
}
EMBER_DEV float ember_pack_norm_dot_f16(ember_pack x, ember_pack w, ember_pack b, float rstd,
                                        bool has_w, bool round_first) {
    return ember_pack_norm_dot_16(x, w, b, rstd, has_w, round_first, EmberLoadF16(), EmberRoundF16());
}
// f32 values need no rounding (`round_first` has nothing to do).
EMBER_DEV float ember_pack_norm_dot_f32(ember_pack x, ember_pack w, ember_pack b, float rstd,
                                        bool has_w, bool) {
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) {
        float v = ember_bits_f(x.w[j]) * rstd;
        if (has_w) v = v * ember_bits_f(w.w[j]);
        s += v * ember_bits_f(b.w[j]);
    }
    return s;
}

// ---- warp-wide reductions (blockDim.x a multiple of 32) ----
// `combine` over the 32 lanes of each warp, the result in every lane; every lane of the
// warp must call it (a full-mask shuffle). On the GPU a butterfly of shuffles; the
// emulator has no shuffles, so there the warp's threads meet in `smem` (a slot per
// thread) at the warp's barrier.
#ifndef EMBER_HOST
template <typename T, typename F>
EMBER_DEV T ember_warp_reduce(T v, T*, F combine) {
    for (int o = 16; o > 0; o >>= 1) v = combine(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
#else
template <typename T, typename F>
EMBER_DEV T ember_warp_reduce(T v, T* smem, F combine) {
    const unsigned t = threadIdx.x, lane = t & 31u;
    smem[t] = v;
    __syncwarp();
    for (unsigned s = 16; s > 0; s >>= 1) {
        if (lane < s) smem[t] = combine(smem[t], smem[t + s]);
        __syncwarp();
    }
    T r = smem[t - lane];
    __syncwarp();
    return r;
}
#endif

// Counts one more arrival at `*c` (a device-wide atomic), returning the count before it:
// how a row's last block of split attention knows it is last. `__threadfence` orders a
// block's writes before its arrival (on the host, the emulator's blocks run one after
// another; the fence keeps the shim's threads ordered too).
#ifndef EMBER_HOST
EMBER_DEV i64 ember_arrive(i64* c) { return (i64)atomicAdd((ember_u64*)c, 1ull); }
#else
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
EMBER_DEV i64 ember_arrive(i64* c) { return __atomic_fetch_add(c, 1, __ATOMIC_SEQ_CST); }
#endif

// Scatter reductions: atomic on the GPU (CAS loops where CUDA has no atomic op); the
// emulator runs scatter threads one at a time, so a plain update is atomic there.
template <typename T, typename F>
EMBER_DEV void ember_atomic_update(T* p, T v, F f) {
#ifndef EMBER_HOST
    if (sizeof(T) == 4) {
        unsigned int* q = (unsigned int*)p;
        unsigned int old = *q, assumed;
        do {
            assumed = old;
            union { unsigned int u; T t; } a, b;
            a.u = assumed;
            b.t = f(a.t, v);
            old = atomicCAS(q, assumed, b.u);
        } while (assumed != old);
    } else {
        ember_u64* q = (ember_u64*)p;
        ember_u64 old = *q, assumed;
        do {
            assumed = old;
            union { ember_u64 u; T t; } a, b;
            a.u = assumed;
            b.t = f(a.t, v);
            old = atomicCAS(q, assumed, b.u);
        } while (assumed != old);
    }
#else
    *p = f(*p, v);
#endif
}

// Compensated (Kahan) accumulation for float sums over long rows.
template <typename T> struct EmberKahan {
    T sum, c;
    EMBER_MEMBER void add(T x) { T y = x - c; T t = sum + y; c = (t - sum) - y; sum = t; }
};

// ---- tensor-core tiles: mma.m16n8k16, f16/bf16 operands, f32 accumulators ----
// D += A·B for one warp: A 16×16, B 16×8, D 16×8, each lane holding its fragments as the
// PTX ISA lays them out ("Matrix Fragments for mma.m16n8k16"). With g = lane / 4 and
// t = lane % 4, each 32-bit register holds two 16-bit values, the lower index in the low
// half:
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1]   d[2], d[3] = D[g+8][2t, 2t+1]
// Every lane of the warp calls it. The GPU runs one instruction (sm_80 and newer: the CUDA
// backend offers kernels using it only there). The emulator's lanes exchange their
// fragments in `slots` (8 words a thread, `EMBER_WARP_SLOTS`) and each computes its four
// sums: the emulator's results check the kernels against this layout.
#ifndef EMBER_HOST
#define EMBER_WARP_SLOTS(name) unsigned* name = 0
// `d += a·b` by one instruction, the operands of 16-bit type `T` (bf16 or f16).
#if __CUDA_ARCH__ >= 800
#define EMBER_MMA_16816(T)                                                      \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." #T "." #T ".f32 "     \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"        \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
#else
#define EMBER_MMA_16816(T) __trap()
#endif
EMBER_DEV void ember_mma_bf16(float* d, const unsigned* a, const unsigned* b, unsigned*) {
    EMBER_MMA_16816(bf16);
}
EMBER_DEV void ember_mma_f16(float* d, const unsigned* a, const unsigned* b, unsigned*) {
    EMBER_MMA_16816(f16);
}
// `combine` over the 4 lanes of a quad (the lanes sharing g: one row of a D fragment),
// the result in each of them.
template <typename F>
EMBER_DEV float ember_quad_reduce(float v, unsigned*, F combine) {
    v = combine(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return combine(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
#else
#define EMBER_WARP_SLOTS(name) __shared__ unsigned name[8 * 1024]
template <typename W>
static void ember_mma_host(float* d, const unsigned* a, const unsigned* b, unsigned* slots, W widen) {
    const unsigned t = threadIdx.x, lane = t & 31u, g = lane >> 2, tq = lane & 3u;
    unsigned* mine = slots + 8 * t;
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b[0];
    mine[5] = b[1];
    __syncwarp();
    const unsigned* warp = slots + 8 * (t - lane);
    auto half = [&](unsigned word, unsigned k) {
        return widen((unsigned short)((k & 1u) ? word >> 16 : word & 0xffffu));
    };
    // The lane and register holding A[r][k] and B[k][n], from the layout above.
    auto A = [&](unsigned r, unsigned k) {
        return half(warp[8 * ((r & 7u) * 4 + ((k & 7u) >> 1)) + (r >> 3) + 2 * (k >> 3)], k);
    };
    auto B = [&](unsigned k, unsigned n) {
        return half(warp[8 * (n * 4 + ((k & 7u) >> 1)) + 4 + (k >> 3)], k);
    };
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned r = g + 8 * (i >> 1), n = 2 * tq + (i & 1u);
        float s = 0.0f;
        for (unsigned k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
        d[i] += s;
    }
    __syncwarp();
}
static void ember_mma_bf16(float* d, const unsigned* a, const unsigned* b, unsigned* slots) {
    ember_mma_host(d, a, b, slots, EmberLoadBf16());
}
static void ember_mma_f16(float* d, const unsigned* a, const unsigned* b, unsigned* slots) {
    ember_mma_host(d, a, b, slots, EmberLoadF16());
}
template <typename F>
static float ember_quad_reduce(float v, unsigned* slots, F combine) {
    // A thread's own 8 words, as in `ember_mma_host`: warps run at once.
    const unsigned t = threadIdx.x, q = t & ~3u;
    slots[8 * t] = ember_f_bits(v);
    __syncwarp();
    auto at = [&](unsigned i) { return ember_bits_f(slots[8 * (q + i)]); };
    const float r = combine(combine(at(0), at(1)), combine(at(2), at(3)));
    __syncwarp();
    return r;
}
#endif
// Two 16-bit values in one register, `lo` in the low half.
EMBER_DEV unsigned ember_pack2(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}
