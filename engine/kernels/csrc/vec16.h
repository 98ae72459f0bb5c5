// Scalar bf16 conversions and V16, the 16-lane fp32 vector all kernels are written
// against: one AVX-512 register where the compiler targets AVX-512, two AVX2 registers
// where it targets AVX2 and FMA (AMD Zen 2/3, Intel before Skylake-SP: the scalar array
// ran every kernel there several times slower than torch), a plain array elsewhere.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace baton_kernels {

using bf16 = c10::BFloat16;

// ---- scalar conversions ------------------------------------------------------------------

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, like torch's float -> bfloat16 conversion (NaN stays NaN).
inline uint16_t bf16_bits(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline void store_f(float* p, float v) { *p = v; }
inline void store_f(bf16* p, float v) { p->x = bf16_bits(v); }
// v rounded to the precision of T and widened back to float.
template <typename T>
inline float round_to(float v);
template <>
inline float round_to<float>(float v) { return v; }
template <>
inline float round_to<bf16>(float v) {
  uint32_t u = uint32_t(bf16_bits(v)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- 16-lane fp32 vector -----------------------------------------------------------------

#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vload(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vhmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
// a rounded to bf16 (nearest even, like torch) and widened back.
inline __m512i bf16_round_bits(V16 a) {
  __m512i u = _mm512_castps_si512(a.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u)));
}
inline V16 vround_bf16(V16 a) { return {_mm512_castsi512_ps(bf16_round_bits(a))}; }
inline void vstore_bf16(bf16* p, V16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(a), 16)));
}
// exp(x) (Cephes polynomial, ~1 ulp); below -87.3 gives ~0, above 88.7 gives inf.
inline V16 vexp(V16 x) {
  __m512 t = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-87.3365f)), _mm512_set1_ps(88.7228f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return {_mm512_scalef_ps(p, n)};
}
// r[i] = sum of the lanes of a[i], for 16 vectors: a transpose-and-add tree (30 ops
// instead of 16 full horizontal reductions).
inline V16 vreduce16(const V16* a) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i].v, a[2 * i + 1].v, 0x44),
                         _mm512_shuffle_f32x4(a[2 * i].v, a[2 * i + 1].v, 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  // The tree leaves the sum of a[4e + j] at lane 4j + e; put it back at lane 4e + j.
  const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return {_mm512_permutexvar_ps(idx, r)};
}
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
  __m256 lo, hi;
};
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V16 vload(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen_bf16x8(_mm256_castsi256_si128(h)), widen_bf16x8(_mm256_extracti128_si256(h, 1))};
}
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
// The 8 lanes of v summed: pairs of 128-bit halves, then within 128 bits.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vsum(V16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vhmax(V16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
// a rounded to bf16 (nearest even, like torch), as the high 16 bits of each lane.
inline __m256i bf16_round_bits8(__m256 a) {
  __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  u = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(u), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  return _mm256_and_si256(u, _mm256_set1_epi32(int(0xFFFF0000u)));
}
inline V16 vround_bf16(V16 a) {
  return {_mm256_castsi256_ps(bf16_round_bits8(a.lo)), _mm256_castsi256_ps(bf16_round_bits8(a.hi))};
}
inline void vstore_bf16(bf16* p, V16 a) {
  // packus interleaves the 128-bit lanes of its inputs (lo 0-3, hi 0-3, lo 4-7, hi 4-7);
  // the permute puts them back in order.
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(bf16_round_bits8(a.lo), 16),
                                             _mm256_srli_epi32(bf16_round_bits8(a.hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
// exp(x), the same Cephes polynomial as the AVX-512 path; 2^n is applied as two exact
// powers of two (n split in halves), as scalef does, so results near the range's ends
// stay finite or denormal where they should.
inline __m256 exp8(__m256 x) {
  const __m256 t = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.7228f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline V16 vexp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
// r[i] = sum of the lanes of a[i], for 16 vectors: hadd trees, 8 vectors at a time.
inline __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // Each 128-bit half now holds partial sums of vectors 0-3 / 4-7 in both halves.
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}
inline V16 vreduce16(const V16* a) {
  __m256 t[16];
  for (int i = 0; i < 16; ++i) t[i] = _mm256_add_ps(a[i].lo, a[i].hi);
  return {reduce8(t), reduce8(t + 8)};
}
#else
struct V16 {
  float v[16];
};
inline V16 vset(float x) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline V16 vzero() { return vset(0.f); }
template <typename T>
inline V16 vload(const T* p) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = to_f(p[i]);
  return r;
}
inline void vstore(float* p, V16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V16 vfma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline V16 vmul(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
inline V16 vadd(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline V16 vmax(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
  return a;
}
inline float vsum(V16 a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
inline float vhmax(V16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]);
  return m;
}
inline V16 vexp(V16 x) {
  for (int i = 0; i < 16; ++i) x.v[i] = std::exp(std::max(x.v[i], -87.3365f));
  return x;
}
inline V16 vdiv(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] /= b.v[i];
  return a;
}
inline V16 vround_bf16(V16 a) {
  for (int i = 0; i < 16; ++i) a.v[i] = round_to<bf16>(a.v[i]);
  return a;
}
inline void vstore_bf16(bf16* p, V16 a) {
  for (int i = 0; i < 16; ++i) store_f(p + i, a.v[i]);
}
inline V16 vreduce16(const V16* a) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = vsum(a[i]);
  return r;
}
#endif

inline void vstore_t(float* p, V16 a) { vstore(p, a); }
inline void vstore_t(bf16* p, V16 a) { vstore_bf16(p, a); }

// ---- packed bf16 weights ------------------------------------------------------------------

// Where value c of a group of 16 bf16 weights is stored in a packed copy (the panels) so
// that vload_packed widens them fastest. On AVX2 that is two unpacks against zero, which
// put the bf16 bits in the high half of each 32-bit lane (the fp32 of the same value) but
// take 128-bit lanes' words 0-3 (unpacklo) and 4-7 (unpackhi): so the middle quads are
// swapped. A widening through vpmovzxwd + shift took 5 instructions per 16 weights and
// made batch-1 panels compute-bound below the memory's rate.
constexpr int64_t packed_pos(int64_t c) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  const int64_t q = c / 4;
  return (q == 1 ? 2 : q == 2 ? 1 : q) * 4 + c % 4;
#else
  return c;
#endif
}
inline V16 vload_packed(const float* p) { return vload(p); }
inline V16 vload_packed(const bf16* p) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w))};
#else
  return vload(p);
#endif
}
template <typename T>
inline V16 vround_to(V16 a) {
  if constexpr (std::is_same_v<T, bf16>)
    return vround_bf16(a);
  else
    return a;
}

}  // namespace baton_kernels
