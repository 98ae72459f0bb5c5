// CPU kernels for the decode hot path, registered as torch.ops.baton_cpu.*.
//
// Built once per machine by engine/kernels/cpu.py (g++ -O3 -march=native -fopenmp
// -ffp-contract=off). Every op is an optional plug-in with a plain-torch twin that gives
// the same result: rms_norm and rotary replicate torch's rounding step by step (bit-exact);
// decode_attention and linear differ from torch only in fp32 summation order.
//
// Vector code is written once against a 16-lane fp32 type, V16, which is one AVX-512
// register where the compiler targets AVX-512 and a plain array elsewhere.

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

namespace {

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

// ---- write_kv ----------------------------------------------------------------------------

// kv_cache: [layers, 2, Hkv, NB, bs, D] contiguous; k, v: [T, Hkv, D] with unit last stride.
// Writes token t's K/V at flat slot slot_mapping[t] (block * bs + offset) of every head of
// layer ``layer``.
void write_kv(at::Tensor& kv_cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(1) == 2,
              "write_kv: kv_cache must be contiguous [layers, 2, Hkv, NB, bs, D]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "write_kv: layer ", layer, " out of range");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(),
              "write_kv: k/v must be [T, Hkv, D] with unit last stride");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "write_kv: dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv: slot_mapping must be contiguous int64");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  TORCH_CHECK(kv_cache.size(2) == H && kv_cache.size(5) == D && slot_mapping.numel() == T,
              "write_kv: shape mismatch");
  const int64_t slots_per_head = kv_cache.size(3) * kv_cache.size(4);
  const int64_t esz = k.element_size();
  const int64_t per_kv = H * slots_per_head * D * esz;  // bytes of one layer's K (or V)
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(kv_cache.data_ptr()) + layer * 2 * per_kv;
  auto* vc = kc + per_kv;
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s >= 0 && s < slots_per_head, "write_kv: slot ", s, " out of range");
    for (int64_t h = 0; h < H; ++h) {
      const int64_t dst = ((h * slots_per_head) + s) * D * esz;
      std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * esz, D * esz);
      std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * esz, D * esz);
    }
  }
}

// ---- decode attention --------------------------------------------------------------------

// Pulls a block's rows toward L1 ahead of the compute (two blocks ahead): blocks sit at
// random places in the pool, so the hardware prefetcher cannot run ahead across them.
template <typename T>
inline void prefetch_block(const T* p, int64_t bytes) {
#if defined(__AVX512F__)
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
#else
  (void)p;
  (void)bytes;
#endif
}

// Prefetches the context's block number j (if it exists) of one head's cache.
template <typename T>
inline void prefetch_ahead(const T* head, const int64_t* table, int64_t j, int64_t bs, int64_t D, int64_t L) {
  if (j * bs < L) prefetch_block(head + table[j] * bs * D, std::min(bs, L - j * bs) * D * int64_t(sizeof(T)));
}

// Scores of one query head against up to 16 cached tokens (rows[i]); q already scaled.
template <typename T, int NC_FIXED>
inline V16 scores16(const V16* qg, const T* const* rows, int64_t nc_rt) {
  const int64_t NC = NC_FIXED > 0 ? NC_FIXED : nc_rt;
  V16 acc[16];
  for (int i = 0; i < 16; ++i) {
    acc[i] = vmul(qg[0], vload(rows[i]));
    for (int64_t c = 1; c < NC; ++c) acc[i] = vfma(qg[c], vload(rows[i] + c * 16), acc[i]);
  }
  return vreduce16(acc);
}

#if defined(__AVX512BF16__)
// bf16 q and K straight into the bf16 dot product (exact products, fp32 sums); D % 32 == 0.
template <int NC_FIXED>
inline V16 scores16_bf16(const __m512bh* qg, const bf16* const* rows, int64_t nc_rt, float scale) {
  const int64_t NP = (NC_FIXED > 0 ? NC_FIXED : nc_rt) / 2;
  V16 acc[16];
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < NP; ++c)
      a = _mm512_dpbf16_ps(a, qg[c], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(rows[i] + c * 32)));
    acc[i] = {a};
  }
  return vmul(vreduce16(acc), vset(scale));
}
#endif

// Attention of one query token per head of a GQA group over the cached tokens
// [t_begin, t_end) of one sequence (t_begin on a block edge), read through the block
// table. Two passes: scores for every token, then softmax numerators and the weighted
// sum of values. Leaves the unnormalized sums in acc [G, D] and each head's max score
// and softmax denominator in m_out, l_out, so that parts of a context can be merged.
// NC = D / 16 chunks (compile-time for common head dims, 0 = runtime).
template <typename T, int NC_FIXED>
void decode_part(float* acc_out, float* m_out, float* l_out, const T* q_rows, int64_t q_head_stride,
                 int64_t G, int64_t nc_rt, const T* kc_head, const T* vc_head, int64_t bs,
                 const int64_t* table, int64_t t_begin, int64_t t_end, float scale,
                 std::vector<float>& scores) {
  const int64_t NC = NC_FIXED > 0 ? NC_FIXED : nc_rt;
  const int64_t D = NC * 16;
  const int64_t L = t_end - t_begin;
  // q in fp32, pre-scaled. Small stack buffers: G <= 16, D <= 256.
  V16 qv[16 * 16];
  const V16 sv = vset(scale);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < NC; ++c) qv[g * NC + c] = vmul(vload(q_rows + g * q_head_stride + c * 16), sv);
#if defined(__AVX512BF16__)
  constexpr bool kBf16Dot = std::is_same_v<T, bf16>;
  __m512bh qb[16 * 8];
  if constexpr (kBf16Dot) {
    if (NC % 2 == 0)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < NC / 2; ++c)
          qb[g * 8 + c] = (__m512bh)_mm512_loadu_si512(
              reinterpret_cast<const void*>(q_rows + g * q_head_stride + c * 32));
  }
#endif
  // Rounded up to whole 16-token groups; the tail lanes are scratch.
  const int64_t ls = L + 16;  // row stride of the scores buffer
  scores.resize(size_t(G * ls));
  float* s = scores.data();
  const int64_t j0 = t_begin / bs;
  // Pass 1: scores, 16 tokens at a time (rows past the context repeat a valid row).
  prefetch_ahead(kc_head, table, j0 + 1, bs, D, t_end);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
    const T* kb = kc_head + table[t0 / bs] * bs * D;
    const int64_t n = std::min(bs, t_end - t0);
    prefetch_ahead(kc_head, table, t0 / bs + 2, bs, D, t_end);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const T* rows[16];
      for (int64_t i = 0; i < 16; ++i) rows[i] = kb + (i0 + i < n ? i0 + i : i0) * D;
      for (int64_t g = 0; g < G; ++g) {
        V16 r;
#if defined(__AVX512BF16__)
        if constexpr (kBf16Dot) {
          if (NC % 2 == 0)
            r = scores16_bf16<NC_FIXED>(qb + g * 8, reinterpret_cast<const bf16* const*>(rows), NC, scale);
          else
            r = scores16<T, NC_FIXED>(qv + g * NC, rows, NC);
        } else {
          r = scores16<T, NC_FIXED>(qv + g * NC, rows, NC);
        }
#else
        r = scores16<T, NC_FIXED>(qv + g * NC, rows, NC);
#endif
        vstore(s + g * ls + (t0 - t_begin) + i0, r);
      }
    }
  }
  prefetch_ahead(vc_head, table, j0, bs, D, t_end);
  prefetch_ahead(vc_head, table, j0 + 1, bs, D, t_end);
  // Softmax numerators and denominators per head.
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * ls;
    float m = -INFINITY;
    int64_t t = 0;
    if (L >= 16) {
      V16 mv = vload(sg);
      for (t = 16; t + 16 <= L; t += 16) mv = vmax(mv, vload(sg + t));
      m = vhmax(mv);
    }
    for (; t < L; ++t) m = std::max(m, sg[t]);
    const V16 mv = vset(-m);
    V16 sum = vzero();
    for (t = 0; t + 16 <= L; t += 16) {
      V16 e = vexp(vadd(vload(sg + t), mv));
      vstore(sg + t, e);
      sum = vadd(sum, e);
    }
    float tail = 0.f;
    for (; t < L; ++t) {
      sg[t] = std::exp(sg[t] - m);
      tail += sg[t];
    }
    m_out[g] = m;
    l_out[g] = vsum(sum) + tail;
  }
  // Pass 2: numerators times values, 16 tokens at a time: the rows are widened to fp32
  // once, then each head's accumulators stay in registers across the group.
  for (int64_t j = 0; j < G * D; ++j) acc_out[j] = 0.f;
  alignas(64) float vf[16 * 256];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
    const T* vb = vc_head + table[t0 / bs] * bs * D;
    const int64_t n = std::min(bs, t_end - t0);
    prefetch_ahead(vc_head, table, t0 / bs + 2, bs, D, t_end);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - i0);
      const float* rows;
      if constexpr (std::is_same_v<T, float>) {
        rows = vb + i0 * D;
      } else {
        for (int64_t i = 0; i < m; ++i)
          for (int64_t c = 0; c < NC; ++c) vstore(vf + i * D + c * 16, vload(vb + (i0 + i) * D + c * 16));
        rows = vf;
      }
      // U interleaved token streams per accumulator, so FMA latency does not bind.
      constexpr int U = NC_FIXED == 4 ? 4 : NC_FIXED == 8 ? 2 : 1;
      constexpr int NA = NC_FIXED > 0 ? NC_FIXED : 16;
      for (int64_t g = 0; g < G; ++g) {
        float* og = acc_out + g * D;
        const float* pg = s + g * ls + (t0 - t_begin) + i0;
        V16 a[U][NA];
        for (int u = 0; u < U; ++u)
          for (int64_t c = 0; c < NC; ++c) a[u][c] = u == 0 ? vload(og + c * 16) : vzero();
        int64_t i = 0;
        for (; i + U <= m; i += U)
          for (int u = 0; u < U; ++u) {
            const V16 p = vset(pg[i + u]);
            for (int64_t c = 0; c < NC; ++c) a[u][c] = vfma(p, vload(rows + (i + u) * D + c * 16), a[u][c]);
          }
        for (; i < m; ++i) {
          const V16 p = vset(pg[i]);
          for (int64_t c = 0; c < NC; ++c) a[0][c] = vfma(p, vload(rows + i * D + c * 16), a[0][c]);
        }
        for (int64_t c = 0; c < NC; ++c) {
          V16 sum = a[0][c];
          for (int u = 1; u < U; ++u) sum = vadd(sum, a[u][c]);
          vstore(og + c * 16, sum);
        }
      }
    }
  }
}

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const T* kc, const T* vc, int64_t Hkv,
                           int64_t NB, int64_t bs, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = H / Hkv, NC = D / 16;
  const int64_t width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t total = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "decode_attention: context length ", lens[b],
                " outside [1, ", width * bs, "]");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[b * width + j] >= 0 && tables[b * width + j] < NB,
                  "decode_attention: block id out of range");
    total += lens[b];
    longest = std::max(longest, lens[b]);
  }
  // Work items are (sequence, kv head, part of the context). A batch with fewer
  // (sequence, kv head) pairs than two per thread splits long contexts into parts, on
  // block edges, so that every thread has work; parts merge by their max and sum.
  const int64_t pairs = B * Hkv;
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1;
  if (threads > 1 && pairs < 2 * threads) {
    const int64_t want = (2 * threads + pairs - 1) / pairs;
    const int64_t max_by_len = std::max<int64_t>(1, longest / std::max<int64_t>(bs, 128));
    parts = std::min<int64_t>({want, max_by_len, 64});
  }
  const int64_t blocks_longest = (longest + bs - 1) / bs;
  const int64_t blocks_per_part = (blocks_longest + parts - 1) / parts;
  const int64_t items = pairs * parts;
  std::vector<float> part_acc(parts > 1 ? size_t(items * G * D) : 0);
  std::vector<float> part_ml(parts > 1 ? size_t(items * G * 2) : 0);
  // Below ~8K token-heads of work a parallel region costs more than it saves.
  const int64_t work = total * Hkv;
  const int64_t grain = parts > 1 ? 1 : std::max<int64_t>(1, (int64_t(8192) * items) / std::max<int64_t>(1, work));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(size_t(G * D));
    float m[16], l[16];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t pair = it / parts, part = it % parts;
      const int64_t b = pair / Hkv, h = pair % Hkv;
      const int64_t t_begin = std::min(lens[b], part * blocks_per_part * bs);
      const int64_t t_end = std::min(lens[b], (part + 1) * blocks_per_part * bs);
      float* acc_p = parts > 1 ? part_acc.data() + it * G * D : acc.data();
      float* m_p = parts > 1 ? part_ml.data() + it * G * 2 : m;
      float* l_p = parts > 1 ? m_p + G : l;
      if (t_begin >= t_end) {  // this sequence is shorter than the part's start
        for (int64_t g = 0; g < G; ++g) {
          m_p[g] = -INFINITY;
          l_p[g] = 0.f;
        }
        for (int64_t j = 0; j < G * D; ++j) acc_p[j] = 0.f;
        continue;
      }
      const T* qrows = qp + b * q.stride(0) + h * G * q.stride(1);
      const T* kh = kc + h * NB * bs * D;
      const T* vh = vc + h * NB * bs * D;
      const int64_t* table = tables + b * width;
      if (NC == 4)
        decode_part<T, 4>(acc_p, m_p, l_p, qrows, q.stride(1), G, NC, kh, vh, bs, table, t_begin, t_end,
                          float(scale), scores);
      else if (NC == 8)
        decode_part<T, 8>(acc_p, m_p, l_p, qrows, q.stride(1), G, NC, kh, vh, bs, table, t_begin, t_end,
                          float(scale), scores);
      else
        decode_part<T, 0>(acc_p, m_p, l_p, qrows, q.stride(1), G, NC, kh, vh, bs, table, t_begin, t_end,
                          float(scale), scores);
      if (parts == 1) {
        for (int64_t g = 0; g < G; ++g) {
          T* orow = op + b * out.stride(0) + (h * G + g) * out.stride(1);
          const float inv = 1.f / l_p[g];
          for (int64_t d = 0; d < D; ++d) store_f(orow + d, acc_p[g * D + d] * inv);
        }
      }
    }
  });
  if (parts == 1) return;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / Hkv, h = pair % Hkv;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_ml[((pair * parts + p) * G * 2) + g]);
      float denom = 0.f;
      float w[64];
      for (int64_t p = 0; p < parts; ++p) {
        const float* ml = part_ml.data() + (pair * parts + p) * G * 2;
        w[p] = ml[g] == -INFINITY ? 0.f : std::exp(ml[g] - mx);
        denom += w[p] * ml[G + g];
      }
      T* orow = op + b * out.stride(0) + (h * G + g) * out.stride(1);
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.f;
        for (int64_t p = 0; p < parts; ++p) v += w[p] * part_acc[(pair * parts + p) * G * D + g * D + d];
        store_f(orow + d, v / denom);
      }
    }
  }
}

// out, q: [B, H, D] (unit last stride); kv_cache: [layers, 2, Hkv, NB, bs, D] contiguous,
// of which layer ``layer`` is read; block_tables: [B, width] int64; context_lens: [B]
// int64 (tokens including the query).
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1,
              "decode_attention: q/out must be [B, H, D] with unit last stride");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(1) == 2,
              "decode_attention: kv_cache must be contiguous [layers, 2, Hkv, NB, bs, D]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "decode_attention: layer ", layer, " out of range");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "decode_attention: dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "decode_attention: block_tables/context_lens must be contiguous int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv_cache.size(2), NB = kv_cache.size(3), bs = kv_cache.size(4);
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == D && kv_cache.size(5) == D,
              "decode_attention: shape mismatch");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 16 && D % 16 == 0 && D <= 256,
              "decode_attention: needs heads % kv_heads == 0, group <= 16, head_dim % 16 == 0, <= 256");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B, "decode_attention: batch mismatch");
  if (B == 0) return;
  const int64_t per_kv = Hkv * NB * bs * D;  // elements of one layer's K (or V)
  if (q.scalar_type() == at::kFloat) {
    const float* base = kv_cache.data_ptr<float>() + layer * 2 * per_kv;
    decode_attention_impl<float>(out, q, base, base + per_kv, Hkv, NB, bs, block_tables, context_lens, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    const bf16* base = kv_cache.data_ptr<bf16>() + layer * 2 * per_kv;
    decode_attention_impl<bf16>(out, q, base, base + per_kv, Hkv, NB, bs, block_tables, context_lens, scale);
  } else {
    TORCH_CHECK(false, "decode_attention: dtype ", q.scalar_type(), " not supported");
  }
}

// ---- RMSNorm -----------------------------------------------------------------------------

// HF/torch order: y = x.float() * rsqrt(mean(x.float()^2) + eps); out = weight * y.to(T).
template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t N = x.size(0), C = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / std::max<int64_t>(C, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * C;
      float ss = 0.f;
      int64_t c = 0;
      if (C >= 16) {
        V16 acc = vzero();
        for (; c + 16 <= C; c += 16) {
          V16 v = vload(xr + c);
          acc = vfma(v, v, acc);
        }
        ss = vsum(acc);
      }
      for (; c < C; ++c) ss += to_f(xr[c]) * to_f(xr[c]);
      const float var = ss / float(C);
      const float inv = 1.f / std::sqrt(var + float(eps));
      const V16 iv = vset(inv);
      for (c = 0; c + 16 <= C; c += 16)
        vstore_t(orow + c, vmul(vload(wp + c), vround_to<T>(vmul(vload(xr + c), iv))));
      for (; c < C; ++c) {
        const float y = round_to<T>(to_f(xr[c]) * inv);
        store_f(orow + c, to_f(wp[c]) * y);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [N, C] with unit last stride");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight must be contiguous [C]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: dtype mismatch");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(out, x, weight, eps);
  else if (x.scalar_type() == at::kBFloat16)
    rms_norm_impl<bf16>(out, x, weight, eps);
  else
    TORCH_CHECK(false, "rms_norm: dtype ", x.scalar_type(), " not supported");
  return out;
}

// ---- rotary embedding --------------------------------------------------------------------

// HF rotate-half order, rounding to T after each op like torch:
// out = x * cos + rotate_half(x) * sin, with cos/sin first rounded to T.
template <typename T, typename C>
void rope_rows(T* out, const T* x, int64_t rows, int64_t row_stride, int64_t D, const C* cr, const C* sr) {
  const int64_t half = D / 2;
  if (half % 16 == 0) {
    for (int64_t h = 0; h < rows; ++h) {
      const T* xr = x + h * row_stride;
      T* orow = out + h * D;
      for (int64_t d = 0; d < half; d += 16) {
        const V16 x1 = vload(xr + d), x2 = vload(xr + d + half);
        const V16 c1 = vround_to<T>(vload(cr + d)), c2 = vround_to<T>(vload(cr + d + half));
        const V16 s1 = vround_to<T>(vload(sr + d)), s2 = vround_to<T>(vload(sr + d + half));
        const V16 neg = vset(-1.f);
        vstore_t(orow + d, vadd(vround_to<T>(vmul(x1, c1)), vround_to<T>(vmul(vmul(x2, neg), s1))));
        vstore_t(orow + d + half, vadd(vround_to<T>(vmul(x2, c2)), vround_to<T>(vmul(x1, s2))));
      }
    }
    return;
  }
  for (int64_t h = 0; h < rows; ++h) {
    const T* xr = x + h * row_stride;
    T* orow = out + h * D;
    for (int64_t d = 0; d < D; ++d) {
      const float c = round_to<T>(to_f(cr[d]));
      const float s = round_to<T>(to_f(sr[d]));
      const float rot = d < half ? -to_f(xr[d + half]) : to_f(xr[d - half]);
      const float a = round_to<T>(to_f(xr[d]) * c);
      const float b = round_to<T>(rot * s);
      store_f(orow + d, a + b);
    }
  }
}

template <typename T, typename C>
void rotary_impl(at::Tensor& qo, at::Tensor& ko, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  const int64_t T_ = q.size(0), H = q.size(1), Hk = k.size(1), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const C* cp = cos.data_ptr<C>();
  const C* sp = sin.data_ptr<C>();
  const int64_t P = cos.size(0);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary: position ", pos[t], " outside the table");
  at::parallel_for(0, T_, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const C* cr = cp + pos[t] * D;
      const C* sr = sp + pos[t] * D;
      rope_rows<T, C>(qo.data_ptr<T>() + t * H * D, q.data_ptr<T>() + t * q.stride(0), H, q.stride(1), D, cr, sr);
      rope_rows<T, C>(ko.data_ptr<T>() + t * Hk * D, k.data_ptr<T>() + t * k.stride(0), Hk, k.stride(1), D, cr, sr);
    }
  });
}

// q: [T, H, D], k: [T, Hkv, D] (unit last stride); cos, sin: [P, D] contiguous; positions [T].
// Returns contiguous rotated copies of q and k.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary: q/k must be [T, H, D] with unit last stride");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0, "rotary: shape mismatch");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == q.size(2) &&
                  cos.sizes() == sin.sizes() && cos.scalar_type() == sin.scalar_type(),
              "rotary: cos/sin must be contiguous [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary: positions must be contiguous int64 [T]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary: q/k dtype mismatch");
  at::Tensor qo = at::empty(q.sizes(), q.options());
  at::Tensor ko = at::empty(k.sizes(), k.options());
  const auto qt = q.scalar_type(), ct = cos.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat)
    rotary_impl<float, float>(qo, ko, q, k, cos, sin, positions);
  else if (qt == at::kBFloat16 && ct == at::kBFloat16)
    rotary_impl<bf16, bf16>(qo, ko, q, k, cos, sin, positions);
  else if (qt == at::kBFloat16 && ct == at::kFloat)
    rotary_impl<bf16, float>(qo, ko, q, k, cos, sin, positions);
  else
    TORCH_CHECK(false, "rotary: dtypes ", qt, "/", ct, " not supported");
  return {qo, ko};
}

// ---- SiLU-and-multiply -------------------------------------------------------------------

// x: [M, 2I] = [gate | up]; out = silu(gate) * up, rounded to T after each op like torch
// (F.silu(gate) * up). silu(g) = g / (1 + exp(-g)).
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t M = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + I;
      T* o = op + r * I;
      int64_t c = 0;
      for (; c + 16 <= I; c += 16) {
        const V16 gv = vload(g + c);
        const V16 sv = vround_to<T>(vdiv(gv, vadd(vset(1.f), vexp(vmul(gv, vset(-1.f))))));
        vstore_t(o + c, vmul(sv, vload(u + c)));
      }
      for (; c < I; ++c) {
        const float gf = to_f(g[c]);
        store_f(o + c, round_to<T>(gf / (1.f + std::exp(-gf))) * to_f(u[c]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [M, 2I] with unit last stride");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_and_mul_impl<float>(out, x);
  else if (x.scalar_type() == at::kBFloat16)
    silu_and_mul_impl<bf16>(out, x);
  else
    TORCH_CHECK(false, "silu_and_mul: dtype ", x.scalar_type(), " not supported");
  return out;
}

// ---- small-batch bf16 linear -------------------------------------------------------------

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for MB rows of x and R = 16 / MB rows of w
// at a time: 16 accumulators, summed in one transpose-and-add tree.
template <int MB>
inline void gemv_tile(const bf16* x, int64_t xs, const bf16* w, int64_t K, const bf16* bias, bf16* y,
                      int64_t ys, int64_t n0, int64_t n1) {
  constexpr int R = MB == 3 ? 4 : 16 / MB;
  constexpr int64_t kAhead = R;  // rows of w prefetched: one tile ahead
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    V16 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = vzero();
    for (int64_t k = 0; k < K; k += 32) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + kAhead + r) * K + k), _MM_HINT_T0);
      __m512bh xv[MB];
      for (int m = 0; m < MB; ++m)
        xv[m] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * xs + k));
      for (int r = 0; r < R; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + (n + r) * K + k));
        for (int m = 0; m < MB; ++m) acc[m * R + r].v = _mm512_dpbf16_ps(acc[m * R + r].v, xv[m], wv);
      }
    }
    alignas(64) float sums[16];
    vstore(sums, vreduce16(acc));
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) {
        float v = sums[m * R + r];
        if (bias) v += to_f(bias[n + r]);
        store_f(y + m * ys + n + r, v);
      }
  }
  for (; n < n1; ++n) {
    for (int m = 0; m < MB; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * xs + k)),
                               (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + n * K + k)));
      float v = _mm512_reduce_add_ps(acc);
      if (bias) v += to_f(bias[n]);
      store_f(y + m * ys + n, v);
    }
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif

bool has_bf16_dot() { return kHasBf16Dot; }

// x: [M, K] bf16 (unit last stride), w: [N, K] bf16 contiguous, K % 32 == 0. Returns [M, N].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kHasBf16Dot, "linear_bf16: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1),
              "linear_bf16: needs x [M, K] with unit last stride and contiguous w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: needs bf16");
  TORCH_CHECK(w.size(1) % 32 == 0, "linear_bf16: K must be a multiple of 32");
  const bf16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == w.size(0) && bias->scalar_type() == at::kBFloat16,
                "linear_bf16: bias must be contiguous bf16 [N]");
    bp = bias->data_ptr<bf16>();
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t xs = x.stride(0);
  constexpr int64_t kTile = 64;  // rows of w per task
  const int64_t tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
    // Each tile of w serves every row of x while it sits in L1/L2.
    for (int64_t t = tb; t < te; ++t) {
      const int64_t n0 = t * kTile, n1 = std::min(N, n0 + kTile);
      for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        const bf16* xm = xp + m * xs;
        bf16* ym = yp + m * N;
        if (left >= 4) {
          gemv_tile<4>(xm, xs, wp, K, bp, ym, N, n0, n1);
          m += 4;
        } else if (left == 3) {
          gemv_tile<3>(xm, xs, wp, K, bp, ym, N, n0, n1);
          m += 3;
        } else if (left == 2) {
          gemv_tile<2>(xm, xs, wp, K, bp, ym, N, n0, n1);
          m += 2;
        } else {
          gemv_tile<1>(xm, xs, wp, K, bp, ym, N, n0, n1);
          m += 1;
        }
      }
    }
  });
#endif
  return y;
}

// ---- one decoder layer for a few decode rows ------------------------------------------

// A Llama-family decoder layer (pre-norm attention and SiLU MLP, residuals) over M decode
// rows, as the ops above compose it, in one call: at batch 1 the per-op dispatch of the
// Python layer costs about as much as the attention itself. Weights are HF-packed:
// qkv_w [(H + 2 Hkv) D, C], o_w [C, H D], gate_up_w [2 I, C], down_w [C, I]. bf16 uses
// the GEMV kernel (M <= 4 expected), float32 uses at::linear.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16) return linear_bf16(x, w, bias);
  return at::linear(x, w, bias);
}

at::Tensor decode_layer(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& kv_cache, int64_t layer,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& in_norm_w, const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_b,
                        const at::Tensor& o_w, const at::Tensor& post_norm_w, const at::Tensor& gate_up_w,
                        const at::Tensor& down_w, int64_t num_heads, double eps, double scale) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layer: hidden must be contiguous [M, C]");
  const int64_t M = hidden.size(0);
  const int64_t Hkv = kv_cache.size(2), D = kv_cache.size(5), H = num_heads;
  TORCH_CHECK(qkv_w.size(0) == (H + 2 * Hkv) * D, "decode_layer: qkv_w rows != (heads + 2 kv_heads) * head_dim");
  const at::Tensor x = rms_norm(hidden, in_norm_w, eps);
  const at::Tensor qkv = small_linear(x, qkv_w, qkv_b);
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({M, H, D});
  const at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({M, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({M, Hkv, D});
  auto [qr, kr] = rotary(q, k, cos, sin, positions);
  write_kv(kv_cache, layer, kr, v, slot_mapping);
  at::Tensor attn = at::empty({M, H, D}, hidden.options());
  decode_attention(attn, qr, kv_cache, layer, block_tables, context_lens, scale);
  const at::Tensor h1 = at::add(hidden, small_linear(attn.view({M, H * D}), o_w, std::nullopt));
  const at::Tensor x2 = rms_norm(h1, post_norm_w, eps);
  const at::Tensor act = silu_and_mul(small_linear(x2, gate_up_w, std::nullopt));
  return at::add(h1, small_linear(act, down_w, std::nullopt));
}

}  // namespace

TORCH_LIBRARY(baton_cpu, m) {
  m.def("write_kv(Tensor(a!) kv_cache, int layer, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def(
      "decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, int layer, Tensor block_tables, "
      "Tensor context_lens, float scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor positions) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def(
      "decode_layer(Tensor hidden, Tensor positions, Tensor(a!) kv_cache, int layer, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor cos, Tensor sin, Tensor in_norm_w, Tensor qkv_w, "
      "Tensor? qkv_b, Tensor o_w, Tensor post_norm_w, Tensor gate_up_w, Tensor down_w, int num_heads, "
      "float eps, float scale) -> Tensor");
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
}

TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("decode_layer", &decode_layer);
}
