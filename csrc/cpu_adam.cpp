// Fused CPU Adam/AdamW step over flat ranges of the host-resident FP32 master state.
//
// One pass over memory per element: read p, m, v (FP32 unless noted below) and the gradient (BF16
// or FP32, times a scale), write p, m, v and optionally a BF16 copy of p. The BF16 copy may
// overwrite a BF16 gradient in place: each lane's gradient is loaded before its output is stored,
// and no pointer is declared restrict. The params may instead be BF16 (a BF16 master,
// MegaTrain-style): each is widened to FP32 exactly, updated in FP32 and rounded back in place, in
// the same pass (a separate widening copy would cost the update a second pass and an allocation
// per call). The two moments may be BF16 too (both or neither), handled the same way: widened
// exactly, updated by the same FP32 arithmetic and stored rounded to nearest even (NaNs stay NaN),
// the rounding of the BF16 params and output; a step then equals the FP32 step on FP32 copies of
// the moments with the moments rounded back to BF16. BF16 moments take a pass's memory traffic
// from 28 bytes per parameter to 20 (FP32 params, BF16 gradient overwritten by the BF16 output).
// Or the moments are blockwise 8-bit (torchao's AdamW8bit format, bitsandbytes' dynamic-tree
// code): per block of kQBlock elements, one FP32 absmax scale and one byte code per element, the
// code indexing a sorted 256-entry table (signed for exp_avg, unsigned for exp_avg_sq). A block is
// dequantized into FP32 on the stack, updated by the same FP32 arithmetic (the params take the
// unrounded moments, as torchao does), and requantized in the same pass: 16 bytes per parameter.
// The arithmetic follows torch's fused CPU kernel operation by operation (same float roundings of
// the double-precision coefficients, same lerp, same evaluation order, and explicit FMAs exactly
// where torch's x86 build contracts to one),
// and the build uses -ffp-contract=off, so every ISA path produces bit-identical results, equal
// to torch.optim.AdamW(fused=True) or within an ulp where a torch build rounds differently.
//
// Built as a plain shared library (no torch headers) and called through ctypes from
// slidedp/cpu_adam.py; ctypes releases the GIL for the call. One build serves every x86 CPU: each
// ISA path is compiled with its own function-level target attribute and picked at run time.
// The library also exports slidedp_grad_accumulate, the host-side gradient sum/accumulation that
// returns the clipping norm's sum of squares from the same pass, slidedp_stream_triad, STREAM's
// triad on the same threads, and slidedp_pin_helpers, which pins the pool's threads to cores.

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Codes shared with slidedp/cpu_adam.py.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// Per-call scalars, rounded to float the way torch's fused CPU kernel rounds them.
struct Coeffs {
  float grad_scale;
  float decay;          // AdamW: 1 - lr * wd, applied to p before the update
  float l2;             // plain Adam: wd, added to the gradient as wd * p
  float lerp_weight;    // 1 - beta1: m.lerp_(g, 1 - beta1)
  float lerp_weight_m1; // lerp_weight - 1, used with base g when the weight is >= 0.5 (as torch)
  bool lerp_small;
  float beta2;
  float beta2_c;        // 1 - beta2
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  bool stream_shadow;   // the BF16 output is not the gradient's memory (adam_lanes)
};

// ---------------------------------------------------------------------------------------------
// Lanes. The math below is written once with GCC vector extensions (operators act lane-wise and
// broadcast scalars); each ISA supplies only its width, square root, fused multiply-add and,
// where the hardware has one, a BF16 conversion instruction.

using u8x8 = uint8_t __attribute__((vector_size(8)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using u16x16 = uint16_t __attribute__((vector_size(32)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using f32x8 = float __attribute__((vector_size(32)));
using f32x16 = float __attribute__((vector_size(64)));

template <class To, class From>
inline To convert(From x) {
  if constexpr (std::is_arithmetic_v<From>) {
    return To(x);
  } else {
    return __builtin_convertvector(x, To);
  }
}

template <class V>
inline V load(const void* src) {
  V x;
  std::memcpy(&x, src, sizeof(V));
  return x;
}

template <class V>
inline void store(void* dst, V x) {
  std::memcpy(dst, &x, sizeof(V));
}

// FP32 lanes from FP32 or BF16 memory (a gradient, the params or the moments). BF16 -> FP32 is
// exact: the BF16 bits are the high half of the FP32 bits.
template <class Ops>
inline typename Ops::V load_f32(const uint16_t* x) {
  using U = typename Ops::U;
  return __builtin_bit_cast(typename Ops::V, U(convert<U>(load<typename Ops::H>(x)) << 16));
}

template <class Ops>
inline typename Ops::V load_f32(const float* x) {
  return load<typename Ops::V>(x);
}

// FP32 -> BF16 with round-to-nearest-even, as torch's .to(torch.bfloat16); NaNs stay NaN (quieted),
// as the hardware instruction does.
template <class Ops>
inline typename Ops::H to_bf16_rne(typename Ops::V x) {
  using U = typename Ops::U;
  const U bits = __builtin_bit_cast(U, x);
  const U rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const U quiet_nan = (bits >> 16) | 0x40u;
  return convert<typename Ops::H>(U(x != x ? quiet_nan : rounded));
}

struct ScalarOps {
  using V = float;
  using U = uint32_t;
  using H = uint16_t;
  using B = uint8_t;
  static constexpr int64_t kWidth = 1;
  static constexpr bool kPermute = false;
  static V sqrt(V x) { return __builtin_sqrtf(x); }
  static V gather(const float* table, U index) { return table[index]; }
  static V fma(V a, V x, V y) { return __builtin_fmaf(a, x, y); }
  static void store_bf16(uint16_t* dst, V x) { store(dst, to_bf16_rne<ScalarOps>(x)); }
  static void stream_bf16(uint16_t* dst, V x) { store_bf16(dst, x); }
};

// FP32 lanes to FP32 or BF16 memory (the params or the moments), BF16 rounded by Ops::store_bf16.
template <class Ops>
inline void store_f32(float* dst, typename Ops::V x) {
  store(dst, x);
}

template <class Ops>
inline void store_f32(uint16_t* dst, typename Ops::V x) {
  Ops::store_bf16(dst, x);
}

#if defined(__x86_64__)
#define SLIDEDP_AVX2 __attribute__((target("avx2,fma")))
#define SLIDEDP_AVX512 __attribute__((target("avx512f")))
#define SLIDEDP_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// One vector of the BF16 shadow: a non-temporal store where dst is aligned for it (adam_lanes
// says why), else a plain one.
SLIDEDP_AVX2 inline void stream_vector(uint16_t* dst, u16x8 h) {
  if (reinterpret_cast<uintptr_t>(dst) % sizeof(h) != 0) return store(dst, h);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst), __builtin_bit_cast(__m128i, h));
}

SLIDEDP_AVX512 inline void stream_vector(uint16_t* dst, u16x16 h) {
  if (reinterpret_cast<uintptr_t>(dst) % sizeof(h) != 0) return store(dst, h);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), __builtin_bit_cast(__m256i, h));
}

struct Avx2Ops {
  using V = f32x8;
  using U = u32x8;
  using H = u16x8;
  using B = u8x8;
  static constexpr int64_t kWidth = 8;
  static constexpr bool kPermute = false;
  SLIDEDP_AVX2 static V sqrt(V x) { return _mm256_sqrt_ps(x); }
  SLIDEDP_AVX2 static V gather(const float* table, U index) {
    return _mm256_i32gather_ps(table, __builtin_bit_cast(__m256i, index), 4);
  }
  SLIDEDP_AVX2 static V fma(V a, V x, V y) { return _mm256_fmadd_ps(a, x, y); }
  SLIDEDP_AVX2 static void store_bf16(uint16_t* dst, V x) { store(dst, to_bf16_rne<Avx2Ops>(x)); }
  SLIDEDP_AVX2 static void stream_bf16(uint16_t* dst, V x) { stream_vector(dst, to_bf16_rne<Avx2Ops>(x)); }
};

struct Avx512Ops {
  using V = f32x16;
  using U = u32x16;
  using H = u16x16;
  using B = u8x16;
  static constexpr int64_t kWidth = 16;
  SLIDEDP_AVX512 static V sqrt(V x) { return _mm512_sqrt_ps(x); }
  SLIDEDP_AVX512 static V fma(V a, V x, V y) { return _mm512_fmadd_ps(a, x, y); }
  SLIDEDP_AVX512 static void store_bf16(uint16_t* dst, V x) { store(dst, to_bf16_rne<Avx512Ops>(x)); }
  SLIDEDP_AVX512 static void stream_bf16(uint16_t* dst, V x) { stream_vector(dst, to_bf16_rne<Avx512Ops>(x)); }
  // Table lookups in registers: a gather costs more than the whole update of its lanes on some
  // CPUs, and every 8-bit element needs two lookups and two searches.
  static constexpr bool kPermute = true;
  // table[index] for a 256-entry table: eight 32-entry permutes, then a select on bits 5, 6, 7.
  SLIDEDP_AVX512 static V lookup(const float* table, U index) {
    const __m512i k = __builtin_bit_cast(__m512i, index);
    __m512 r[8];
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * j), k, _mm512_loadu_ps(table + 32 * j + 16));
    }
    const __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(128));
    const __m512 lo = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[0], r[1]), _mm512_mask_blend_ps(b5, r[2], r[3]));
    const __m512 hi = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[4], r[5]), _mm512_mask_blend_ps(b5, r[6], r[7]));
    return __builtin_bit_cast(V, _mm512_mask_blend_ps(b7, lo, hi));
  }
  // The count of thresholds <= x (QCode): eight levels of a binary search, each level's
  // candidates in at most eight registers (QCode::levels), so level L costs 2^L / 16 permutes.
  SLIDEDP_AVX512 static U search(const float* levels, V x) {
    const __m512 xv = __builtin_bit_cast(__m512, x);
    __m512i k = _mm512_setzero_si512();
    k = descend(k, xv, _mm512_set1_ps(levels[0]));
    for (int at = 16; at <= 64; at += 16) k = descend(k, xv, _mm512_permutexvar_ps(k, _mm512_loadu_ps(levels + at)));
    k = descend(k, xv, pair(levels + 80, k));
    const __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    k = descend(k, xv, _mm512_mask_blend_ps(b5, pair(levels + 112, k), pair(levels + 144, k)));
    const __mmask16 c5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    const __mmask16 c6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
    k = descend(k, xv, _mm512_mask_blend_ps(c6, _mm512_mask_blend_ps(c5, pair(levels + 176, k), pair(levels + 208, k)),
                                            _mm512_mask_blend_ps(c5, pair(levels + 240, k), pair(levels + 272, k))));
    return __builtin_bit_cast(U, k);
  }
  // One level: k = 2k + (x >= candidate), false for NaN as in the scalar compare.
  SLIDEDP_AVX512 static __m512i descend(__m512i k, __m512 x, __m512 candidate) {
    const __m512i twice = _mm512_add_epi32(k, k);
    return _mm512_mask_add_epi32(twice, _mm512_cmp_ps_mask(x, candidate, _CMP_GE_OQ), twice, _mm512_set1_epi32(1));
  }
  // Codes (< 256) to bytes in one instruction: a generic narrowing is compiled lane by lane.
  SLIDEDP_AVX512 static void store_codes(uint8_t* dst, U code) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(__builtin_bit_cast(__m512i, code)));
  }
  SLIDEDP_AVX512 static U load_codes(const uint8_t* src) {
    return __builtin_bit_cast(U, _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  }
  // Entry k of the 32 floats at `at`.
  SLIDEDP_AVX512 static __m512 pair(const float* at, __m512i k) {
    return _mm512_permutex2var_ps(_mm512_loadu_ps(at), k, _mm512_loadu_ps(at + 16));
  }
};

struct Avx512Bf16Ops : Avx512Ops {
  // vcvtneps2bf16 rounds to nearest even but treats denormal inputs as zero; torch keeps them, so
  // a vector holding one (never seen in real weights) takes the integer path.
  SLIDEDP_AVX512BF16 static H to_bf16(V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 zero_exponent = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F800000));
    if (__builtin_expect(_mm512_mask_test_epi32_mask(zero_exponent, bits, _mm512_set1_epi32(0x007FFFFF)), 0)) {
      return to_bf16_rne<Avx512Ops>(x);
    }
    return __builtin_bit_cast(H, _mm512_cvtneps_pbh(x));
  }
  SLIDEDP_AVX512BF16 static void store_bf16(uint16_t* dst, V x) { store(dst, to_bf16(x)); }
  SLIDEDP_AVX512BF16 static void stream_bf16(uint16_t* dst, V x) { stream_vector(dst, to_bf16(x)); }
};
#endif  // __x86_64__

// ---------------------------------------------------------------------------------------------
// The update, on Ops::kWidth elements.

template <class Ops, class ParamT, class GradT, class MomentT, bool kL2, bool kBf16Out>
inline void adam_lanes(const Coeffs& c, ParamT* p, const GradT* g, MomentT* m, MomentT* v, uint16_t* out) {
  using V = typename Ops::V;
  const auto splat = [](float x) { return x - V{}; };  // x - 0 is x, signed zeros included
  V grad = load_f32<Ops>(g) * c.grad_scale;
  V param = load_f32<Ops>(p);
  if constexpr (kL2) {
    grad = Ops::fma(splat(c.l2), param, grad);
  } else {
    param = param * c.decay;
  }
  V exp_avg = load_f32<Ops>(m);
  const V diff = grad - exp_avg;
  exp_avg = c.lerp_small ? Ops::fma(splat(c.lerp_weight), diff, exp_avg) : Ops::fma(splat(c.lerp_weight_m1), diff, grad);
  const V exp_avg_sq = Ops::fma(c.beta2_c * grad, grad, load_f32<Ops>(v) * c.beta2);
  const V denom = Ops::sqrt(exp_avg_sq) / c.bc2_sqrt + c.eps;
  param = param + c.neg_step_size * exp_avg / denom;
  store_f32<Ops>(p, param);
  store_f32<Ops>(m, exp_avg);
  store_f32<Ops>(v, exp_avg_sq);
  // The BF16 output is read next by the GPU's copy, not by this pass. Apart from the gradient it
  // is streamed: that skips the read-for-ownership a plain store costs (2 of the 30 bytes per
  // parameter that cross the memory bus otherwise). Over the gradient (SlideDP's shadow holding
  // it) the line was just read, and a plain store writes it back without a second read.
  if constexpr (kBf16Out) {
    if (c.stream_shadow) {
      Ops::stream_bf16(out, param);
    } else {
      Ops::store_bf16(out, param);
    }
  }
}

template <class Ops, class ParamT, class GradT, class MomentT, bool kL2, bool kBf16Out>
inline void adam_range(const Coeffs& coeffs, ParamT* p, const GradT* g, MomentT* m, MomentT* v, uint16_t* out,
                       int64_t n) {
  const Coeffs c = coeffs;  // a local copy cannot alias the stores, so it stays in registers
  int64_t i = 0;
  for (; i + Ops::kWidth <= n; i += Ops::kWidth) {
    adam_lanes<Ops, ParamT, GradT, MomentT, kL2, kBf16Out>(c, p + i, g + i, m + i, v + i,
                                                           kBf16Out ? out + i : nullptr);
  }
  for (; i < n; ++i) {
    adam_lanes<ScalarOps, ParamT, GradT, MomentT, kL2, kBf16Out>(c, p + i, g + i, m + i, v + i,
                                                                 kBf16Out ? out + i : nullptr);
  }
}

using RangeFn = void (*)(const Coeffs&, void*, const void*, void*, void*, uint16_t*, int64_t);

// ---------------------------------------------------------------------------------------------
// Blockwise 8-bit moments. The elements of one scale, as torchao's AdamW8bit blocks them; the
// runtime's shards and chunks are multiples of it (slidedp/layout.py SHARD_ALIGN).
constexpr int64_t kQBlock = 128;

// One moment's 8-bit code (slidedp/cpu_adam.py builds the tables): its 256 sorted values, and
// for each code c the least float that quantizes above c (the last is NaN: nothing does).
// torchao's quantize_8bit_with_qmap picks the nearest value by a binary search for the last value
// <= x and a step up when x - value >= gap * 0.5, in float; that test is monotone in x, so each
// code's inputs form one interval and the code is the count of thresholds <= x: one search of
// eight compares, no fix-up, the very codes torchao stores.
struct QCode {
  const float* values;
  const float* thresholds;
  // The thresholds in the order the search reads them: level L (2^L candidates, the k-th being
  // thresholds[k * 2^(8-L) + 2^(7-L) - 1]) at kLevelAt[L], each level padded to a register.
  float levels[304];
};
constexpr int kLevelAt[8] = {0, 16, 32, 48, 64, 80, 112, 176};

void fill_levels(QCode& q) {
  for (int level = 0; level < 8; ++level) {
    for (int k = 0; k < (1 << level); ++k) {
      q.levels[kLevelAt[level] + k] = q.thresholds[k * (256 >> level) + (128 >> level) - 1];
    }
  }
}

struct QMaps {
  QCode exp_avg;     // signed
  QCode exp_avg_sq;  // unsigned
};

template <class Ops>
inline typename Ops::V code_values(const QCode& q, typename Ops::U code) {
  if constexpr (Ops::kPermute) {
    return Ops::lookup(q.values, code);
  } else {
    return Ops::gather(q.values, code);
  }
}

template <class Ops>
inline void store_codes(uint8_t* dst, typename Ops::U code) {
  if constexpr (Ops::kPermute) {
    Ops::store_codes(dst, code);
  } else {
    store(dst, convert<typename Ops::B>(code));
  }
}

template <class Ops>
inline typename Ops::U load_codes(const uint8_t* src) {
  if constexpr (Ops::kPermute) {
    return Ops::load_codes(src);
  } else {
    return convert<typename Ops::U>(load<typename Ops::B>(src));
  }
}

template <class Ops>
inline typename Ops::U quantize_lanes(typename Ops::V x, const QCode& q) {
  if constexpr (Ops::kPermute) {
    return Ops::search(q.levels, x);
  } else {
    using U = typename Ops::U;
    U code = U{};
    for (uint32_t step = 128; step >= 1; step /= 2) {
      code = x >= Ops::gather(q.thresholds, code + (step - 1)) ? code + step : code;
    }
    return code;
  }
}

// One block's scale, as torchao takes it: max |x| clipped below at 1e-12, NaN if any x is NaN
// (torch's amax propagates NaN). Taken on the bits: for non-negative floats the integer order is
// the float order, and every NaN's bits are above infinity's, so one unsigned max finds both.
template <class Ops>
inline float block_scale(const float* x, int64_t n) {
  using U = typename Ops::U;
  U best = U{};
  int64_t i = 0;
  for (; i + Ops::kWidth <= n; i += Ops::kWidth) {
    const U bits = U(load<U>(x + i) & 0x7FFFFFFFu);
    best = bits > best ? bits : best;
  }
  uint32_t top = 0;
  if constexpr (Ops::kWidth == 1) {
    top = best;
  } else {
    for (int64_t k = 0; k < Ops::kWidth; ++k) top = std::max<uint32_t>(top, best[k]);
  }
  for (; i < n; ++i) top = std::max(top, __builtin_bit_cast(uint32_t, x[i]) & 0x7FFFFFFFu);
  return top > 0x7F800000u ? __builtin_nanf("") : std::max(__builtin_bit_cast(float, top), 1e-12f);
}

template <class Ops>
inline void dequantize_block(const uint8_t* codes, float scale, const QCode& q, float* x, int64_t n) {
  using U = typename Ops::U;
  int64_t i = 0;
  for (; i + Ops::kWidth <= n; i += Ops::kWidth) {
    store(x + i, code_values<Ops>(q, load_codes<Ops>(codes + i)) * scale);
  }
  for (; i < n; ++i) x[i] = q.values[codes[i]] * scale;
}

// torchao's quantize: codes of x / scale, scale = block_scale (a division, as torchao divides).
template <class Ops>
inline void quantize_block(const float* x, int64_t n, const QCode& q, uint8_t* codes, float* scale) {
  const float s = block_scale<Ops>(x, n);
  *scale = s;
  int64_t i = 0;
  for (; i + Ops::kWidth <= n; i += Ops::kWidth) {
    store_codes<Ops>(codes + i, quantize_lanes<Ops>(load<typename Ops::V>(x + i) / s, q));
  }
  for (; i < n; ++i) codes[i] = static_cast<uint8_t>(quantize_lanes<ScalarOps>(x[i] / s, q));
}

template <class Ops, class ParamT, class GradT, bool kL2, bool kBf16Out>
inline void adam_range_q8(const Coeffs& coeffs, const QMaps& q, ParamT* p, const GradT* g, uint8_t* m_codes,
                          float* m_scale, uint8_t* v_codes, float* v_scale, uint16_t* out, int64_t n) {
  alignas(64) float m[kQBlock];
  alignas(64) float v[kQBlock];
  for (int64_t lo = 0, b = 0; lo < n; lo += kQBlock, ++b) {
    const int64_t len = std::min(kQBlock, n - lo);
    dequantize_block<Ops>(m_codes + lo, m_scale[b], q.exp_avg, m, len);
    dequantize_block<Ops>(v_codes + lo, v_scale[b], q.exp_avg_sq, v, len);
    adam_range<Ops, ParamT, GradT, float, kL2, kBf16Out>(coeffs, p + lo, g + lo, m, v,
                                                         kBf16Out ? out + lo : nullptr, len);
    quantize_block<Ops>(m, len, q.exp_avg, m_codes + lo, m_scale + b);
    quantize_block<Ops>(v, len, q.exp_avg_sq, v_codes + lo, v_scale + b);
  }
}

using Q8Fn = void (*)(const Coeffs&, const QMaps&, void*, const void*, uint8_t*, float*, uint8_t*, float*,
                      uint16_t*, int64_t);

// One entry point per ISA; `flatten` inlines the generic code above into the target-specific
// function, so it is compiled for that ISA (a generic callee cannot inline target intrinsics).
#define SLIDEDP_KERNEL(NAME, OPS, ...)                                                                 \
  struct NAME {                                                                                        \
    template <class ParamT, class GradT, class MomentT, bool kL2, bool kBf16Out>                       \
    __VA_ARGS__ __attribute__((flatten)) static void run(                                              \
        const Coeffs& c, void* p, const void* g, void* m, void* v, uint16_t* out, int64_t n) {         \
      adam_range<OPS, ParamT, GradT, MomentT, kL2, kBf16Out>(                                          \
          c, static_cast<ParamT*>(p), static_cast<const GradT*>(g), static_cast<MomentT*>(m),          \
          static_cast<MomentT*>(v), out, n);                                                           \
    }                                                                                                  \
    template <class ParamT, class GradT, bool kL2, bool kBf16Out>                                      \
    __VA_ARGS__ __attribute__((flatten)) static void run_q8(                                           \
        const Coeffs& c, const QMaps& q, void* p, const void* g, uint8_t* mc, float* ms, uint8_t* vc,  \
        float* vs, uint16_t* out, int64_t n) {                                                         \
      adam_range_q8<OPS, ParamT, GradT, kL2, kBf16Out>(c, q, static_cast<ParamT*>(p),                  \
                                                      static_cast<const GradT*>(g), mc, ms, vc, vs,    \
                                                      out, n);                                         \
    }                                                                                                  \
  };

SLIDEDP_KERNEL(ScalarKernel, ScalarOps)
#if defined(__x86_64__)
SLIDEDP_KERNEL(Avx2Kernel, Avx2Ops, SLIDEDP_AVX2)
SLIDEDP_KERNEL(Avx512Kernel, Avx512Ops, SLIDEDP_AVX512)
SLIDEDP_KERNEL(Avx512Bf16Kernel, Avx512Bf16Ops, SLIDEDP_AVX512BF16)
#endif

template <class Kernel, class ParamT, class GradT, class MomentT>
RangeFn pick_flags(bool l2, bool bf16_out) {
  if (l2) {
    return bf16_out ? &Kernel::template run<ParamT, GradT, MomentT, true, true>
                    : &Kernel::template run<ParamT, GradT, MomentT, true, false>;
  }
  return bf16_out ? &Kernel::template run<ParamT, GradT, MomentT, false, true>
                  : &Kernel::template run<ParamT, GradT, MomentT, false, false>;
}

template <class Kernel, class ParamT, class GradT>
RangeFn pick_moments(bool moments_bf16, bool l2, bool bf16_out) {
  return moments_bf16 ? pick_flags<Kernel, ParamT, GradT, uint16_t>(l2, bf16_out)
                      : pick_flags<Kernel, ParamT, GradT, float>(l2, bf16_out);
}

// BF16 params are their own BF16 output: the caller passes no other (slidedp_cpu_adam_update).
template <class Kernel>
RangeFn pick(bool param_bf16, bool grad_bf16, bool moments_bf16, bool l2, bool bf16_out) {
  if (param_bf16) {
    return grad_bf16 ? pick_moments<Kernel, uint16_t, uint16_t>(moments_bf16, l2, false)
                     : pick_moments<Kernel, uint16_t, float>(moments_bf16, l2, false);
  }
  return grad_bf16 ? pick_moments<Kernel, float, uint16_t>(moments_bf16, l2, bf16_out)
                   : pick_moments<Kernel, float, float>(moments_bf16, l2, bf16_out);
}

template <class Kernel, class ParamT, class GradT>
Q8Fn pick_q8_flags(bool l2, bool bf16_out) {
  if (l2) {
    return bf16_out ? &Kernel::template run_q8<ParamT, GradT, true, true>
                    : &Kernel::template run_q8<ParamT, GradT, true, false>;
  }
  return bf16_out ? &Kernel::template run_q8<ParamT, GradT, false, true>
                  : &Kernel::template run_q8<ParamT, GradT, false, false>;
}

template <class Kernel>
Q8Fn pick_q8(bool param_bf16, bool grad_bf16, bool l2, bool bf16_out) {
  if (param_bf16) {
    return grad_bf16 ? pick_q8_flags<Kernel, uint16_t, uint16_t>(l2, false)
                     : pick_q8_flags<Kernel, uint16_t, float>(l2, false);
  }
  return grad_bf16 ? pick_q8_flags<Kernel, float, uint16_t>(l2, bf16_out)
                   : pick_q8_flags<Kernel, float, float>(l2, bf16_out);
}

bool isa_supported(int isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512: return __builtin_cpu_supports("avx512f");
    case kAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
#else
  return isa == kScalar;
#endif
}

RangeFn pick_kernel(int isa, bool param_bf16, bool grad_bf16, bool moments_bf16, bool l2, bool bf16_out) {
  switch (isa) {
#if defined(__x86_64__)
    case kAvx512Bf16: return pick<Avx512Bf16Kernel>(param_bf16, grad_bf16, moments_bf16, l2, bf16_out);
    case kAvx512: return pick<Avx512Kernel>(param_bf16, grad_bf16, moments_bf16, l2, bf16_out);
    case kAvx2: return pick<Avx2Kernel>(param_bf16, grad_bf16, moments_bf16, l2, bf16_out);
#endif
    default: return pick<ScalarKernel>(param_bf16, grad_bf16, moments_bf16, l2, bf16_out);
  }
}

Q8Fn pick_q8_kernel(int isa, bool param_bf16, bool grad_bf16, bool l2, bool bf16_out) {
  switch (isa) {
#if defined(__x86_64__)
    case kAvx512Bf16: return pick_q8<Avx512Bf16Kernel>(param_bf16, grad_bf16, l2, bf16_out);
    case kAvx512: return pick_q8<Avx512Kernel>(param_bf16, grad_bf16, l2, bf16_out);
    case kAvx2: return pick_q8<Avx2Kernel>(param_bf16, grad_bf16, l2, bf16_out);
#endif
    default: return pick_q8<ScalarKernel>(param_bf16, grad_bf16, l2, bf16_out);
  }
}

// ---------------------------------------------------------------------------------------------
// Threads. A persistent pool of std::threads rather than OpenMP: torch ships its own OpenMP
// runtime, and a second one in the same process brings a second set of spinning workers that
// oversubscribe the rank's cores; here idle workers sleep on a condition variable, and each call
// uses exactly the thread count its caller passes (its share of the host's cores). Workers inherit
// the affinity of the thread that first needs them, unless pinned (slidedp_pin_helpers).

class ThreadPool {
 public:
  // Runs job(0) .. job(num_workers - 1) concurrently and returns when all are done; the caller is
  // worker 0. Calls that need helpers run one at a time.
  void run(int num_workers, const std::function<void(int)>& job) {
    if (num_workers <= 1) {
      job(0);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mu_);
    while (static_cast<int>(num_threads_) < num_workers - 1) {
      std::thread(&ThreadPool::serve, this, ++num_threads_, generation_).detach();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      helpers_ = num_workers - 1;
      pending_ = helpers_;
      ++generation_;
    }
    wake_.notify_all();
    job(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void serve(int index, uint64_t seen) {
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index > helpers_) continue;
        job = job_;
      }
      (*job)(index);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* job_ = nullptr;
  int num_threads_ = 0;
  int helpers_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
};

// Pins helper i (1 .. n) to cpus[i - 1], or to the caller's own cores where that is -1 (undoing a
// pin): each helper sets its own affinity inside one job, so the mapping holds for every later
// call (helpers keep their index); the caller's thread, worker 0, is left as it is. Returns the
// number of helpers that could not be pinned (a CPU outside the process's allowed set).
int pin_helpers(ThreadPool& pool, const int* cpus, int n) {
  cpu_set_t callers;
  if (pthread_getaffinity_np(pthread_self(), sizeof(callers), &callers) != 0) return n;
  std::atomic<int> failed{0};
  pool.run(n + 1, [&](int index) {
    if (index == 0) return;
    cpu_set_t set = callers;
    if (cpus[index - 1] >= 0) {
      CPU_ZERO(&set);
      CPU_SET(cpus[index - 1], &set);
    }
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) ++failed;
  });
  return failed.load();
}

// Never destroyed: workers are detached and may sleep until the process exits. A forked child has
// none of the parent's threads (and maybe a locked mutex), so it starts a fresh pool.
ThreadPool* g_pool = [] {
  pthread_atfork(nullptr, nullptr, [] { g_pool = new ThreadPool(); });
  return new ThreadPool();
}();

// Work is handed out in blocks (about 0.9 MB of traffic each) from a shared counter, so a thread
// slowed by a busy core does not hold up the others; short ranges stay on the calling thread.
constexpr int64_t kBlock = 1 << 15;

// The workers a call over `num_blocks` blocks runs on: the caller's thread count, at most one per
// block (the caller alone for an empty range).
int workers(int num_threads, int64_t num_blocks) {
  return static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), std::max<int64_t>(num_blocks, 1)));
}

}  // namespace

extern "C" {

int slidedp_cpu_adam_isa_supported(int isa) { return isa_supported(isa); }

// Pins the pool's helpers 1 .. n to cpus[0 .. n-1] (slidedp/affinity.py); returns how many failed.
int slidedp_pin_helpers(const int* cpus, int n) { return n > 0 ? pin_helpers(*g_pool, cpus, n) : 0; }

// Codes of the moments' format, shared with slidedp/cpu_adam.py.
enum MomentFormat : int { kMomentsF32 = 0, kMomentsBf16 = 1, kMoments8bit = 2 };

// exp_avg and exp_avg_sq share one format. For kMoments8bit they are byte codes, with one FP32
// scale per kQBlock elements in exp_avg_scale / exp_avg_sq_scale (ceil(n / kQBlock) each; the range
// starts at a block's start) and the code tables qmap_signed / qmap_unsigned (256 sorted floats),
// and per table the thresholds of its codes (QCode; 256 floats each); these six are unused
// otherwise. Returns 0, -1 when the ISA is not supported by this CPU, -2 for
// BF16 params with a separate BF16 output (they are their own), or -3 for an unknown format.
int slidedp_cpu_adam_update(int isa, void* param, int param_is_bf16, const void* grad, int grad_is_bf16,
                            void* exp_avg, void* exp_avg_sq, int moment_format, float* exp_avg_scale,
                            float* exp_avg_sq_scale, const float* qmap_signed, const float* qmap_unsigned,
                            const float* thresholds_signed, const float* thresholds_unsigned, uint16_t* bf16_out, int64_t n, int64_t step, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int adamw, double grad_scale, int num_threads) {
  if (!isa_supported(isa)) return -1;
  if (param_is_bf16 && bf16_out != nullptr) return -2;
  if (moment_format < kMomentsF32 || moment_format > kMoments8bit) return -3;
  const bool l2 = !adamw && weight_decay != 0.0;
  const double lerp_weight = 1.0 - beta1;
  Coeffs c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = static_cast<float>(weight_decay);
  c.lerp_weight = static_cast<float>(lerp_weight);
  c.lerp_weight_m1 = c.lerp_weight - 1.0f;
  c.lerp_small = (c.lerp_weight < 0.5f && c.lerp_weight > -0.5f);
  c.beta2 = static_cast<float>(beta2);
  c.beta2_c = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))));
  c.stream_shadow = bf16_out != nullptr && static_cast<const void*>(bf16_out) != grad;

  const bool q8 = moment_format == kMoments8bit;
  const RangeFn fn = q8 ? nullptr
                        : pick_kernel(isa, param_is_bf16 != 0, grad_is_bf16 != 0, moment_format == kMomentsBf16,
                                      l2, bf16_out != nullptr);
  const Q8Fn fn_q8 = q8 ? pick_q8_kernel(isa, param_is_bf16 != 0, grad_is_bf16 != 0, l2, bf16_out != nullptr)
                        : nullptr;
  QMaps maps{{qmap_signed, thresholds_signed, {}}, {qmap_unsigned, thresholds_unsigned, {}}};
  if (q8) {
    fill_levels(maps.exp_avg);
    fill_levels(maps.exp_avg_sq);
  }
  const int64_t param_size = param_is_bf16 ? 2 : 4;
  const int64_t grad_size = grad_is_bf16 ? 2 : 4;
  const int64_t moment_size = moment_format == kMomentsF32 ? 4 : moment_format == kMomentsBf16 ? 2 : 1;
  auto* param_bytes = static_cast<char*>(param);
  const auto* grad_bytes = static_cast<const char*>(grad);
  auto* exp_avg_bytes = static_cast<char*>(exp_avg);
  auto* exp_avg_sq_bytes = static_cast<char*>(exp_avg_sq);
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  static_assert(kBlock % kQBlock == 0, "a work block holds whole 8-bit blocks");
  std::atomic<int64_t> next{0};
  auto job = [&](int) {
    for (int64_t b = next.fetch_add(1); b < num_blocks; b = next.fetch_add(1)) {
      const int64_t lo = b * kBlock;
      const int64_t len = std::min(kBlock, n - lo);
      uint16_t* out = bf16_out ? bf16_out + lo : nullptr;
      if (q8) {
        fn_q8(c, maps, param_bytes + lo * param_size, grad_bytes + lo * grad_size,
              reinterpret_cast<uint8_t*>(exp_avg_bytes) + lo, exp_avg_scale + lo / kQBlock,
              reinterpret_cast<uint8_t*>(exp_avg_sq_bytes) + lo, exp_avg_sq_scale + lo / kQBlock, out, len);
      } else {
        fn(c, param_bytes + lo * param_size, grad_bytes + lo * grad_size, exp_avg_bytes + lo * moment_size,
           exp_avg_sq_bytes + lo * moment_size, out, len);
      }
    }
#if defined(__x86_64__)
    if (c.stream_shadow) _mm_sfence();  // the output's streaming stores land before the job is done
#endif
  };
  g_pool->run(workers(num_threads, num_blocks), job);
  return 0;
}

// The passes below are plain loops left to the compiler's vectorizer, which needs -O3; the update
// above is written in explicit vectors and runs as fast at -O2 (slidedp/cpu_adam.py's flags),
// which compiles its many instantiations faster on each machine's first use.
#pragma GCC push_options
#pragma GCC optimize("O3")

// acc = (assign ? 0 : acc) + src, src BF16 or FP32; returns the sum of squares of the result when
// want_sumsq (else 0). One pass over memory: the host-side gradient sum (cpu route), gradient
// accumulation and the clipping norm share it. Partial sums are kept per block and added in block
// order, so the result does not depend on the thread count or on scheduling.
double slidedp_grad_accumulate(float* acc, const void* src, int src_is_bf16, int64_t n, int assign,
                               int want_sumsq, int num_threads) {
  constexpr int kLanes = 16;  // independent float accumulators: vectorizable without reassociation
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(want_sumsq ? num_blocks : 0);
  std::atomic<int64_t> next{0};
  auto job = [&](int) {
    for (int64_t b = next.fetch_add(1); b < num_blocks; b = next.fetch_add(1)) {
      const int64_t lo = b * kBlock;
      const int64_t len = std::min(kBlock, n - lo);
      float* a = acc + lo;
      if (src_is_bf16) {
        const uint16_t* g = static_cast<const uint16_t*>(src) + lo;
        for (int64_t i = 0; i < len; ++i) {
          const float x = __builtin_bit_cast(float, static_cast<uint32_t>(g[i]) << 16);
          a[i] = assign ? x : a[i] + x;
        }
      } else {
        const float* g = static_cast<const float*>(src) + lo;
        for (int64_t i = 0; i < len; ++i) a[i] = assign ? g[i] : a[i] + g[i];
      }
      if (!want_sumsq) continue;
      float lanes[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= len; i += kLanes) {
        for (int k = 0; k < kLanes; ++k) lanes[k] += a[i + k] * a[i + k];
      }
      double sum = 0.0;
      for (; i < len; ++i) sum += static_cast<double>(a[i]) * a[i];
      for (int k = 0; k < kLanes; ++k) sum += lanes[k];
      partial[b] = sum;
    }
  };
  g_pool->run(workers(num_threads, num_blocks), job);
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

// STREAM's triad, a = b + scalar * c over FP64 arrays, on the same pool and blocks as the update:
// the host memory bandwidth that the update is measured against (slidedp/plan/stream.py), taken
// through the same threads rather than torch's. On x86 `a` is written with non-temporal stores,
// as STREAM is built with streaming stores on: STREAM does not count the write-allocate read of
// `a`, so with plain stores the figure would understate the memory's bandwidth by up to a quarter
// (our Adam writes lines it has just read, which need no such read, and streams any other).
void slidedp_stream_triad(double* a, const double* b, const double* c, double scalar, int64_t n,
                          int num_threads) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  std::atomic<int64_t> next{0};
  auto job = [&](int) {
    for (int64_t blk = next.fetch_add(1); blk < num_blocks; blk = next.fetch_add(1)) {
      int64_t i = blk * kBlock;
      const int64_t hi = std::min(n, i + kBlock);
#if defined(__x86_64__)
      if (reinterpret_cast<uintptr_t>(a + i) % 16 == 0) {
        const __m128d s = _mm_set1_pd(scalar);
        for (; i + 2 <= hi; i += 2) {
          _mm_stream_pd(a + i, _mm_add_pd(_mm_loadu_pd(b + i), _mm_mul_pd(s, _mm_loadu_pd(c + i))));
        }
      }
#endif
      for (; i < hi; ++i) a[i] = b[i] + scalar * c[i];
    }
#if defined(__x86_64__)
    _mm_sfence();  // the streaming stores are visible before the pool reports the job done
#endif
  };
  g_pool->run(workers(num_threads, num_blocks), job);
}

#pragma GCC pop_options

}  // extern "C"
