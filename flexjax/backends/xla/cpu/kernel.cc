// flexjax's CPU kernels: block-sparse FlashAttention-2 forward and backward over a BlockMask's
// tile lists, called from XLA through its FFI. Built on first use by flexjax/backends/cpu/__init__.py.
//
// The mods are not in this file: the mod compiler's C++ generator (_codegen.py) builds them
// into a small shared library of their own, and their addresses arrive as attributes. Each
// mod function rewrites one score tile in place.
//
// Layout: q (B, Sq, Hq, D), k (B, Skv, Hkv, D), v (B, Skv, Hkv, Dv), out (B, Sq, Hq, Dv),
// float32, read in place. The forward also reads bfloat16 and float16 k and v (decode
// caches), widening their rows to float32 (exactly) as it loads them: a bfloat16 row of the
// decode product 32 elements a load, split into its even and odd elements by a shift and a
// mask (BF16S: no shuffle; the query rows and O held in that order), or, with AVX512-BF16
// and the pair_products attribute, the decode product's dots on the bfloat16 elements as
// they lie (PairDot, pv_pair_range). A score tile is held transposed,
// St[c][r] (kv position c, query row r), so that one query tile's rows are the vector lanes:
// the softmax's row max and row sum are lane-wise, and only the (D, rows) query tile is ever
// transposed (once per q block), never the keys.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <sys/mman.h>
#ifdef __linux__
#include <sched.h>
#endif

#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Whether any lane of a mask row (0 allowed, -inf excluded) is allowed.
static inline bool allowed_any(v16 x, int lanes = 16) {  // (of its first `lanes` lanes)
#if defined(__AVX512F__)
  const __mmask16 m = lanes >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << lanes) - 1);
  return _mm512_mask_cmp_ps_mask(m, (__m512)x, _mm512_setzero_ps(), _CMP_EQ_OQ) != 0;
#else
  for (int i = 0; i < lanes && i < 16; ++i)
    if (x[i] == 0.0f) return true;
  return false;
#endif
}

// exp of 16 lanes known to be <= 0 or NaN (s - max in the softmax): fj_vexp without the
// overflow branch, with AVX-512's scalef doing 2^n.
static inline v16 vexp_le0(v16 x) {
#if defined(__AVX512F__)
  const v16 lo = fj_f(-87.33654022216797f);
  v16 xc = x < lo ? lo : x;
  v16 n;
  const v16 p = fj_exp_parts(xc, &n);
  v16 y = (v16)_mm512_scalef_ps((__m512)p, (__m512)n);
  return x < lo ? fj_f(0.0f) : y;
#else
  return fj_vexp(x);
#endif
}

// Element types of k and v in the forward: ld reads 16 of them as float32 (exact). `quant`:
// a quantized pool's codes, whose values are the codes times a scale per (page, kv head).
struct F32 {
  using T = float;
  static constexpr bool split = false;
  static constexpr bool quant = false;
  static inline v16 ld(const float* p) { return fj_ld(p); }
};
struct BF16 {
  using T = uint16_t;
  static constexpr bool split = false;
  static constexpr bool quant = false;
  static inline v16 ld(const uint16_t* p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    v16 x;
    for (int i = 0; i < 16; ++i) {
      const uint32_t bits = (uint32_t)p[i] << 16;
      std::memcpy(&x[i], &bits, 4);
    }
    return x;
#endif
  }
};
struct F16 {
  using T = uint16_t;
  static constexpr bool split = false;
  static constexpr bool quant = false;
  static inline v16 ld(const uint16_t* p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    v16 x;
    for (int i = 0; i < 16; ++i) {  // binary16: sign, 5 exponent bits (bias 15), 10 mantissa bits
      const uint32_t h = p[i], e = (h >> 10) & 31, m = h & 1023;
      const float mag = e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(e ? 1024 + m : m), (e ? e : 1) - 25);
      x[i] = (h & 0x8000) ? -mag : mag;
    }
    return x;
#endif
  }
};

// int8 codes (a quantized pool).
struct I8 {
  using T = int8_t;
  static constexpr bool split = false;
  static constexpr bool quant = true;
  static inline v16 ld(const int8_t* p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    v16 x;
    for (int i = 0; i < 16; ++i) x[i] = (float)p[i];
    return x;
#endif
  }
};

// float8_e4m3fn codes (a quantized pool): sign, 4 exponent bits (bias 7), 3 mantissa bits,
// no infinities, NaN at S.1111.111; decoded through a 256-entry table.
struct F8Table {
  alignas(64) float v[256];
  F8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      float mag = (e == 15 && m == 7) ? NAN : std::ldexp((float)(e ? 8 + m : m), (e ? e : 1) - 10);
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};
static const F8Table kF8Table;

struct F8 {
  using T = uint8_t;
  static constexpr bool split = false;
  static constexpr bool quant = true;
  static inline v16 ld(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return (v16)_mm512_i32gather_ps(idx, kF8Table.v, 4);
#else
    v16 x;
    for (int i = 0; i < 16; ++i) x[i] = kF8Table.v[p[i]];
    return x;
#endif
  }
};

#if defined(__AVX512F__)
// n rows of O (ld floats apart, Dv a multiple of 32) back to column order from an order in
// which column c of each 32-column block lies at at(c).
template <class At>
static void column_order_rows(float* O, int64_t ld, int n, int Dv, At at) {
  alignas(64) int32_t i0[16], i1[16];
  for (int j = 0; j < 16; ++j) {
    i0[j] = at(j);
    i1[j] = at(16 + j);
  }
  const __m512i x0 = _mm512_load_si512(i0), x1 = _mm512_load_si512(i1);
  for (int r = 0; r < n; ++r)
    for (int d = 0; d < Dv; d += 32) {
      float* o = O + (int64_t)r * ld + d;
      const __m512 a = _mm512_loadu_ps(o), b = _mm512_loadu_ps(o + 16);
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(a, x0, b));
      _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a, x1, b));
    }
}

// A bfloat16 row read 32 elements a load and split, without a shuffle, into its even
// elements (a shift) and its odd ones (a mask), each exactly float32: "split order", a
// 32-element block's 16 even elements, then its 16 odd ones. The decode product keeps its
// query rows and its O rows in that order (split_order_rows restores O's).
struct BF16S {
  using T = uint16_t;
  static constexpr bool split = true;
  static constexpr bool quant = false;
  static inline void ld2(const uint16_t* p, v16* even, v16* odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = (v16)_mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = (v16)_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
  }
};
#endif

// Lane k of the result is the sum of a[k]'s 16 lanes: a reduction tree of pairwise
// interleaves (30 shuffles, where a 16 x 16 transpose then 15 adds takes 64).
__attribute__((always_inline)) static inline v16 hsum16(const v16 a[16]) {
#if defined(__AVX512F__)
  const __m512* x = reinterpret_cast<const __m512*>(a);
  __m512 b[8], c[4], e[2];
  for (int m = 0; m < 8; ++m)  // 128-bit lane L: a[2m], a[2m+1]'s partial sums, interleaved
    b[m] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * m], x[2 * m + 1]), _mm512_unpackhi_ps(x[2 * m], x[2 * m + 1]));
  for (int n = 0; n < 4; ++n) {  // 128-bit lane L: a[4n..4n+3]'s sums over their lane L
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * n]), _mm512_castps_pd(b[2 * n + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * n]), _mm512_castps_pd(b[2 * n + 1]));
    c[n] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int n = 0; n < 2; ++n)
    e[n] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * n], c[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * n], c[2 * n + 1], 0xdd));
  return (v16)_mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xdd));
#else
  v16 out;
  for (int k = 0; k < 16; ++k) {
    float t = 0.0f;
    for (int i = 0; i < 16; ++i) t += a[k][i];
    out[k] = t;
  }
  return out;
#endif
}

using ModFn = void (*)(float* s, int64_t ld, int nc, int nr, int b, int h, int q0, int kv0,
                       const void* const* arrays);

// St[c][r] = sum_d K[c][d] * Qt[d][r] for c in [c0, c0 + MR), r in [r0, r0 + 16 NV).
template <int MR, int NV>
static inline void qk_block(const float* K, int64_t ks, const float* Qt, int ldq, int D, float* St, int ldS,
                            int c0, int r0) {
  v16 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = fj_f(0.0f);
  const float* krow[MR];
  for (int i = 0; i < MR; ++i) krow[i] = K + (int64_t)(c0 + i) * ks;
  for (int d = 0; d < D; ++d) {
    v16 qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = fj_ld(Qt + (int64_t)d * ldq + r0 + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      v16 kb = fj_f(krow[i][d]);
      for (int j = 0; j < NV; ++j) acc[i][j] += kb * qv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) fj_st(St + (int64_t)(c0 + i) * ldS + r0 + 16 * j, acc[i][j]);
}

template <int NV>
static void qk_cols(const float* K, int64_t ks, const float* Qt, int ldq, int D, float* St, int ldS, int c_lo,
                    int c_hi, int r0) {
  constexpr int MR = NV == 4 ? 6 : (NV == 2 ? 8 : 12);
  int c = c_lo;
  for (; c + MR <= c_hi; c += MR) qk_block<MR, NV>(K, ks, Qt, ldq, D, St, ldS, c, r0);
  for (; c + 4 <= c_hi; c += 4) qk_block<4, NV>(K, ks, Qt, ldq, D, St, ldS, c, r0);
  for (; c < c_hi; ++c) qk_block<1, NV>(K, ks, Qt, ldq, D, St, ldS, c, r0);
}

// Prefetches the cache lines of n elements from p.
// (Locality 3: into L1, as prefetcht0; 1: into L2, prefetcht2.)
template <int Locality = 3, class T>
static inline void prefetch_run(const T* p, int n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int off = 0; off < n * (int)sizeof(T); off += 64) __builtin_prefetch(c + off, 0, Locality);
}

// Where a decode tile's row reads prefetch: the rows n on (into L1) and far on (into L2) in
// the order the rows are read. Past a call's last row the order goes on at `next`
// (next_rows rows, the same stride: the next kv head's rows, or the next chunk's).
// n == 0: no prefetch.
template <class T>
struct Ahead {
  int n = 0, far = 0;
  const T* next = nullptr;
  int next_rows = 0;
};

// The row `by` on from row c of rows [.., c_hi) at base (rows stride apart), or null past
// the order's end.
template <class T>
static inline const T* ahead_row(const Ahead<T>& a, int by, const T* base, int64_t stride, int c, int c_hi) {
  const int t = c + by;
  if (t < c_hi) return base + (int64_t)t * stride;
  return t - c_hi < a.next_rows ? a.next + (int64_t)(t - c_hi) * stride : nullptr;
}

// Row c's prefetches (n elements of each row prefetched). (Inlined always: a call in the
// PV loop would spill its accumulators; GCC did not inline it on its own.)
template <class T>
__attribute__((always_inline)) static inline void prefetch_ahead(const Ahead<T>& a, const T* base, int64_t stride,
                                                                int c, int c_hi, int n) {
  if (a.n == 0) return;
  if (const T* p = ahead_row(a, a.n, base, stride, c, c_hi)) prefetch_run(p, n);
  if (const T* p = ahead_row(a, a.far, base, stride, c, c_hi)) prefetch_run<1>(p, n);
}

// O[r][v0 + 16 j] += sum_c P[c][r] V[c][v0 + 16 j] for r in [r0, r0 + MR), c in [c_lo, c_hi).
template <class E, int MR, int NV>
static inline void pv_block(const float* P, int ldP, const typename E::T* V, int64_t vs, int c_lo, int c_hi, float* O,
                            int ldo, int r0, int v0, const float* alpha, const Ahead<typename E::T>& ahead) {
  v16 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j)
      acc[i][j] = alpha ? fj_ld(O + (int64_t)(r0 + i) * ldo + v0 + 16 * j) * alpha[r0 + i] : fj_f(0.0f);
  for (int c = c_lo; c < c_hi; ++c) {
    v16 vv[NV];
    const typename E::T* vr = V + (int64_t)c * vs + v0;
    if constexpr (E::split) {  // (NV even: pv_range takes split rows in 32-element blocks)
      for (int j = 0; j + 1 < NV; j += 2) E::ld2(vr + 16 * j, &vv[j], &vv[j + 1]);
    } else {
      for (int j = 0; j < NV; ++j) vv[j] = E::ld(vr + 16 * j);
    }
    prefetch_ahead(ahead, V + v0, vs, c, c_hi, 16 * NV);
    const float* pr = P + (int64_t)c * ldP + r0;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      v16 pb = fj_f(pr[i]);
      for (int j = 0; j < NV; ++j) acc[i][j] += pb * vv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) fj_st(O + (int64_t)(r0 + i) * ldo + v0 + 16 * j, acc[i][j]);
}

template <class E, int NV>
static void pv_rows(const float* P, int ldP, const typename E::T* V, int64_t vs, int c_lo, int c_hi, float* O, int ldo,
                    int r_lo, int r_hi, int v0, const float* alpha, const Ahead<typename E::T>& ahead) {
  constexpr int MR = 24 / NV;
  int r = r_lo;
  for (; r + MR <= r_hi; r += MR) pv_block<E, MR, NV>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r, v0, alpha, ahead);
  for (; r + 4 <= r_hi; r += 4) pv_block<E, 4, NV>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r, v0, alpha, ahead);
  for (; r < r_hi; ++r) pv_block<E, 1, NV>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r, v0, alpha, ahead);
}

// O rows [r_lo, r_hi) = alpha O + P^T V over kv rows [c_lo, c_hi) (alpha: the rows' softmax rescale).
// (O's rows are ldo floats apart; Dv of them are updated, or written, O's old rows unread,
// where alpha is null. V's rows: E elements, vs apart.
// ahead.n > 0: each V row read prefetches the ones ahead.n and ahead.far on in the order
// they are read: each 64-column slab's rows in turn, then ahead.next's.)
template <class E = F32>
static void pv_range(const float* P, int ldP, const typename E::T* V, int64_t vs, int c_lo, int c_hi, float* O, int ldo,
                     int Dv, int r_lo, int r_hi, const float* alpha, const Ahead<typename E::T>& ahead = {}) {
  // A slab's rows go on at the next slab's (the slabs' own columns are added by pv_block).
  using T = typename E::T;
  auto slab = [&](int v0, int w) {
    if (v0 + w >= Dv || ahead.n == 0) return ahead;
    return Ahead<T>{ahead.n, ahead.far, V + (int64_t)c_lo * vs + v0 + w, c_hi - c_lo};
  };
  int v0 = 0;
  for (; v0 + 64 <= Dv; v0 += 64)
    pv_rows<E, 4>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 64));
  if constexpr (E::split) {  // (rows of 32-element blocks: Dv a multiple of 32)
    if (Dv - v0 == 32) pv_rows<E, 2>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 32));
  } else if (Dv - v0 == 48) {
    pv_rows<E, 3>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 48));
  } else if (Dv - v0 == 32) {
    pv_rows<E, 2>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 32));
  } else if (Dv - v0 == 16) {
    pv_rows<E, 1>(P, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 16));
  }
}

#if defined(__AVX512BF16__)
// The decode product's PV over a bfloat16 cache with AVX512-BF16 (as the pallas and triton
// kernels, and PyTorch's, take P in the value dtype for it): P rounded to bfloat16, and the
// products P[c][r] V[c][d] + P[c+1][r] V[c+1][d] of two kv rows at a time by VDPBF16PS (each
// exact, summed in float32; alpha is never null here). Its accumulators hold O's rows in pair
// order: a 32-column block at d0 lies as 16 lanes of its columns d0 + 8 L + i, then 16 of
// d0 + 8 L + 4 + i (lane 4 L + i; L, i < 4), as VPUNPCK{L,H}WD leave two rows' 32 elements;
// pair_order_rows restores the columns' order.

// PP[t * w + r] (w: the rows a column of S holds, S[c * w + r]): row r's P at columns 2t (low
// half) and 2t + 1, rounded to nearest even, 0 outside [lo, hi). (Reads S up to column
// hi + 32 / w, writes PP up to word (hi / 2 + 1) * w + 16.)
static void pair_probs(const float* S, int w, int lo, int hi, uint32_t* PP) {
  const int per = 32 / w;  // columns a step (two vectors of S)
  alignas(64) int16_t idx[32];
  alignas(64) int32_t ca[16], cb[16];
  for (int k = 0; k < 16; ++k) {  // word k: row k % w of the step's pair k / w
    const int t = k / w, r = k % w;
    idx[2 * k] = (int16_t)(2 * t * w + r);
    idx[2 * k + 1] = (int16_t)((2 * t + 1) * w + r);
    ca[k] = k / w;
    cb[k] = (16 + k) / w;
  }
  const __m512i perm = _mm512_load_si512(idx);
  const vi16 col_a = *(const vi16*)ca, col_b = *(const vi16*)cb;
  for (int c = lo & ~1; c < hi; c += per) {
    v16 a = fj_ld(S + (int64_t)c * w), b = fj_ld(S + (int64_t)c * w + 16);
    const vi16 ka = col_a + c, kb = col_b + c;
    a = (ka >= lo) & (ka < hi) ? a : fj_f(0.0f);
    b = (kb >= lo) & (kb < hi) ? b : fj_f(0.0f);
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a);  // a's 16, then b's
    _mm512_storeu_si512(PP + (int64_t)(c / 2) * w, _mm512_permutexvar_epi16(perm, h));
  }
}

// One pair of kv rows (2t, 2t + 1 at va, vs apart) of pv_pair_block: Masked, the rows m0 and
// m1 leave out read as zeros (masked loads, which do not touch them).
template <int MR, int NL, bool Masked>
__attribute__((always_inline)) static inline void pv_pair_step(__m512 (&acc)[MR][2 * NL], const uint32_t* pr,
                                                               const uint16_t* va, int64_t vs, __mmask32 m0,
                                                               __mmask32 m1) {
  __m512bh lo[NL], hi[NL];
  for (int l = 0; l < NL; ++l) {
    const __m512i a = Masked ? _mm512_maskz_loadu_epi16(m0, va + 32 * l) : _mm512_loadu_si512(va + 32 * l);
    const __m512i b = Masked ? _mm512_maskz_loadu_epi16(m1, va + vs + 32 * l) : _mm512_loadu_si512(va + vs + 32 * l);
    lo[l] = (__m512bh)_mm512_unpacklo_epi16(a, b);
    hi[l] = (__m512bh)_mm512_unpackhi_epi16(a, b);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pr[i]);
    for (int l = 0; l < NL; ++l) {
      acc[i][2 * l] = _mm512_dpbf16_ps(acc[i][2 * l], lo[l], pb);
      acc[i][2 * l + 1] = _mm512_dpbf16_ps(acc[i][2 * l + 1], hi[l], pb);
    }
  }
}

// O[r0 + i][v0 .. v0 + 32 NL) (pair order) = alpha O + the pairs of kv rows over [c_lo, c_hi)
// (rows outside it read as zeros): PP's word t * ldP + r0 + i against V rows 2t and 2t + 1.
// (The boundary pairs take masked loads apart from the loop: in it, GCC spilled the
// accumulators.)
template <int MR, int NL>
static inline void pv_pair_block(const uint32_t* PP, int ldP, const uint16_t* V, int64_t vs, int c_lo, int c_hi,
                                 float* O, int ldo, int r0, int v0, const float* alpha, const Ahead<uint16_t>& ahead) {
  __m512 acc[MR][2 * NL];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NL; ++j)
      acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(O + (int64_t)(r0 + i) * ldo + v0 + 16 * j), _mm512_set1_ps(alpha[r0 + i]));
  auto pr = [&](int c) { return PP + (int64_t)(c / 2) * ldP + r0; };
  auto va = [&](int c) { return V + (int64_t)c * vs + v0; };
  int c = c_lo & ~1;
  if (c < c_lo || c + 1 >= c_hi) {  // a first pair with one row in the range
    pv_pair_step<MR, NL, true>(acc, pr(c), va(c), vs, c >= c_lo ? ~0u : 0u, c + 1 < c_hi ? ~0u : 0u);
    c += 2;
  }
  for (; c + 1 < c_hi; c += 2) {
    pv_pair_step<MR, NL, false>(acc, pr(c), va(c), vs, 0, 0);
    prefetch_ahead(ahead, V + v0, vs, c, c_hi, 32 * NL);
    prefetch_ahead(ahead, V + v0, vs, c + 1, c_hi, 32 * NL);
  }
  if (c < c_hi) pv_pair_step<MR, NL, true>(acc, pr(c), va(c), vs, ~0u, 0u);  // a last row alone
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NL; ++j) _mm512_storeu_ps(O + (int64_t)(r0 + i) * ldo + v0 + 16 * j, acc[i][j]);
}

template <int NL>
static void pv_pair_rows(const uint32_t* PP, int ldP, const uint16_t* V, int64_t vs, int c_lo, int c_hi, float* O,
                         int ldo, int r_lo, int r_hi, int v0, const float* alpha, const Ahead<uint16_t>& ahead) {
  int r = r_lo;
  for (; r + 4 <= r_hi; r += 4) pv_pair_block<4, NL>(PP, ldP, V, vs, c_lo, c_hi, O, ldo, r, v0, alpha, ahead);
  for (; r + 2 <= r_hi; r += 2) pv_pair_block<2, NL>(PP, ldP, V, vs, c_lo, c_hi, O, ldo, r, v0, alpha, ahead);
  for (; r < r_hi; ++r) pv_pair_block<1, NL>(PP, ldP, V, vs, c_lo, c_hi, O, ldo, r, v0, alpha, ahead);
}

// pv_range's pair form (Dv: a multiple of 32): O rows [r_lo, r_hi) in pair order.
static void pv_pair_range(const uint32_t* PP, int ldP, const uint16_t* V, int64_t vs, int c_lo, int c_hi, float* O,
                          int ldo, int Dv, int r_lo, int r_hi, const float* alpha, const Ahead<uint16_t>& ahead) {
  auto slab = [&](int v0, int w) {
    if (v0 + w >= Dv || ahead.n == 0) return ahead;
    return Ahead<uint16_t>{ahead.n, ahead.far, V + (int64_t)(c_lo & ~1) * vs + v0 + w, c_hi - (c_lo & ~1)};
  };
  int v0 = 0;
  for (; v0 + 64 <= Dv; v0 += 64)
    pv_pair_rows<2>(PP, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 64));
  if (Dv - v0 == 32) pv_pair_rows<1>(PP, ldP, V, vs, c_lo, c_hi, O, ldo, r_lo, r_hi, v0, alpha, slab(v0, 32));
}

// n rows of O (ld floats apart, Dv a multiple of 32) from pair order to column order.
static void pair_order_rows(float* O, int64_t ld, int n, int Dv) {
  // (column d = 8 L + 4 h + i of a block lies at 16 h + 4 L + i)
  column_order_rows(O, ld, n, Dv, [](int d) { return 16 * ((d / 4) % 2) + 4 * (d / 8) + d % 4; });
}
#endif

// C[c][v0 + 16 j] += sum_r A[c][r] X[r][v0 + 16 j] for c in [c0, c0 + MR), r in [r_lo, r_hi): the
// backward's dV += P^T dO and dK += dS^T Q, with A a transposed tile and X's rows xs apart.
template <int MR, int NV>
static inline void tn_block(const float* A, int ldA, const float* X, int64_t xs, int r_lo, int r_hi, float* C,
                            int ldc, int c0, int v0) {
  v16 acc[MR][NV];
  const float* arow[MR];
  for (int i = 0; i < MR; ++i) {
    arow[i] = A + (int64_t)(c0 + i) * ldA;
    for (int j = 0; j < NV; ++j) acc[i][j] = fj_ld(C + (int64_t)(c0 + i) * ldc + v0 + 16 * j);
  }
  for (int r = r_lo; r < r_hi; ++r) {
    v16 xv[NV];
    for (int j = 0; j < NV; ++j) xv[j] = fj_ld(X + (int64_t)r * xs + v0 + 16 * j);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      v16 a = fj_f(arow[i][r]);
      for (int j = 0; j < NV; ++j) acc[i][j] += a * xv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) fj_st(C + (int64_t)(c0 + i) * ldc + v0 + 16 * j, acc[i][j]);
}

// Row range of the columns [c0, c0 + n): the union of their [rlo, rhi).
static inline void row_union(const int* rlo, const int* rhi, int c0, int n, int* r_lo, int* r_hi) {
  *r_lo = rlo[c0];
  *r_hi = rhi[c0];
  for (int c = c0 + 1; c < c0 + n; ++c) {
    *r_lo = std::min(*r_lo, rlo[c]);
    *r_hi = std::max(*r_hi, rhi[c]);
  }
}

// Columns c of C take rows [rlo[c], rhi[c]) of the product; A is zero elsewhere in the union
// of each block's range, and the rows outside every range are never read.
template <int NV>
static void tn_rows(const float* A, int ldA, const float* X, int64_t xs, const int* rlo, const int* rhi, float* C,
                    int ldc, int nc, int v0) {
  constexpr int MR = 24 / NV;
  int c = 0, r_lo, r_hi;
  for (; c + MR <= nc; c += MR) {
    row_union(rlo, rhi, c, MR, &r_lo, &r_hi);
    if (r_lo < r_hi) tn_block<MR, NV>(A, ldA, X, xs, r_lo, r_hi, C, ldc, c, v0);
  }
  for (; c + 4 <= nc; c += 4) {
    row_union(rlo, rhi, c, 4, &r_lo, &r_hi);
    if (r_lo < r_hi) tn_block<4, NV>(A, ldA, X, xs, r_lo, r_hi, C, ldc, c, v0);
  }
  for (; c < nc; ++c)
    if (rlo[c] < rhi[c]) tn_block<1, NV>(A, ldA, X, xs, rlo[c], rhi[c], C, ldc, c, v0);
}

static void tn_tile(const float* A, int ldA, const float* X, int64_t xs, const int* rlo, const int* rhi, float* C,
                    int Dc, int nc) {
  int v0 = 0;
  for (; v0 + 64 <= Dc; v0 += 64) tn_rows<4>(A, ldA, X, xs, rlo, rhi, C, Dc, nc, v0);
  if (Dc - v0 == 48) tn_rows<3>(A, ldA, X, xs, rlo, rhi, C, Dc, nc, v0);
  else if (Dc - v0 == 32) tn_rows<2>(A, ldA, X, xs, rlo, rhi, C, Dc, nc, v0);
  else if (Dc - v0 == 16) tn_rows<1>(A, ldA, X, xs, rlo, rhi, C, Dc, nc, v0);
}

// Each 16-row group g's kv range [lo[g], hi[g]): the columns where any of its rows (those
// below nr) is allowed by the mask tile M (0 allowed, -inf not); lo > hi when none is.
static void group_ranges(const float* M, int nrp, int nc, int* lo, int* hi, int nr = INT_MAX) {
  const int ng = nrp / 16;
  for (int g = 0; g < ng; ++g) {
    lo[g] = nc;
    hi[g] = 0;
  }
  for (int c = 0; c < nc; ++c) {
    const float* mr = M + (int64_t)c * nrp;
    for (int g = 0; g < ng; ++g) {
      if (allowed_any(fj_ld(mr + 16 * g), nr - 16 * g)) {
        lo[g] = std::min(lo[g], c);
        hi[g] = c + 1;
      }
    }
  }
}

// St[c][r] = sum_d K[c][d] Qt[d][r] for each chunk of up to 64 query lanes over the union of its
// groups' column ranges (the rest of St is left as it is); then after(r0, width, c_lo, c_hi).
template <class After>
static void qk_groups(const float* K, int64_t ks, const float* Qt, int ldq, int D, float* St, int nrp, int nc,
                      const int* lo, const int* hi, After after) {
  for (int r0 = 0; r0 < nrp;) {
    const int width = r0 + 64 <= nrp ? 64 : (r0 + 32 <= nrp ? 32 : 16);
    int c_lo = nc, c_hi = 0;
    for (int g = r0 / 16; g < (r0 + width) / 16; ++g) {
      c_lo = std::min(c_lo, lo[g]);
      c_hi = std::max(c_hi, hi[g]);
    }
    if (c_lo < c_hi) {
      if (width == 64) qk_cols<4>(K, ks, Qt, ldq, D, St, nrp, c_lo, c_hi, r0);
      else if (width == 32) qk_cols<2>(K, ks, Qt, ldq, D, St, nrp, c_lo, c_hi, r0);
      else qk_cols<1>(K, ks, Qt, ldq, D, St, nrp, c_lo, c_hi, r0);
      after(r0, width, c_lo, c_hi);
    }
    r0 += width;
  }
}

// Transposes 16 rows of 16 lanes in place: r[j][i] becomes the old r[i][j].
static inline void transpose16(v16 r[16]) {
#if defined(__AVX512F__)
  __m512 t[16];
  __m512* x = reinterpret_cast<__m512*>(r);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
            c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    x[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    x[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    x[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    x[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    x[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
#else
  for (int i = 0; i < 16; ++i)
    for (int j = i + 1; j < 16; ++j) {
      const float a = r[i][j];
      r[i][j] = r[j][i];
      r[j][i] = a;
    }
#endif
}

// XT[d * ldt + r] = mult * X[r * xs + d] for d in [0, Dx) (a multiple of 16) and r in
// [0, n rounded up to 16), the rows past n zero.
static void transpose_rows(const float* X, int64_t xs, int64_t n, int64_t Dx, float* XT, int64_t ldt, float mult) {
  for (int64_t rb = 0; rb < n; rb += 16) {
    const int64_t m = std::min<int64_t>(16, n - rb);
    for (int64_t d0 = 0; d0 < Dx; d0 += 16) {
      v16 t[16];
      for (int64_t i = 0; i < m; ++i) t[i] = fj_ld(X + (rb + i) * xs + d0) * mult;
      for (int64_t i = m; i < 16; ++i) t[i] = fj_f(0.0f);
      transpose16(t);
      for (int j = 0; j < 16; ++j) fj_st(XT + (d0 + j) * ldt + rb, t[j]);
    }
  }
}

// Runs item(i, thread, scratch) for i in [0, items) on the calling thread and XLA's intra-op
// pool. The caller never waits for a task that has not started: the pool may be busy (other
// devices' calls, in a sharded program, run on the same threads and may be waiting too), so
// the caller works through the items itself, then closes the run and waits only for the
// tasks already inside it. A task that starts later finds the run closed and returns
// without touching the caller's (by then gone) stack.
struct RunState {
  std::mutex mu;
  std::condition_variable cv;
  bool closed = false;
  int active = 0;
  std::atomic<int64_t> next{0};
};

// A pool thread woken onto the caller's CPU shares that core with the caller until the
// scheduler's next balancing tick moves one of them (about 4 ms on a 2-core VM, longer than
// a decode step): the wake lands there when the other cores look busy at that instant, for
// instance with a pool thread still spinning after the previous op. So the caller yields
// once after scheduling (a task queued on its own CPU runs at once), and a task that finds
// itself on the caller's CPU moves off it for the run, then restores its affinity. Float32
// window steps at 16k and 64k: 5.72-10.99 ms without this (over 10 ms in half the benchmark's
// rows), 5.69-6.08 ms with it (BENCHMARKS.md, "Decode").
class AwayFrom {
 public:
  explicit AwayFrom(int cpu) {
#ifdef __linux__
    if (cpu < 0 || sched_getcpu() != cpu || sched_getaffinity(0, sizeof old_, &old_) != 0) return;
    cpu_set_t away = old_;
    CPU_CLR(cpu, &away);
    moved_ = CPU_COUNT(&away) > 0 && sched_setaffinity(0, sizeof away, &away) == 0;
#endif
  }
  ~AwayFrom() {
#ifdef __linux__
    if (moved_) sched_setaffinity(0, sizeof old_, &old_);
#endif
  }
  AwayFrom(const AwayFrom&) = delete;
  AwayFrom& operator=(const AwayFrom&) = delete;

 private:
#ifdef __linux__
  cpu_set_t old_;
#endif
  bool moved_ = false;
};

static int current_cpu() {
#ifdef __linux__
  return sched_getcpu();
#else
  return -1;
#endif
}

template <class Scratch_, class Item>
static void run_parallel(ffi::ThreadPool& pool, int64_t items, int64_t max_threads, Item item) {
  const int64_t threads =
      std::min<int64_t>(std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items), max_threads);
  auto state = std::make_shared<RunState>();
  auto work = [state, items, &item](int64_t t) {
    Scratch_ w;
    for (int64_t i = state->next.fetch_add(1); i < items; i = state->next.fetch_add(1)) item(i, t, w);
  };
  using Work = decltype(work);
  Work* shared_work = &work;
  const int caller_cpu = threads > 1 ? current_cpu() : -1;
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([state, shared_work, t, caller_cpu]() {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (state->closed) return;
        ++state->active;
      }
      {
        AwayFrom away(caller_cpu);
        (*shared_work)(t);
      }
      std::lock_guard<std::mutex> lock(state->mu);
      --state->active;
      state->cv.notify_all();
    });
  }
#ifdef __linux__
  if (threads > 1) sched_yield();
#endif
  work(0);
  std::unique_lock<std::mutex> lock(state->mu);
  state->closed = true;
  state->cv.wait(lock, [&state] { return state->active == 0; });
}

// Work memory (the backward's transposed q and dO, its per-thread dQ) kept between calls.
// Fresh multi-megabyte buffers page-fault on every first touch, which cost about a tenth of
// a backward when each call allocated its own. Blocks are anonymous maps with transparent
// huge pages requested; a call leases one block per buffer, and blocks up to kKeepBytes
// go back to the pool afterwards (larger ones are unmapped).
class WorkBlock {
 public:
  explicit WorkBlock(size_t bytes) : bytes_(round(bytes)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(p, bytes_, MADV_HUGEPAGE);
#endif
    data_ = static_cast<float*>(p);
  }
  ~WorkBlock() { munmap(data_, bytes_); }
  WorkBlock(const WorkBlock&) = delete;
  WorkBlock& operator=(const WorkBlock&) = delete;
  size_t bytes() const { return bytes_; }
  float* data() const { return data_; }

 private:
  static size_t round(size_t b) { return (std::max<size_t>(b, 1) + (2u << 20) - 1) / (2u << 20) * (2u << 20); }
  size_t bytes_;
  float* data_;
};

static constexpr size_t kKeepBytes = size_t(512) << 20;
static std::mutex g_work_mu;
static std::vector<std::unique_ptr<WorkBlock>> g_work_free;

// A leased block of at least n floats (contents unspecified), returned to the pool on scope exit.
class WorkLease {
 public:
  explicit WorkLease(size_t n) {
    const size_t bytes = sizeof(float) * n;
    {
      std::lock_guard<std::mutex> lock(g_work_mu);
      // The smallest free block that fits.
      size_t best = g_work_free.size();
      for (size_t i = 0; i < g_work_free.size(); ++i)
        if (g_work_free[i]->bytes() >= bytes && (best == g_work_free.size() ||
                                                 g_work_free[i]->bytes() < g_work_free[best]->bytes()))
          best = i;
      if (best < g_work_free.size()) {
        block_ = std::move(g_work_free[best]);
        g_work_free.erase(g_work_free.begin() + best);
      }
    }
    if (!block_) block_ = std::make_unique<WorkBlock>(bytes);
  }
  ~WorkLease() {
    if (block_->bytes() > kKeepBytes) return;
    std::lock_guard<std::mutex> lock(g_work_mu);
    g_work_free.push_back(std::move(block_));
    // Keep at most 8 blocks: the rest of a burst of shapes is unmapped.
    if (g_work_free.size() > 8) g_work_free.erase(g_work_free.begin());
  }
  WorkLease(const WorkLease&) = delete;
  WorkLease& operator=(const WorkLease&) = delete;
  float* data() const { return block_->data(); }

 private:
  std::unique_ptr<WorkBlock> block_;
};

using PackedFn = void (*)(float* s, int64_t ld, int nc, int nr, int b, const int32_t* hl, const int32_t* ql, int kv0,
                          const void* const* arrays);

// Element types of k and v in the forward.
enum KvType { kF32 = 0, kBF16 = 1, kF16 = 2, kI8 = 3, kF8 = 4 };

static inline int64_t kv_bytes(int type) { return type == kF32 ? 4 : (type == kBF16 || type == kF16) ? 2 : 1; }

// n (a multiple of 16) elements of a row that is not float32 as float32 (times `scale`: a
// quantized pool's, 1 otherwise).
static inline void widen_row(const void* src, int type, int64_t n, float* dst, float scale) {
  for (int64_t d = 0; d < n; d += 16) {
    v16 x;
    if (type == kBF16) x = BF16::ld(static_cast<const uint16_t*>(src) + d);
    else if (type == kF16) x = F16::ld(static_cast<const uint16_t*>(src) + d);
    else if (type == kI8) x = I8::ld(static_cast<const int8_t*>(src) + d) * scale;
    else x = F8::ld(static_cast<const uint8_t*>(src) + d) * scale;
    fj_st(dst + d, x);
  }
}

struct Problem {
  const float* q;
  const void *k, *v;  // kv_type elements
  int kv_type;
  const int32_t *kv_num, *kv_idx, *fkv_num, *fkv_idx;
  int64_t wp, wf;  // list widths
  int64_t Bm, Hm, nQ;  // list dims
  int64_t B, Sq, Hq, Skv, Hkv, D, Dv;
  int64_t bq, bkv, kv_len;
  float scale;
  ModFn score_fn, mask_fn;
  PackedFn score_packed, mask_packed;  // the mods' variants with per-lane h and q_idx
  const void* const* score_arrays;
  const void* const* mask_arrays;
  float *out, *m_out, *l_out;
  // A head group is Gp query heads of one kv head sharing a tile's rows (lane g * nq + i:
  // head g, query i of the q block). An item is Gi head groups (Gi > 1: their kv heads are
  // read together, row by row, as the cache lies in memory) over split s of nsplit
  // contiguous shares of their tile list.
  int64_t Gp, Gi, nsplit;
  // Paged K/V (page_size > 0): k and v are pools (num_pages, page_size, Hkv, D) and kv row
  // kv0 of batch b lies in page page_table[b, kv0 / page_size] (a tile never spans pages).
  const int32_t* page_table;
  int64_t page_size, max_pages, num_pages;
  // A quantized pool (kv_type kI8 or kF8): float32 scales (num_pages, Hkv); null otherwise.
  const float *k_scale = nullptr, *v_scale = nullptr;
  float* part;  // nsplit > 1: per item and group, the unnormalized rows, row maxima, row sums
  int64_t part_stride;
  int ahead, ahead_far;  // rows a decode tile's K and V reads prefetch ahead into L1 and L2 (0: none)
  bool pair;  // bfloat16 caches' decode products by VDPBF16PS (the caller's choice, see __init__.py)
};

struct GroupState {
  std::vector<float> qt, qr, o, m, l;  // qr: the scaled query rows, for tiles of one 16-lane group
  std::vector<int32_t> hl, ql;
  std::vector<float> s, mask, alpha;  // the current tile's scores (then P), mask, rows' rescale
  std::vector<int> lo, hi;            // and each 16-row group's kv range in it
  bool masked = false;
  // The tile's scores packed (see tile_softmax_packed): column c's row r at s[c * ld_s + r].
  bool packed = false;
  int ld_s = 16;
  // AVX512-BF16 over a bfloat16 cache: qb holds the query rows, unscaled, as bfloat16 where
  // they are bfloat16 values (qk_pair: the PairDot product), and pv_pair says the PV product
  // takes P as bfloat16 pairs, in pp (pair_probs), with o in pair order (pv_pair_range).
  std::vector<uint16_t> qb;
  std::vector<uint32_t> pp;
  bool qk_pair = false, pv_pair = false;
  // A bfloat16 cache read in split order (BF16S): qr and o in split order.
  bool split = false;
};

struct Scratch {
  std::vector<float> kf, vf;  // a 16-bit cache's tile rows as float32
  std::vector<int> lo, hi;    // the groups' ranges clipped to a chunk (clip_ranges)
  std::vector<GroupState> grp;
};

struct ItemRows {  // where one head group's lanes come from
  int64_t b, hq0, q0, nq, nr, nrp;
};

static ItemRows group_rows(const Problem& P, int64_t base, int64_t j) {
  const int64_t nqb = (P.Sq + P.bq - 1) / P.bq, nig = P.Hq / (P.Gp * P.Gi);
  ItemRows R;
  const int64_t qb = base % nqb, ig = (base / nqb) % nig;
  R.b = base / (nqb * nig);
  R.hq0 = (ig * P.Gi + j) * P.Gp;
  R.q0 = qb * P.bq;
  R.nq = std::min<int64_t>(P.bq, P.Sq - R.q0);
  R.nr = P.Gp * R.nq;
  R.nrp = (R.nr + 15) / 16 * 16;
  return R;
}

// Writes lane r's normalized row (o / l), row max m and row sum l to the outputs.
static inline void write_row(const Problem& P, const ItemRows& R, int64_t r, const float* o, float m, float l) {
  const int64_t h = R.hq0 + r / R.nq, qi = R.q0 + r % R.nq;
  const float inv = 1.0f / (l > 0.0f ? l : 1.0f);
  float* orow = P.out + ((R.b * P.Sq + qi) * P.Hq + h) * P.Dv;
  for (int64_t d = 0; d < P.Dv; d += 16) fj_st(orow + d, fj_ld(o + d) * inv);  // (Dv: a multiple of 16)
  P.m_out[(R.b * P.Hq + h) * P.Sq + qi] = m;
  P.l_out[(R.b * P.Hq + h) * P.Sq + qi] = l;
}

// The decode product's dot forms (qk_dot_rows): K's elements E widened to float32 against
// float32 query rows (WideDot), or, with AVX512-BF16, bfloat16 keys as they lie against query
// rows that hold bfloat16 values (PairDot: VDPBF16PS, two products a lane per instruction,
// each exact, summed in float32; the scale is applied to the sums).
template <class E>
struct WideDot {
  using T = typename E::T;
  using Q = float;
  using QV = v16;
  using KV = v16;
  static constexpr int step = 16;
  static constexpr bool scaled = E::quant;  // (the query rows carry the scale; a quantized pool's
                                            // tile scale is applied to the sums)
  static inline QV ldq(const float* q) { return fj_ld(q); }
  static inline KV ldk(const T* k) { return E::ld(k); }
  static inline v16 mac(v16 acc, KV k, QV q) { return acc + k * q; }
};
#if defined(__AVX512F__)
// A bfloat16 cache's keys in split order (BF16S) against query rows held in that order.
struct SplitDot {
  using T = uint16_t;
  using Q = float;
  struct QV {
    v16 e, o;
  };
  using KV = QV;
  static constexpr int step = 32;
  static constexpr bool scaled = false;
  static inline QV ldq(const float* q) { return {fj_ld(q), fj_ld(q + 16)}; }
  static inline KV ldk(const uint16_t* k) {
    KV x;
    BF16S::ld2(k, &x.e, &x.o);
    return x;
  }
  static inline v16 mac(v16 acc, KV k, QV q) { return acc + k.e * q.e + k.o * q.o; }
};

// n rows of O (ld floats apart, Dv a multiple of 32) from split order to column order.
static void split_order_rows(float* O, int64_t ld, int n, int Dv) {
  // (column 2 i lies at i, column 2 i + 1 at 16 + i)
  column_order_rows(O, ld, n, Dv, [](int d) { return (d % 2) * 16 + d / 2; });
}
#endif
#if defined(__AVX512BF16__)
struct PairDot {
  using T = uint16_t;
  using Q = uint16_t;
  using QV = __m512bh;
  using KV = __m512bh;
  static constexpr int step = 32;
  static constexpr bool scaled = true;
  static inline QV ldq(const uint16_t* q) { return (__m512bh)_mm512_loadu_si512(q); }
  static inline KV ldk(const uint16_t* k) { return (__m512bh)_mm512_loadu_si512(k); }
  static inline v16 mac(v16 acc, KV k, QV q) { return (v16)_mm512_dpbf16_ps((__m512)acc, k, q); }
};
#endif

// St[c][r] = scale sum_d K[c][d] Q[r][d] for c in [c_lo, c_hi), r < nr <= NR (rows nr..NR-1
// repeat row nr - 1; lanes NR..15 of St's rows are left as they are), with Q's rows (D
// elements, a multiple of Dot::step) in row order: the decode tile's product. 16 / NR key
// rows at a time are each read once, as D / Dot::step vectors, and dotted with every query
// row into 16 accumulators, whose sums one reduction tree gives. (The lane-broadcast product
// of qk_cols would spend 16 lanes on nr rows.) The scale is applied only where Dot::scaled.
template <class Dot, int NR>
static void qk_dot_rows(const typename Dot::T* K, int64_t ks, const typename Dot::Q* Q, int D, int nr, float* St,
                        int ldS, int c_lo, int c_hi, const Ahead<typename Dot::T>& ahead, float scale) {
  constexpr int NC = 16 / NR;
  const typename Dot::Q* qrow[NR];
  for (int r = 0; r < NR; ++r) qrow[r] = Q + (int64_t)std::min(r, nr - 1) * D;
  for (int c0 = c_lo; c0 < c_hi; c0 += NC) {
    const int n = std::min(NC, c_hi - c0);
    const typename Dot::T* krow[NC];
    for (int i = 0; i < NC; ++i) krow[i] = K + (int64_t)(c0 + std::min(i, n - 1)) * ks;
    for (int i = 0; i < n; ++i) prefetch_ahead(ahead, K, ks, c0 + i, c_hi, D);
    v16 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = fj_f(0.0f);
    for (int d = 0; d < D; d += Dot::step) {
      typename Dot::QV qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = Dot::ldq(qrow[r] + d);
#pragma GCC unroll 16
      for (int i = 0; i < NC; ++i) {
        const typename Dot::KV kv = Dot::ldk(krow[i] + d);
        for (int r = 0; r < NR; ++r) acc[i * NR + r] = Dot::mac(acc[i * NR + r], kv, qv[r]);
      }
    }
    v16 sums = hsum16(acc);  // lane i * NR + r: column c0 + i, row r
    if (Dot::scaled) sums *= scale;
    if (ldS == NR && n == NC) {  // packed columns: the sums are the columns' rows as they lie
      fj_st(St + (int64_t)c0 * NR, sums);
      continue;
    }
    alignas(64) float t[16];
    fj_st(t, sums);
    for (int i = 0; i < n; ++i) std::memcpy(St + (int64_t)(c0 + i) * ldS, t + i * NR, sizeof(float) * NR);
  }
}

// The rows qk_dot computes for nr query rows (rows nr.. repeat the last).
static inline int dot_rows(int nr) { return nr <= 1 ? 1 : nr <= 2 ? 2 : nr <= 4 ? 4 : nr <= 8 ? 8 : 16; }

template <class Dot>
static void qk_dot(const typename Dot::T* K, int64_t ks, const typename Dot::Q* Q, int D, int nr, float* St,
                   int ldS, int c_lo, int c_hi, const Ahead<typename Dot::T>& ahead, float scale) {
  if (nr <= 1) qk_dot_rows<Dot, 1>(K, ks, Q, D, nr, St, ldS, c_lo, c_hi, ahead, scale);
  else if (nr <= 2) qk_dot_rows<Dot, 2>(K, ks, Q, D, nr, St, ldS, c_lo, c_hi, ahead, scale);
  else if (nr <= 4) qk_dot_rows<Dot, 4>(K, ks, Q, D, nr, St, ldS, c_lo, c_hi, ahead, scale);
  else if (nr <= 8) qk_dot_rows<Dot, 8>(K, ks, Q, D, nr, St, ldS, c_lo, c_hi, ahead, scale);
  else qk_dot_rows<Dot, 16>(K, ks, Q, D, nr, St, ldS, c_lo, c_hi, ahead, scale);
}

// The row of k and v (in units of Hkv * D floats) holding batch b's kv position kv0.
static inline int64_t page_of(const Problem& P, int64_t b, int64_t kv0) {
  // Pages past a sequence's length may hold anything: indices are clamped into the pool
  // (those tiles' keys are masked by the lengths).
  const int64_t logical = std::min<int64_t>(kv0 / P.page_size, P.max_pages - 1);
  return std::min<int64_t>(std::max<int32_t>(P.page_table[b * P.max_pages + logical], 0), P.num_pages - 1);
}

static inline int64_t kv_base(const Problem& P, int64_t b, int64_t kv0) {
  if (P.page_size == 0) return b * P.Skv + kv0;
  return page_of(P, b, kv0) * P.page_size + kv0 % P.page_size;
}

// A quantized pool's scale of the tile at kv0 (one page) for this head group's kv head
// (`scales`: k's or v's); 1 for a float cache.
static inline float tile_scale(const Problem& P, const float* scales, const ItemRows& R, int64_t kv0) {
  if (scales == nullptr) return 1.0f;
  const int64_t hkv = R.hq0 / (P.Hq / P.Hkv);
  return scales[page_of(P, R.b, kv0) * P.Hkv + hkv];
}

// One tile of one head group, in four phases (an item of Gi > 1 groups runs each phase for
// every group before the next, and the K and V phases chunk by chunk, so the cache is read
// row after row, as it lies in memory, for all its kv heads at once: the hardware prefetcher
// follows that stream, and not Gi interleaved runs of strided rows).

// Phase 1: the mask tile (partial tiles evaluate mask_mod into gs.mask: 0 allowed, -inf not)
// and each 16-row group's kv range [lo, hi), the columns where any of its rows is allowed,
// so rows and columns the mask excludes cost no multiply.
static void tile_ranges(const Problem& P, const ItemRows& R, GroupState& gs, bool partial, int kv0, int nc) {
  const int nrp = (int)R.nrp, ng = nrp / 16;
  gs.masked = partial && P.mask_fn;
  // Tiles of the decode product with neither mod to apply keep only their rows' scores.
  gs.packed = !gs.qr.empty() && !gs.masked && !P.score_fn && dot_rows((int)R.nr) < 16;
  gs.ld_s = gs.packed ? dot_rows((int)R.nr) : nrp;
  if (gs.masked) {
    float* M = gs.mask.data();
    std::fill(M, M + (int64_t)nc * nrp, 0.0f);
    if (P.Gp > 1) P.mask_packed(M, nrp, nc, nrp, (int)R.b, gs.hl.data(), gs.ql.data(), kv0, P.mask_arrays);
    else P.mask_fn(M, nrp, nc, nrp, (int)R.b, (int)R.hq0, (int)R.q0, kv0, P.mask_arrays);
    group_ranges(M, nrp, nc, gs.lo.data(), gs.hi.data(), (int)R.nr);  // (lanes past nr: no rows)
  } else {
    for (int g = 0; g < ng; ++g) {
      gs.lo[g] = 0;
      gs.hi[g] = nc;
    }
  }
}

// The tile's rows [a, b) of k (or v) for this head group as float32, row c at the returned
// pointer + c * (*stride): in place for a float32 cache, else widened into buf.
static const float* cache_rows(const Problem& P, const void* base, int64_t off, int64_t row_stride, int64_t n, int a,
                               int b, std::vector<float>& buf, int64_t* stride, float scale) {
  if (P.kv_type == kF32) {
    *stride = row_stride;
    return static_cast<const float*>(base) + off;
  }
  const int64_t es = kv_bytes(P.kv_type);
  const char* src = static_cast<const char*>(base) + off * es;
  if (buf.size() < (size_t)P.bkv * n) buf.resize((size_t)P.bkv * n);
  for (int c = a; c < b; ++c) widen_row(src + c * row_stride * es, P.kv_type, n, buf.data() + (int64_t)c * n, scale);
  *stride = n;
  return buf.data();
}

// f(E{}) for the forward's k and v element type E.
template <class Fn>
static inline void with_kv_type(int type, Fn f) {
  if (type == kF32) f(F32{});
  else if (type == kBF16) f(BF16{});
  else if (type == kF16) f(F16{});
  else if (type == kI8) f(I8{});
  else f(F8{});
}

// The rows a decode tile phase's reads go on to once its own are read (see Ahead): `rows` of
// them at `at` (elements of k or v, which share the element type), Hkv * D elements apart.
struct NextRows {
  const void* at = nullptr;
  int rows = 0;
};

static inline int64_t head_offset(const Problem& P, const ItemRows& R, int kv0, int64_t n) {
  const int64_t hkv = R.hq0 / (P.Hq / P.Hkv);
  return (kv_base(P, R.b, kv0) * P.Hkv + hkv) * n;
}

// Each 16-row group's kv range clipped to the chunk [a, b), into lo and hi, and the union of
// the non-empty ones, [*c_lo, *c_hi) (empty: *c_lo >= *c_hi).
static void clip_ranges(const GroupState& gs, int ng, int a, int b, int* lo, int* hi, int* c_lo, int* c_hi) {
  *c_lo = b;
  *c_hi = a;
  for (int g = 0; g < ng; ++g) {
    lo[g] = std::max(gs.lo[g], a);
    hi[g] = std::min(gs.hi[g], b);
    if (lo[g] < hi[g]) {
      *c_lo = std::min(*c_lo, lo[g]);
      *c_hi = std::max(*c_hi, hi[g]);
    }
  }
}

// Phase 2: scores St[c][r] of the columns [a, b) within the groups' ranges (then score_mod).
static void tile_scores(const Problem& P, const ItemRows& R, GroupState& gs, Scratch& w, int kv0, int nc, int a,
                        int b, NextRows next) {
  const int nrp = (int)R.nrp, ng = nrp / 16, D = (int)P.D;
  int* lo = w.lo.data();
  int* hi = w.hi.data();
  int c_lo, c_hi;
  clip_ranges(gs, ng, a, b, lo, hi, &c_lo, &c_hi);
  if (c_lo >= c_hi) return;
  const int64_t off = head_offset(P, R, kv0, P.D), row = P.Hkv * P.D;
  float* S = gs.s.data();
  auto score = [&](int r0, int width, int s_lo, int s_hi) {
    if (!P.score_fn) return;
    if (P.Gp > 1)
      P.score_packed(S + (int64_t)s_lo * nrp + r0, nrp, s_hi - s_lo, width, (int)R.b, gs.hl.data() + r0,
                     gs.ql.data() + r0, kv0 + s_lo, P.score_arrays);
    else
      P.score_fn(S + (int64_t)s_lo * nrp + r0, nrp, s_hi - s_lo, width, (int)R.b, (int)R.hq0, (int)R.q0 + r0,
                 kv0 + s_lo, P.score_arrays);
  };
  if (!gs.qr.empty()) {  // one 16-lane group: the decode product, on the cache's own elements
#if defined(__AVX512BF16__)
    if (gs.qk_pair) {
      const uint16_t* K = static_cast<const uint16_t*>(P.k) + off;
      qk_dot<PairDot>(K, row, gs.qb.data(), D, (int)R.nr, S, gs.ld_s, lo[0], hi[0],
                      Ahead<uint16_t>{P.ahead, P.ahead_far, static_cast<const uint16_t*>(next.at), next.rows},
                      P.scale);
    } else
#endif
#if defined(__AVX512F__)
    if (gs.split) {
      qk_dot<SplitDot>(static_cast<const uint16_t*>(P.k) + off, row, gs.qr.data(), D, (int)R.nr, S, gs.ld_s, lo[0],
                       hi[0], Ahead<uint16_t>{P.ahead, P.ahead_far, static_cast<const uint16_t*>(next.at), next.rows},
                       1.0f);
    } else
#endif
      with_kv_type(P.kv_type, [&](auto e) {
        using E = decltype(e);
        using T = typename E::T;
        qk_dot<WideDot<E>>(static_cast<const T*>(P.k) + off, row, gs.qr.data(), D, (int)R.nr, S, gs.ld_s, lo[0],
                           hi[0], Ahead<T>{P.ahead, P.ahead_far, static_cast<const T*>(next.at), next.rows},
                           tile_scale(P, P.k_scale, R, kv0));
      });
    score(0, 16, lo[0], hi[0]);
  } else {  // (the lane-broadcast product reads each key element many times: widened first)
    int64_t ks;
    const float* K = cache_rows(P, P.k, off, row, D, c_lo, c_hi, w.kf, &ks, tile_scale(P, P.k_scale, R, kv0));
    qk_groups(K, ks, gs.qt.data(), nrp, D, S, nrp, nc, lo, hi, score);
  }
}

// Phase 3 of a packed tile (gs.packed: no mask, no score_mod, nr <= 8): its columns' rows
// lie back to back, w = gs.ld_s (a power of two) per column, so each vector holds 16 / w
// columns, and no lane is spent on padding rows.
static void tile_softmax_packed(GroupState& gs) {
  const int w = gs.ld_s, lo = gs.lo[0], hi = gs.hi[0];
  const int n = std::max(hi - lo, 0) * w;  // the scores, from S + lo * w
  float* S = gs.s.data() + (int64_t)lo * w;
  float* m = gs.m.data();
  float* l = gs.l.data();
  vi16 lane;
  for (int i = 0; i < 16; ++i) lane[i] = i;
  // (The tail vector's lanes past n are read and written, never used: gs.s has 16 floats to
  // spare past bkv * 16.)
  v16 mx = fj_f(-FLT_MAX);
  for (int i = 0; i < n; i += 16) {
    const v16 x = fj_ld(S + i);
    const v16 y = lane < n - i ? x : fj_f(-FLT_MAX);
    mx = y > mx ? y : mx;
  }
  alignas(64) float t[16];
  fj_st(t, mx);
  for (int r = 0; r < w; ++r) {
    float v = m[r];
    for (int j = r; j < 16; j += w) v = std::max(v, t[j]);
    t[r] = v;
  }
  alignas(64) float mt[16];
  for (int i = 0; i < 16; ++i) mt[i] = t[i % w];  // lane i: the new max of row i % w
  const v16 pm = fj_ld(mt);
  v16 sum = fj_f(0.0f);
  for (int i = 0; i < n; i += 16) {
    const v16 e = vexp_le0(fj_ld(S + i) - pm);
    fj_st(S + i, e);
    sum += lane < n - i ? e : fj_f(0.0f);
  }
  fj_st(t, sum);
  for (int r = 0; r < 16; ++r) {
    float sr = 0.0f;
    if (r < w)
      for (int j = r; j < 16; j += w) sr += t[j];
    // Lanes past w are no rows: their state stays as it is (alpha 1).
    const float m_new = r < w ? mt[r] : m[r];
    const float alpha = std::exp(m[r] - m_new);
    l[r] = l[r] * alpha + sr;
    m[r] = m_new;
    gs.alpha[r] = alpha;
  }
}

// Phase 3: the mask applied, the online softmax's new row max and sum, and P = exp(s - max)
// in place; alpha, the rows' rescale, goes to gs.alpha, or (prescale: O is updated in
// chunks) into O now, gs.alpha then 1.
static void tile_softmax(const Problem& P, const ItemRows& R, GroupState& gs, bool prescale) {
  const int nrp = (int)R.nrp, ng = gs.packed ? 0 : nrp / 16, Dv = (int)P.Dv;
  float* S = gs.s.data();
  const float* M = gs.mask.data();
  float* m = gs.m.data();
  float* l = gs.l.data();
  if (gs.packed) tile_softmax_packed(gs);
  for (int g = 0; g < ng; ++g) {
    const int r = 16 * g, lo = gs.lo[g], hi = gs.hi[g];
    v16 m_old = fj_ld(m + r), mx = m_old;
    if (gs.masked) {
      for (int c = lo; c < hi; ++c) {
        float* p = S + (int64_t)c * nrp + r;
        v16 x = fj_ld(p);
        x = fj_ld(M + (int64_t)c * nrp + r) == 0.0f ? x : fj_f(-INFINITY);
        fj_st(p, x);
        mx = x > mx ? x : mx;
      }
    } else {
      for (int c = lo; c < hi; ++c) {
        v16 x = fj_ld(S + (int64_t)c * nrp + r);
        mx = x > mx ? x : mx;
      }
    }
    v16 sum = fj_f(0.0f);
    for (int c = lo; c < hi; ++c) {
      float* p = S + (int64_t)c * nrp + r;
      v16 e = vexp_le0(fj_ld(p) - mx);
      fj_st(p, e);
      sum += e;
    }
    // A group with no allowed column keeps its max, so its rows' alpha is 1.
    v16 alpha = vexp_le0(m_old - mx);
    fj_st(l + r, fj_ld(l + r) * alpha + sum);
    fj_st(m + r, mx);
    fj_st(gs.alpha.data() + r, alpha);
  }
#if defined(__AVX512BF16__)
  if (gs.pv_pair) pair_probs(S, gs.ld_s, gs.lo[0], gs.hi[0], gs.pp.data());
#endif
  if (prescale) {
    for (int r = 0; r < (int)R.nr; ++r) {
      const float a = gs.alpha[r];
      float* o = gs.o.data() + (int64_t)r * Dv;
      for (int d = 0; d < Dv; d += 16) fj_st(o + d, fj_ld(o + d) * a);
      gs.alpha[r] = 1.0f;
    }
  }
}

// Phase 4: O = alpha O + P V over the columns [a, b) within each group's range.
static void tile_pv(const Problem& P, const ItemRows& R, GroupState& gs, Scratch& w, int kv0, int nc, int a,
                    int b, NextRows next) {
  const int nrp = (int)R.nrp, ng = nrp / 16, nr = (int)R.nr, Dv = (int)P.Dv;
  int* lo = w.lo.data();
  int* hi = w.hi.data();
  int c_lo, c_hi;
  clip_ranges(gs, ng, a, b, lo, hi, &c_lo, &c_hi);
  if (c_lo >= c_hi) return;
  const int64_t off = head_offset(P, R, kv0, P.Dv), row = P.Hkv * P.Dv;
#if defined(__AVX512BF16__)
  if (gs.pv_pair) {
    pv_pair_range(gs.pp.data(), gs.ld_s, static_cast<const uint16_t*>(P.v) + off, row, lo[0], hi[0], gs.o.data(), Dv,
                  Dv, 0, nr, gs.alpha.data(),
                  Ahead<uint16_t>{P.ahead, P.ahead_far, static_cast<const uint16_t*>(next.at), next.rows});
    return;
  }
#endif
#if defined(__AVX512F__)
  if (gs.split) {
    pv_range<BF16S>(gs.s.data(), gs.ld_s, static_cast<const uint16_t*>(P.v) + off, row, lo[0], hi[0], gs.o.data(), Dv,
                    Dv, 0, nr, gs.alpha.data(),
                    Ahead<uint16_t>{P.ahead, P.ahead_far, static_cast<const uint16_t*>(next.at), next.rows});
    return;
  }
#endif
  if (nrp == 16) {  // at most 16 rows: each value element is read once or a few times, in place
    if (P.v_scale != nullptr) {  // a quantized pool: its tile scale joins P (l already summed P)
      const float vsc = tile_scale(P, P.v_scale, R, kv0);
      float* S = gs.s.data();
      for (int64_t i = (int64_t)lo[0] * gs.ld_s; i < (int64_t)hi[0] * gs.ld_s; ++i) S[i] *= vsc;
    }
    with_kv_type(P.kv_type, [&](auto e) {
      using E = decltype(e);
      using T = typename E::T;
      pv_range<E>(gs.s.data(), gs.ld_s, static_cast<const T*>(P.v) + off, row, lo[0], hi[0], gs.o.data(), Dv, Dv, 0, nr,
                  gs.alpha.data(), Ahead<T>{P.ahead, P.ahead_far, static_cast<const T*>(next.at), next.rows});
    });
    return;
  }
  int64_t vs;
  const float* V = cache_rows(P, P.v, off, row, Dv, c_lo, c_hi, w.vf, &vs, tile_scale(P, P.v_scale, R, kv0));
  for (int g = 0; g < ng; ++g)
    if (lo[g] < hi[g])
      pv_range(gs.s.data(), nrp, V, vs, lo[g], hi[g], gs.o.data(), Dv, Dv, 16 * g, std::min(16 * g + 16, nr),
               gs.alpha.data());
}

// Rows per chunk when an item's groups take a tile's phases in turn (32 measured best of 16,
// 32 and 64: a 16k-token float32 step in 28.4, 27.2 and 33.2 ms, before the prefetch).
static constexpr int kChunk = 32;
// Rows ahead, in the order they are read, that a decode tile's reads prefetch into L1 and
// into L2. History: one distance, down one group's rows, measured best at 16 of 4 to 64
// (16k-token steps at 87% of the probe's bandwidth in float32, 62% in bfloat16, against 81%
// and 43% without). Following the reads across groups, chunks and phases instead (half the
// prefetches had landed in the next chunk and left L1 before it was read): a bfloat16 step
// in 14.3 ms against 16.3 ms. Then 8 into L1 and 32 into L2 (a chunk, the farthest the order
// is known): 12.2-12.8 ms against 13.6-13.8 at 16 alone, in float32 21.8 against 22.1-22.7;
// 4 or 16 into L1, 24 into L2, or 64-row chunks with 48 or 64 into L2, no better.
static constexpr int kAhead = 8, kAheadFar = 32;

// One item: a q block of Gi head groups over one share of their tile list (the partial
// tiles, then the full ones).
static void run_item(const Problem& P, int64_t item, Scratch& w) {
  const int64_t split = item % P.nsplit, base = item / P.nsplit;
  const ItemRows R0 = group_rows(P, base, 0);
  const int nq = (int)R0.nq, nr = (int)R0.nr, nrp = (int)R0.nrp, q0 = (int)R0.q0;
  const int64_t b = R0.b;
  const int D = (int)P.D, Dv = (int)P.Dv;
  w.lo.resize(nrp / 16);
  w.hi.resize(nrp / 16);
  w.grp.resize(P.Gi);
  for (int64_t j = 0; j < P.Gi; ++j) {
    GroupState& gs = w.grp[j];
    const int64_t hq = R0.hq0 + j * P.Gp;
    gs.s.resize((size_t)P.bkv * nrp + 16);
    gs.mask.resize((size_t)P.bkv * nrp);
    gs.alpha.resize(nrp);
    gs.lo.resize(nrp / 16);
    gs.hi.resize(nrp / 16);
    gs.o.assign((size_t)nrp * Dv, 0.0f);
    gs.m.assign(nrp, -FLT_MAX);
    gs.l.assign(nrp, 0.0f);
    // Tiles of one 16-lane group take the dot-form product on the query rows (qr); the
    // others the lane-broadcast product on their transpose (qt). Each is built only if used.
    gs.qr.clear();
    gs.qt.clear();
    gs.qk_pair = gs.pv_pair = gs.split = false;
    if (nrp == 16 && D % 16 == 0) {
      gs.qr.resize((size_t)nr * D);
#if defined(__AVX512BF16__)
      // With a bfloat16 cache, also the query rows as bfloat16, where they are such values.
      gs.qk_pair = P.pair && P.kv_type == kBF16 && D % 32 == 0;
      if (gs.qk_pair) gs.qb.resize((size_t)nr * D);
      gs.pv_pair = P.pair && P.kv_type == kBF16 && Dv % 32 == 0;
      if (gs.pv_pair) gs.pp.resize((size_t)(P.bkv + 2) * 16);
#endif
#if defined(__AVX512F__)
      // A bfloat16 cache the pair products do not take is read in split order (both products:
      // the query rows and O in that order).
      gs.split = P.kv_type == kBF16 && D % 32 == 0 && Dv % 32 == 0 && !gs.qk_pair && !gs.pv_pair;
#endif
      for (int r = 0; r < nr; ++r) {
        const float* qrow = P.q + ((b * P.Sq + q0 + r % nq) * P.Hq + hq + r / nq) * P.D;
        for (int d = 0; d < D; ++d) {  // (split order: element d of a 32-block at d / 2, or 16 + d / 2 if odd)
          const int at = gs.split ? (d & ~31) + (d % 2) * 16 + (d % 32) / 2 : d;
          gs.qr[(size_t)r * D + at] = qrow[d] * P.scale;
        }
#if defined(__AVX512BF16__)
        for (int d = 0; d < D && gs.qk_pair; ++d) {
          uint32_t bits;
          std::memcpy(&bits, qrow + d, 4);
          gs.qk_pair = (bits & 0xffffu) == 0;
          gs.qb[(size_t)r * D + d] = (uint16_t)(bits >> 16);
        }
#endif
      }
    } else if (P.Gp == 1 && D % 16 == 0) {
      gs.qt.resize((size_t)D * nrp);  // transpose_rows writes every lane (zero past nr)
      transpose_rows(P.q + ((b * P.Sq + q0) * P.Hq + hq) * P.D, P.Hq * P.D, nr, D, gs.qt.data(), nrp, P.scale);
    } else {
      gs.qt.assign((size_t)D * nrp, 0.0f);
      for (int r = 0; r < nr; ++r) {
        const float* qrow = P.q + ((b * P.Sq + q0 + r % nq) * P.Hq + hq + r / nq) * P.D;
        for (int d = 0; d < D; ++d) gs.qt[(int64_t)d * nrp + r] = qrow[d] * P.scale;
      }
    }
    if (P.Gp > 1) {  // each lane's head and query position (padding lanes repeat the last row)
      gs.hl.resize(nrp);
      gs.ql.resize(nrp);
      for (int r = 0; r < nrp; ++r) {
        const int rr = std::min(r, nr - 1);
        gs.hl[r] = (int32_t)(hq + rr / nq);
        gs.ql[r] = (int32_t)(q0 + rr % nq);
      }
    }
  }
  // Every group of an item shares its lists (Gi > 1 or Gp > 1 only when Hm == 1).
  const int64_t lb = P.Bm == 1 ? 0 : b, lh = P.Hm == 1 ? 0 : R0.hq0;
  const int64_t row = (lb * P.Hm + lh) * P.nQ + q0 / P.bq;
  const int n_p = P.kv_num[row], n_all = n_p + P.fkv_num[row];
  const int t_lo = (int)(n_all * split / P.nsplit), t_hi = (int)(n_all * (split + 1) / P.nsplit);
  std::vector<ItemRows> rows(P.Gi);
  for (int64_t j = 0; j < P.Gi; ++j) rows[j] = group_rows(P, base, j);
  // Several groups (all kv heads of a sequence) take the tile's rows in chunks of kChunk.
  const int chunk = P.Gi > 1 ? kChunk : (int)P.bkv;
  auto tile_kv0 = [&](int t) {
    return (int)((t < n_p ? P.kv_idx[row * P.wp + t] : P.fkv_idx[row * P.wf + t - n_p]) * P.bkv);
  };
  const size_t es = (size_t)kv_bytes(P.kv_type);
  // Group j's rows [a, a + n) of the tile at kv0 in v (v_phase) or k, as NextRows. (By phase,
  // not by pointer: k and v may be one buffer.)
  auto at = [&](bool v_phase, int64_t j, int kv0, int a, int n) {
    if (n <= 0) return NextRows{};
    const void* base = v_phase ? P.v : P.k;
    return NextRows{static_cast<const char*>(base) + head_offset(P, rows[j], kv0 + a, v_phase ? P.Dv : P.D) * es, n};
  };
  for (int t = t_lo; t < t_hi; ++t) {
    const bool partial = t < n_p;
    const int kv0 = tile_kv0(t);
    const int nc = (int)std::min<int64_t>(P.bkv, P.kv_len - kv0);
    if (nc <= 0) continue;
    // The order the reads go in (the K phase's chunks, each for every group, then the V
    // phase's, then the next tile's K), for their prefetches: after group j's rows of a chunk
    // come the next group's, then the next chunk's, then the other phase's first. (Crossing
    // between k and v needs rows of one width; prefetching a whole tile or chunk ahead in one
    // burst measured no faster.)
    const bool cross = P.D == P.Dv;
    const int kv_n = t + 1 < t_hi ? tile_kv0(t + 1) : 0;
    const int nc_n = t + 1 < t_hi ? (int)std::min<int64_t>(P.bkv, P.kv_len - kv_n) : 0;
    auto next = [&](bool v_phase, int64_t j, int a, int e) {
      if (P.ahead == 0) return NextRows{};
      if (j + 1 < P.Gi) return at(v_phase, j + 1, kv0, a, e - a);
      if (e < nc) return at(v_phase, 0, kv0, e, std::min(chunk, nc - e));
      if (!cross) return NextRows{};
      return v_phase ? at(false, 0, kv_n, 0, std::min(chunk, nc_n)) : at(true, 0, kv0, 0, std::min(chunk, nc));
    };
    for (int64_t j = 0; j < P.Gi; ++j) tile_ranges(P, rows[j], w.grp[j], partial, kv0, nc);
    for (int a = 0; a < nc; a += chunk) {
      const int e = std::min(a + chunk, nc);
      for (int64_t j = 0; j < P.Gi; ++j) tile_scores(P, rows[j], w.grp[j], w, kv0, nc, a, e, next(false, j, a, e));
    }
    for (int64_t j = 0; j < P.Gi; ++j) tile_softmax(P, rows[j], w.grp[j], chunk < nc);
    for (int a = 0; a < nc; a += chunk) {
      const int e = std::min(a + chunk, nc);
      for (int64_t j = 0; j < P.Gi; ++j) tile_pv(P, rows[j], w.grp[j], w, kv0, nc, a, e, next(true, j, a, e));
    }
  }
  for (int64_t j = 0; j < P.Gi; ++j) {
    const ItemRows R = group_rows(P, base, j);
    GroupState& gs = w.grp[j];
#if defined(__AVX512BF16__)
    if (gs.pv_pair) pair_order_rows(gs.o.data(), Dv, nr, Dv);
#endif
#if defined(__AVX512F__)
    if (gs.split) split_order_rows(gs.o.data(), Dv, nr, Dv);
#endif
    if (P.nsplit == 1) {
      for (int r = 0; r < nr; ++r) write_row(P, R, r, gs.o.data() + (int64_t)r * Dv, gs.m[r], gs.l[r]);
      continue;
    }
    float* part = P.part + (item * P.Gi + j) * P.part_stride;  // (nrp x Dv) rows, nrp maxima, nrp sums
    std::memcpy(part, gs.o.data(), sizeof(float) * (size_t)nr * Dv);
    std::memcpy(part + (int64_t)nrp * Dv, gs.m.data(), sizeof(float) * nr);
    std::memcpy(part + (int64_t)nrp * Dv + nrp, gs.l.data(), sizeof(float) * nr);
  }
}

// nsplit > 1: one item's shares merged by their row maxima (flash-decoding's merge).
static void merge_item(const Problem& P, int64_t base) {
  std::vector<float> o(P.Dv);
  for (int64_t j = 0; j < P.Gi; ++j) {
    const ItemRows R = group_rows(P, base, j);
    const int64_t Dv = P.Dv, nrp = R.nrp;
    auto share = [&](int64_t s) { return P.part + ((base * P.nsplit + s) * P.Gi + j) * P.part_stride; };
    for (int64_t r = 0; r < R.nr; ++r) {
      float m = -FLT_MAX;
      for (int64_t s = 0; s < P.nsplit; ++s) m = std::max(m, share(s)[nrp * Dv + r]);
      float l = 0.0f;
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t s = 0; s < P.nsplit; ++s) {
        const float* part = share(s);
        const float ls = part[nrp * Dv + nrp + r];
        if (ls == 0.0f) continue;  // a share with no allowed key (its max may be -FLT_MAX)
        const float a = std::exp(part[nrp * Dv + r] - m);
        l += ls * a;
        for (int64_t d = 0; d < Dv; ++d) o[d] += part[r * Dv + d] * a;
      }
      write_row(P, R, r, o.data(), m, l);
    }
  }
}

// Heads packed per head group: the GQA group's query heads when the lists are shared by
// every head, the packed mods exist and their rows fit one 128-lane tile (decoding); else one.
static int64_t packed_heads(const Problem& P) {
  const int64_t G = P.Hq / P.Hkv, nq = std::min(P.bq, P.Sq);
  if (G == 1 || P.Hm != 1 || (P.score_fn && !P.score_packed) || (P.mask_fn && !P.mask_packed)) return 1;
  for (int64_t gp = G; gp > 1; --gp)
    if (G % gp == 0 && gp * nq <= 128) return gp;
  return 1;
}

struct NoScratch {};

static void run_all(Problem& P, ffi::ThreadPool& pool) {
  P.Gp = packed_heads(P);
  // Few rows per group (decoding) is bound by reading K and V: an item then takes every kv
  // head, so each cache row is read whole, in order, rather than in 4 KiB-strided runs.
  const int64_t nr = P.Gp * std::min(P.bq, P.Sq);
  P.Gi = (P.Hm == 1 && nr <= 64) ? P.Hq / P.Gp : 1;
  const int64_t base = P.B * (P.Hq / (P.Gp * P.Gi)) * ((P.Sq + P.bq - 1) / P.bq);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Few items (a decode step): split each tile list into shares, so every thread has several
  // to take; the shares are merged by their row maxima.
  P.nsplit = 1;
  if (base < 4 * threads) P.nsplit = std::max<int64_t>(1, std::min<int64_t>((4 * threads + base - 1) / base,
                                                                            (P.wp + P.wf + 1) / 2));
  const int64_t items = base * P.nsplit;
  P.ahead = P.Gi > 1 ? kAhead : 0;
  P.ahead_far = kAheadFar;
  std::unique_ptr<WorkLease> work;
  if (P.nsplit > 1) {
    P.part_stride = ((nr + 15) / 16 * 16) * (P.Dv + 2);
    work = std::make_unique<WorkLease>((size_t)(items * P.Gi * P.part_stride));
    P.part = work->data();
  }
  // Each thread keeps its scratch between calls: a decode step's first items would otherwise
  // allocate (and fault in) every group's tile buffers again.
  run_parallel<NoScratch>(pool, items, items, [&P](int64_t i, int64_t, NoScratch&) {
    thread_local Scratch w;
    run_item(P, i, w);
  });
  if (P.nsplit > 1)
    run_parallel<NoScratch>(pool, base, base, [&P](int64_t i, int64_t, NoScratch&) { merge_item(P, i); });
}

// The mods' captured arrays (the call's remaining operands), as the pointers they read.
static bool captured_arrays(const ffi::RemainingArgs& consts, std::vector<const void*>& arrays) {
  arrays.resize(consts.size());
  for (size_t i = 0; i < consts.size(); ++i) {
    auto a = consts.get<ffi::AnyBuffer>(i);
    if (!a.has_value()) return false;
    arrays[i] = a->untyped_data();
  }
  return true;
}

static ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> kv_num, ffi::Buffer<ffi::S32> kv_idx,
                          ffi::Buffer<ffi::S32> fkv_num, ffi::Buffer<ffi::S32> fkv_idx, ffi::RemainingArgs consts,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> m_out,
                          ffi::ResultBuffer<ffi::F32> l_out, float scale, int64_t block_q, int64_t block_kv,
                          int64_t kv_len, int64_t score_fn, int64_t mask_fn, int64_t score_packed,
                          int64_t mask_packed, int64_t page_size, int64_t n_score_consts, int64_t pair_products,
                          int64_t quantized) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), li = kv_idx.dimensions(),
       fi = fkv_idx.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || li.size() != 4 || fi.size() != 4)
    return ffi::Error::InvalidArgument("flexjax cpu kernel: bad ranks");
  Problem P;
  const ffi::DataType kt = k.element_type();
  const bool q8 = kt == ffi::DataType::S8 || kt == ffi::DataType::F8E4M3FN;
  if (kt != v.element_type() || (kt != ffi::DataType::F32 && kt != ffi::DataType::BF16 && kt != ffi::DataType::F16 &&
                                 !q8))
    return ffi::Error::InvalidArgument(
        "flexjax cpu kernel: k and v must both be float32, bfloat16, float16, int8 or float8_e4m3fn");
  if (kt != ffi::DataType::F32 && (qd[3] % 16 || vd[3] % 16))
    return ffi::Error::InvalidArgument("flexjax cpu kernel: 16-bit and 8-bit k and v need head dims that are multiples "
                                       "of 16");
  if (q8 != (quantized != 0) || (q8 && (page_size == 0 || k_scale.dimensions().size() != 2 ||
                                        k_scale.dimensions()[0] != kd[0] || k_scale.dimensions()[1] != kd[2] ||
                                        v_scale.dimensions()[0] != kd[0] || v_scale.dimensions()[1] != kd[2])))
    return ffi::Error::InvalidArgument("flexjax cpu kernel: int8 / float8 pools need paged calls with scales "
                                       "(num_pages, Hkv)");
  P.kv_type = kt == ffi::DataType::F32 ? kF32 : kt == ffi::DataType::BF16 ? kBF16 : kt == ffi::DataType::F16 ? kF16
              : kt == ffi::DataType::S8 ? kI8 : kF8;
  if (q8) {
    P.k_scale = k_scale.typed_data();
    P.v_scale = v_scale.typed_data();
  }
  P.q = q.typed_data();
  P.k = k.untyped_data();
  P.v = v.untyped_data();
  P.kv_num = kv_num.typed_data();
  P.kv_idx = kv_idx.typed_data();
  P.fkv_num = fkv_num.typed_data();
  P.fkv_idx = fkv_idx.typed_data();
  P.Bm = li[0];
  P.Hm = li[1];
  P.nQ = li[2];
  P.wp = li[3];
  P.wf = fi[3];
  P.B = qd[0];
  P.Sq = qd[1];
  P.Hq = qd[2];
  P.D = qd[3];
  P.Skv = kd[1];
  P.Hkv = kd[2];
  P.Dv = vd[3];
  P.bq = block_q;
  P.bkv = block_kv;
  P.kv_len = kv_len;
  P.page_table = page_table.typed_data();
  P.page_size = page_size;
  P.max_pages = page_table.dimensions()[1];
  P.num_pages = kd[0];
  if (page_size > 0 && (page_size % block_kv || page_table.dimensions()[0] != qd[0]))
    return ffi::Error::InvalidArgument("flexjax cpu kernel: bad page table");
  P.scale = scale;
  P.pair = pair_products != 0;
  P.score_fn = reinterpret_cast<ModFn>(score_fn);
  P.mask_fn = reinterpret_cast<ModFn>(mask_fn);
  P.score_packed = reinterpret_cast<PackedFn>(score_packed);
  P.mask_packed = reinterpret_cast<PackedFn>(mask_packed);
  std::vector<const void*> arrays;
  if (!captured_arrays(consts, arrays)) return ffi::Error::InvalidArgument("flexjax cpu kernel: bad captured array");
  P.score_arrays = arrays.data();
  P.mask_arrays = arrays.data() + n_score_consts;
  P.out = out->typed_data();
  P.m_out = m_out->typed_data();
  P.l_out = l_out->typed_data();
  if (P.Sq > 0 && P.B > 0 && P.Hq > 0) run_all(P, pool);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexjaxCpuForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_kv")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("score_fn")
                                  .Attr<int64_t>("mask_fn")
                                  .Attr<int64_t>("score_packed")
                                  .Attr<int64_t>("mask_packed")
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("n_score_consts")
                                  .Attr<int64_t>("pair_products")
                                  .Attr<int64_t>("quantized"));

// ---------------------------------------------------------------------------------------
// Backward: dQ, dK, dV of the same tiles (the xla backend's backward, fused). One item is a
// kv block of one (batch, kv head): it walks the q tiles of its transposed lists for every
// query head of the GQA group, recomputing P from the forward's row max and log-sum,
// accumulates dK and dV in place, and adds dQ into its slot's own dQ buffer (the slots summed
// in a fixed order at the end), so no two threads write the same memory and every run sums
// each dQ element in the same order.

using VjpFn = void (*)(const float* s, float* ds, int64_t ld, int nc, int nr, int b, int h, int q0, int kv0,
                       const void* const* arrays);

struct BwdProblem {
  const float *q, *k, *v, *out, *dout, *dlse, *row_max, *log_sum;
  // Work memory the prepass fills: (B, Hq, D, Sqp) scaled q and (B, Hq, Dv, Sqp) dO, their
  // sequence axis last (Sqp = Sq rounded up to 16, plus 16 lanes that keep the row stride off
  // powers of two), and delta (B, Hq, Sq).
  float *qT, *doT, *delta;
  int64_t Sqp;
  // Few visits per q tile (narrow bands): each visit transposes its own q and dO tiles and
  // forms its rows' delta instead (no prepass), from memory the band has just read.
  bool tile_prep;
  const int32_t *q_num, *q_idx, *fq_num, *fq_idx;
  int64_t wp, wf, Bm, Hm, nKV;
  int64_t B, Sq, Hq, Skv, Hkv, D, Dv;
  int64_t bq, bkv, kv_len;
  float scale;
  ModFn score_fn, mask_fn;
  VjpFn vjp_fn;
  const void* const* score_arrays;
  const void* const* mask_arrays;
  float *dk, *dv;
  // One (B, Sq, Hq, D) dQ buffer per slot (the first is the output), and for each slot
  // which (batch, query head, q block) tiles of its buffer it has written: a tile is zeroed
  // when its slot first adds to it, and the sum at the end reads only written tiles.
  std::vector<float*> dq;
  std::vector<uint8_t*> written;
  int64_t nqb;
};

struct BwdScratch {
  std::vector<float> s, s_raw, mask, dp, dk, dv, ones, mx, ls, de, qt, dot;  // qt, dot: tile_prep's
  std::vector<int> lo, hi, rlo, rhi;
};

// delta of query row qi of (b, hq): rowsum(dO * O) - dlse (a cotangent on lse adds P * dlse
// to dS); dO points at the row.
static inline float row_delta(const BwdProblem& P, const float* dO, int64_t b, int64_t hq, int64_t qi) {
  const float* O = P.out + ((b * P.Sq + qi) * P.Hq + hq) * P.Dv;
  v16 acc = fj_f(0.0f);
  for (int64_t d = 0; d < P.Dv; d += 16) acc += fj_ld(dO + d) * fj_ld(O + d);
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i) sum += acc[i];
  return sum - P.dlse[(b * P.Hq + hq) * P.Sq + qi];
}

static void bwd_item(const BwdProblem& P, int64_t item, int64_t slot, BwdScratch& w) {
  const int64_t nkb = (P.kv_len + P.bkv - 1) / P.bkv;
  const int64_t j = item % nkb, hkv = (item / nkb) % P.Hkv, b = item / (nkb * P.Hkv);
  const int64_t G = P.Hq / P.Hkv;
  const int kv0 = (int)(j * P.bkv);
  const int nc = (int)std::min<int64_t>(P.bkv, P.kv_len - kv0);
  const int D = (int)P.D, Dv = (int)P.Dv;
  const int bq = (int)P.bq, bqp = (bq + 15) / 16 * 16;
  w.s.resize((size_t)nc * bqp);
  w.s_raw.resize((size_t)nc * bqp);
  w.mask.resize((size_t)nc * bqp);
  w.dp.resize((size_t)nc * bqp);
  w.dk.assign((size_t)nc * D, 0.0f);
  w.dv.assign((size_t)nc * Dv, 0.0f);
  w.ones.assign(bqp, 1.0f);
  w.mx.resize(bqp);
  w.ls.resize(bqp);
  w.de.resize(bqp);
  w.lo.resize(bqp / 16);
  w.hi.resize(bqp / 16);
  w.rlo.resize(nc);
  w.rhi.resize(nc);
  int* lo = w.lo.data();
  int* hi = w.hi.data();
  int* rlo = w.rlo.data();
  int* rhi = w.rhi.data();
  float* mxp = w.mx.data();
  float* lsp = w.ls.data();
  float* dep = w.de.data();
  const int64_t ks = P.Hkv * P.D, vs = P.Hkv * P.Dv, qs = P.Hq * P.D, dos = P.Hq * P.Dv;
  const float* K = P.k + ((b * P.Skv + kv0) * P.Hkv + hkv) * P.D;
  const float* V = P.v + ((b * P.Skv + kv0) * P.Hkv + hkv) * P.Dv;
  float* S = w.s.data();
  float* dP = w.dp.data();
  float* M = w.mask.data();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t hq = hkv * G + g;
    const int64_t lb = P.Bm == 1 ? 0 : b, lh = P.Hm == 1 ? 0 : hq;
    const int64_t row = (lb * P.Hm + lh) * P.nKV + j;
    for (int pass = 0; pass < 2; ++pass) {
      const bool partial = pass == 0;
      const int n = partial ? P.q_num[row] : P.fq_num[row];
      const int32_t* idx = partial ? P.q_idx + row * P.wp : P.fq_idx + row * P.wf;
      for (int t = 0; t < n; ++t) {
        const int q0 = (int)(idx[t] * P.bq);
        const int nr = (int)std::min<int64_t>(P.bq, P.Sq - q0);
        if (nr <= 0 || nc <= 0) continue;
        const int nrp = (nr + 15) / 16 * 16;
        const float* Q = P.q + ((b * P.Sq + q0) * P.Hq + hq) * P.D;
        const float* dO = P.dout + ((b * P.Sq + q0) * P.Hq + hq) * P.Dv;
        const float* Qt = P.qT + (b * P.Hq + hq) * P.D * P.Sqp + q0;
        const float* dOt = P.doT + (b * P.Hq + hq) * P.Dv * P.Sqp + q0;
        int ldq = (int)P.Sqp;
        if (P.tile_prep) {
          w.qt.resize((size_t)D * nrp);
          w.dot.resize((size_t)Dv * nrp);
          transpose_rows(Q, qs, nr, D, w.qt.data(), nrp, P.scale);
          transpose_rows(dO, dos, nr, Dv, w.dot.data(), nrp, 1.0f);
          Qt = w.qt.data();
          dOt = w.dot.data();
          ldq = nrp;
        }
        // As in the forward, a partial tile's 16-row groups each take the kv range [lo, hi) where
        // any of their rows is allowed; the transposed products then take, for each column,
        // the rows [rlo, rhi) of the groups whose range holds it. P and dS are zero elsewhere.
        const int ng = nrp / 16;
        const bool masked = partial && P.mask_fn;
        if (masked) {
          std::fill(M, M + (int64_t)nc * nrp, 0.0f);
          P.mask_fn(M, nrp, nc, nrp, (int)b, (int)hq, q0, kv0, P.mask_arrays);
          group_ranges(M, nrp, nc, lo, hi);
          for (int c = 0; c < nc; ++c) {
            rlo[c] = nrp;
            rhi[c] = 0;
          }
          bool any = false;
          for (int gr = 0; gr < ng; ++gr) {
            for (int c = lo[gr]; c < hi[gr]; ++c) {
              rlo[c] = std::min(rlo[c], 16 * gr);
              rhi[c] = std::min(16 * gr + 16, nr);
            }
            any |= lo[gr] < hi[gr];
          }
          // (S and dP need no clearing: the passes below write every lane of every column,
          // zero outside the ranges, before the transposed products read them.)
          if (!any) continue;
        } else {
          for (int gr = 0; gr < ng; ++gr) {
            lo[gr] = 0;
            hi[gr] = nc;
          }
          for (int c = 0; c < nc; ++c) {
            rlo[c] = 0;
            rhi[c] = nr;
          }
        }
        qk_groups(K, ks, Qt, ldq, D, S, nrp, nc, lo, hi, [&](int r0, int width, int c_lo, int c_hi) {
          if (!P.score_fn) return;
          for (int c = c_lo; c < c_hi; ++c)
            std::memcpy(w.s_raw.data() + (int64_t)c * nrp + r0, S + (int64_t)c * nrp + r0, sizeof(float) * width);
          P.score_fn(S + (int64_t)c_lo * nrp + r0, nrp, c_hi - c_lo, width, (int)b, (int)hq, q0 + r0, kv0 + c_lo,
                     P.score_arrays);
        });
        // P = exp((s - max) - log_sum), 0 where masked, outside the ranges and on padded lanes.
        const int64_t stat = (b * P.Hq + hq) * P.Sq + q0;
        for (int r = 0; r < nrp; ++r) {
          const bool in = r < nr;
          mxp[r] = in ? P.row_max[stat + r] : 0.0f;
          lsp[r] = in ? P.log_sum[stat + r] : 0.0f;
          dep[r] = in ? (P.tile_prep ? row_delta(P, dO + (int64_t)r * dos, b, hq, q0 + r) : P.delta[stat + r]) : 0.0f;
        }
        vi16 lane;
        for (int l = 0; l < 16; ++l) lane[l] = l;
        for (int gr = 0; gr < ng; ++gr) {
          const int r = 16 * gr;
          const vi16 valid = (lane + r) < nr;
          for (int c = 0; c < nc; ++c) {
            float* pr = S + (int64_t)c * nrp + r;
            if (c < lo[gr] || c >= hi[gr]) {
              fj_st(pr, fj_f(0.0f));
              continue;
            }
            v16 p = fj_vexp((fj_ld(pr) - fj_ld(mxp + r)) - fj_ld(lsp + r));
            vi16 keep = valid;
            if (masked) keep &= fj_ld(M + (int64_t)c * nrp + r) == 0.0f;
            fj_st(pr, keep ? p : fj_f(0.0f));
          }
        }
        tn_tile(S, nrp, dO, dos, rlo, rhi, w.dv.data(), Dv, nc);          // dV += P^T dO
        qk_groups(V, vs, dOt, ldq, Dv, dP, nrp, nc, lo, hi,
                  [](int, int, int, int) {});                               // dP^T = V dO^T
        for (int gr = 0; gr < ng; ++gr) {
          const int r = 16 * gr;
          for (int c = lo[gr]; c < hi[gr]; ++c) {
            float* pr = S + (int64_t)c * nrp + r;
            float* dpr = dP + (int64_t)c * nrp + r;
            fj_st(dpr, fj_ld(pr) * (fj_ld(dpr) - fj_ld(dep + r)));
          }
          // Columns of the chunk's union outside this group's range: dS is 0 there.
          for (int c = 0; c < nc; ++c)
            if (c < lo[gr] || c >= hi[gr]) fj_st(dP + (int64_t)c * nrp + r, fj_f(0.0f));
        }
        if (P.vjp_fn) {
          for (int r0 = 0; r0 < nrp;) {  // the chunks of qk_groups, over the same ranges
            const int width = r0 + 64 <= nrp ? 64 : (r0 + 32 <= nrp ? 32 : 16);
            int c_lo = nc, c_hi = 0;
            for (int gr = r0 / 16; gr < (r0 + width) / 16; ++gr) {
              c_lo = std::min(c_lo, lo[gr]);
              c_hi = std::max(c_hi, hi[gr]);
            }
            if (c_lo < c_hi)
              P.vjp_fn(w.s_raw.data() + (int64_t)c_lo * nrp + r0, dP + (int64_t)c_lo * nrp + r0, nrp, c_hi - c_lo,
                       width, (int)b, (int)hq, q0 + r0, kv0 + c_lo, P.score_arrays);
            r0 += width;
          }
        }
        tn_tile(dP, nrp, Q, qs, rlo, rhi, w.dk.data(), D, nc);           // dK += dS^T Q (scaled below)
        float* dQ = P.dq[slot] + ((b * P.Sq + q0) * P.Hq + hq) * P.D;
        // The slot's first write to this dQ tile overwrites it (alpha null: its old rows,
        // garbage, are not read); rows no group writes are zeroed then.
        uint8_t& seen = P.written[slot][(b * P.Hq + hq) * P.nqb + idx[t]];
        const float* add = seen ? w.ones.data() : nullptr;
        if (masked) {                                                      // dQ += dS K (scaled below)
          for (int gr = 0; gr < ng; ++gr) {
            const int r1 = std::min(16 * gr + 16, nr);
            if (lo[gr] < hi[gr])
              pv_range(dP, nrp, K, ks, lo[gr], hi[gr], dQ, (int)qs, D, 16 * gr, r1, add);
            else if (!seen)
              for (int r = 16 * gr; r < r1; ++r) std::memset(dQ + (int64_t)r * qs, 0, sizeof(float) * D);
          }
        } else {
          pv_range(dP, nrp, K, ks, 0, nc, dQ, (int)qs, D, 0, nr, add);
        }
        seen = 1;
      }
    }
  }
  for (int c = 0; c < nc; ++c) {
    float* dkr = P.dk + ((b * P.Skv + kv0 + c) * P.Hkv + hkv) * P.D;
    float* dvr = P.dv + ((b * P.Skv + kv0 + c) * P.Hkv + hkv) * P.Dv;
    for (int d = 0; d < D; ++d) dkr[d] = w.dk[(size_t)c * D + d] * P.scale;
    for (int d = 0; d < Dv; ++d) dvr[d] = w.dv[(size_t)c * Dv + d];
  }
}

// The prepass of one (batch, query head, 128-row chunk): the chunk's scaled q and dO,
// transposed into qT and doT (16 x 16 blocks), and delta = rowsum(dO * O) - dlse (a cotangent
// on lse adds P * dlse to dS), as the XLA loops.
static void bwd_prepass(const BwdProblem& P, int64_t item) {
  const int64_t nch = (P.Sq + 127) / 128;
  const int64_t ch = item % nch, hq = (item / nch) % P.Hq, b = item / (nch * P.Hq);
  const int64_t r0 = ch * 128, r1 = std::min<int64_t>(P.Sq, r0 + 128);
  const int64_t qs = P.Hq * P.D, dos = P.Hq * P.Dv;
  const float* Q = P.q + (b * P.Sq * P.Hq + hq) * P.D;
  const float* dO = P.dout + (b * P.Sq * P.Hq + hq) * P.Dv;
  float* qT = P.qT + (b * P.Hq + hq) * P.D * P.Sqp;
  float* doT = P.doT + (b * P.Hq + hq) * P.Dv * P.Sqp;
  transpose_rows(Q + r0 * qs, qs, r1 - r0, P.D, qT + r0, P.Sqp, P.scale);
  transpose_rows(dO + r0 * dos, dos, r1 - r0, P.Dv, doT + r0, P.Sqp, 1.0f);
  const int64_t stat = (b * P.Hq + hq) * P.Sq;
  for (int64_t r = r0; r < r1; ++r) P.delta[stat + r] = row_delta(P, dO + r * dos, b, hq, r);
  // The padded lanes past Sq (up to Sqp) are zero.
  if (r1 == P.Sq) {
    for (int64_t d = 0; d < P.D; ++d)
      std::fill(qT + d * P.Sqp + (P.Sq + 15) / 16 * 16, qT + (d + 1) * P.Sqp, 0.0f);
    for (int64_t d = 0; d < P.Dv; ++d)
      std::fill(doT + d * P.Sqp + (P.Sq + 15) / 16 * 16, doT + (d + 1) * P.Sqp, 0.0f);
  }
}

// At most this many visits per q tile on average: per-visit transposes (a sliding window of
// 256 at S=8192 in fwd+bwd: 147 -> 140 ms, its 10.7 ms prepass gone).
static constexpr int64_t kTilePrepVisits = 4;

static ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> dout,
                           ffi::Buffer<ffi::F32> dlse, ffi::Buffer<ffi::F32> row_max, ffi::Buffer<ffi::F32> log_sum,
                           ffi::Buffer<ffi::S32> q_num, ffi::Buffer<ffi::S32> q_idx, ffi::Buffer<ffi::S32> fq_num,
                           ffi::Buffer<ffi::S32> fq_idx, ffi::RemainingArgs consts, ffi::ResultBuffer<ffi::F32> dq,
                           ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale,
                           int64_t block_q, int64_t block_kv, int64_t kv_len, int64_t score_fn, int64_t mask_fn,
                           int64_t vjp_fn, int64_t prep, int64_t n_score_consts) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), li = q_idx.dimensions(),
       fi = fq_idx.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || li.size() != 4 || fi.size() != 4)
    return ffi::Error::InvalidArgument("flexjax cpu kernel: bad ranks");
  BwdProblem P;
  P.q = q.typed_data();
  P.k = k.typed_data();
  P.v = v.typed_data();
  P.out = out.typed_data();
  P.dout = dout.typed_data();
  P.dlse = dlse.typed_data();
  P.row_max = row_max.typed_data();
  P.log_sum = log_sum.typed_data();
  P.q_num = q_num.typed_data();
  P.q_idx = q_idx.typed_data();
  P.fq_num = fq_num.typed_data();
  P.fq_idx = fq_idx.typed_data();
  P.Bm = li[0];
  P.Hm = li[1];
  P.nKV = li[2];
  P.wp = li[3];
  P.wf = fi[3];
  P.B = qd[0];
  P.Sq = qd[1];
  P.Hq = qd[2];
  P.D = qd[3];
  P.Skv = kd[1];
  P.Hkv = kd[2];
  P.Dv = vd[3];
  P.Sqp = (P.Sq + 15) / 16 * 16 + 16;
  P.bq = block_q;
  P.bkv = block_kv;
  P.kv_len = kv_len;
  P.scale = scale;
  P.score_fn = reinterpret_cast<ModFn>(score_fn);
  P.mask_fn = reinterpret_cast<ModFn>(mask_fn);
  P.vjp_fn = reinterpret_cast<VjpFn>(vjp_fn);
  std::vector<const void*> arrays;
  if (!captured_arrays(consts, arrays)) return ffi::Error::InvalidArgument("flexjax cpu kernel: bad captured array");
  P.score_arrays = arrays.data();
  P.mask_arrays = arrays.data() + n_score_consts;
  P.dk = dk->typed_data();
  P.dv = dv->typed_data();
  const size_t nq = (size_t)P.B * P.Sq * P.Hq * P.D;
  // Every kv row below kv_len is written by its block's item; the rows past it are zero.
  for (int64_t bb = 0; bb < P.B; ++bb) {
    const int64_t r = std::min(P.kv_len, P.Skv), n = P.Skv - r;
    std::memset(P.dk + (bb * P.Skv + r) * P.Hkv * P.D, 0, sizeof(float) * (size_t)(n * P.Hkv * P.D));
    std::memset(P.dv + (bb * P.Skv + r) * P.Hkv * P.Dv, 0, sizeof(float) * (size_t)(n * P.Hkv * P.Dv));
  }
  if (P.B == 0 || P.Sq == 0 || P.Hq == 0) return ffi::Error::Success();
  const int64_t items = P.B * P.Hkv * ((P.kv_len + P.bkv - 1) / P.bkv);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items));
  // Visits per q tile, over the lists: a narrow band (a sliding window visits each q tile 3
  // times, causal 16 times at S=4096) transposes per visit rather than in a prepass.
  P.nqb = (P.Sq + P.bq - 1) / P.bq;
  int64_t visits = 0;
  for (int64_t r = 0; r < P.Bm * P.Hm * P.nKV; ++r) visits += P.q_num[r] + P.fq_num[r];
  P.tile_prep = prep == 0 ? visits <= kTilePrepVisits * P.Bm * P.Hm * P.nqb : prep == 2;
  const size_t nqt = P.tile_prep ? 0 : (size_t)P.B * P.Hq * P.D * P.Sqp,
               ndot = P.tile_prep ? 0 : (size_t)P.B * P.Hq * P.Dv * P.Sqp,
               nstat = P.tile_prep ? 0 : (size_t)P.B * P.Hq * P.Sq;
  // One lease: qT, doT, delta, then a dQ buffer for each slot but the first (which
  // accumulates into the output).
  WorkLease work(nqt + ndot + nstat + (size_t)(threads - 1) * nq);
  P.qT = work.data();
  P.doT = P.qT + nqt;
  P.delta = P.doT + ndot;
  P.dq.push_back(dq->typed_data());
  for (int64_t t = 1; t < threads; ++t) P.dq.push_back(P.delta + nstat + (size_t)(t - 1) * nq);
  const int64_t units = P.B * P.Hq * P.nqb;
  std::vector<uint8_t> written((size_t)(threads * units), 0);
  for (int64_t t = 0; t < threads; ++t) P.written.push_back(written.data() + t * units);
  const int64_t pre = P.B * P.Hq * ((P.Sq + 127) / 128);
  if (!P.tile_prep)
    run_parallel<NoScratch>(pool, pre, pre, [&P](int64_t i, int64_t, NoScratch&) { bwd_prepass(P, i); });
  // Deterministic dQ: item i adds into the buffer of slot i % threads, and each slot walks its
  // items in increasing order, whichever pool thread runs it. Taking items as threads come free
  // would put a different subset of kv blocks into each buffer every run, and so sum each dQ
  // element in a different order (bitwise different results between identical calls).
  if (items > 0) {
    run_parallel<BwdScratch>(pool, threads, threads, [&P, items, threads](int64_t slot, int64_t, BwdScratch& w) {
      for (int64_t i = slot; i < items; i += threads) bwd_item(P, i, slot, w);
    });
  }
  // dQ = scale * the sum of the tiles the slots wrote (0 where none did).
  run_parallel<NoScratch>(pool, units, units, [&P, scale](int64_t u, int64_t, NoScratch&) {
    const int64_t qb = u % P.nqb, hq = (u / P.nqb) % P.Hq, b = u / (P.nqb * P.Hq);
    const int64_t q0 = qb * P.bq, nr = std::min<int64_t>(P.bq, P.Sq - q0);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t off = ((b * P.Sq + q0 + r) * P.Hq + hq) * P.D;
      for (int64_t d = 0; d < P.D; d += 16) {
        v16 sum = P.written[0][u] ? fj_ld(P.dq[0] + off + d) : fj_f(0.0f);
        for (size_t t = 1; t < P.dq.size(); ++t)
          if (P.written[t][u]) sum += fj_ld(P.dq[t] + off + d);
        fj_st(P.dq[0] + off + d, sum * scale);
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlexjaxCpuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_kv")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("score_fn")
                                  .Attr<int64_t>("mask_fn")
                                  .Attr<int64_t>("vjp_fn")
                                  .Attr<int64_t>("prep")
                                  .Attr<int64_t>("n_score_consts"));
