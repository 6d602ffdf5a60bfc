// 16-lane float32 / int32 vectors (GCC vector extensions) and the exp that the CPU kernel
// (kernel.cc) and the generated mods (_codegen.py) share.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

static inline v16 fj_ld(const float* p) { return *(const v16u*)p; }
static inline void fj_st(float* p, v16 x) { *(v16u*)p = x; }
#if defined(__AVX512F__)
static inline v16 fj_f(float x) { return (v16)_mm512_set1_ps(x); }
#else
// x - 0 is x for every x (unlike 0 + x, which turns -0 into +0): a plain broadcast.
static inline v16 fj_f(float x) { return x - (v16){}; }
#endif
static inline vi16 fj_i(int32_t x) { return x - (vi16){}; }
static inline vu16 fj_u(uint32_t x) { return x - (vu16){}; }

// e^x = 2^n * e^r for a clamped x: sets n (x / ln2 rounded to nearest) and returns e^r,
// |r| <= ln2/2, a degree-6 polynomial (Cephes' expf coefficients).
static inline v16 fj_exp_parts(v16 xc, v16* n_out) {
  v16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  v16 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = fj_f(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  *n_out = n;
  return p * (r * r) + r + 1.0f;
}

// exp of 16 lanes: 0 below -87.34 (and for -inf), inf above 88.72, NaN stays NaN.
static inline v16 fj_vexp(v16 x) {
  const float hi = 88.72283935546875f, lo = -87.33654022216797f;
  v16 xc = x > hi ? fj_f(hi) : x;
  xc = xc < lo ? fj_f(lo) : xc;
  v16 n;
  const v16 p = fj_exp_parts(xc, &n);
  vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &e, sizeof(e));
  v16 y = p * two_n;
  y = x < lo ? fj_f(0.0f) : y;
  y = x > hi ? fj_f(INFINITY) : y;
  return x != x ? x : y;
}
