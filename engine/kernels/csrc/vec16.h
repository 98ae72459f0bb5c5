// Scalar bf16 conversions and V16, the 16-lane fp32 vector all kernels are written
// against: one AVX-512 register where the compiler targets AVX-512, a plain array
// elsewhere.
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

#if defined(__AVX512F__)
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
template <typename T>
inline V16 vround_to(V16 a) {
  if constexpr (std::is_same_v<T, bf16>)
    return vround_bf16(a);
  else
    return a;
}

}  // namespace baton_kernels
