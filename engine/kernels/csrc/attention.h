// Paged attention: the KV write by slot mapping and single-token decode attention read
// through the block table.
#pragma once

#include "vec16.h"

namespace baton_kernels {

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

// acc[g, :] += sum_i p[g * 16 + i] * v[i, :] over the m <= 16 value rows v (row stride D)
// of one block, for each head g of a group: p holds the softmax numerators.
template <int NC>
inline void pv_f32(float* acc_out, const float* p, int64_t G, int64_t D, const float* v, int64_t m) {
  // U interleaved token streams per accumulator, so FMA latency does not bind.
  constexpr int U = NC == 4 ? 4 : NC == 8 ? 2 : 1;
  for (int64_t g = 0; g < G; ++g) {
    float* og = acc_out + g * D;
    const float* pg = p + g * 16;
    V16 a[U][NC];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < NC; ++c) a[u][c] = u == 0 ? vload(og + c * 16) : vzero();
    int64_t i = 0;
    for (; i + U <= m; i += U)
      for (int u = 0; u < U; ++u) {
        const V16 pv = vset(pg[i + u]);
        for (int c = 0; c < NC; ++c) a[u][c] = vfma(pv, vload(v + (i + u) * D + c * 16), a[u][c]);
      }
    for (; i < m; ++i) {
      const V16 pv = vset(pg[i]);
      for (int c = 0; c < NC; ++c) a[0][c] = vfma(pv, vload(v + i * D + c * 16), a[0][c]);
    }
    for (int c = 0; c < NC; ++c) {
      V16 sum = a[0][c];
      for (int u = 1; u < U; ++u) sum = vadd(sum, a[u][c]);
      vstore(og + c * 16, sum);
    }
  }
}

#if defined(__AVX512BF16__)
// pv_f32 for bf16 values, on the bf16 dot product over token pairs: p is rounded to bf16
// (as flash attention does in bf16), the products are exact and summed in fp32. A pair
// is _mm512_unpacklo/hi_epi16 of rows t and t + 1, so lane 4i + j of the lo half holds
// column 8i + j of a 32-column chunk and the hi half column 8i + 4 + j (i, j < 4).
template <int NC>
inline void pv_bf16(float* acc_out, const float* p, int64_t G, int64_t D, const bf16* v, int64_t m) {
  constexpr int NP = NC / 2;  // 32-column chunks
  __m512i pairs[8][NP][2];
  const int64_t npairs = (m + 1) / 2;
  for (int64_t k = 0; k < npairs; ++k) {
    const bf16* r0 = v + 2 * k * D;
    const bf16* r1 = 2 * k + 1 < m ? r0 + D : r0;  // an odd last row pairs with itself at p = 0
    for (int c = 0; c < NP; ++c) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(r0 + 32 * c));
      const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(r1 + 32 * c));
      pairs[k][c][0] = _mm512_unpacklo_epi16(a, b);
      pairs[k][c][1] = _mm512_unpackhi_epi16(a, b);
    }
  }
  const __m512i first_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second_idx = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __mmask16 rows_in = m >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
  for (int64_t g = 0; g < G; ++g) {
    alignas(64) uint32_t pp[8];
    const __m512 pg = _mm512_maskz_loadu_ps(rows_in, p + g * 16);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(pg));
    __m512 a[NP][2];
    for (int c = 0; c < NP; ++c) a[c][0] = a[c][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < npairs; ++k) {
      const __m512bh pk = (__m512bh)_mm512_set1_epi32(int(pp[k]));
      for (int c = 0; c < NP; ++c) {
        a[c][0] = _mm512_dpbf16_ps(a[c][0], pk, (__m512bh)pairs[k][c][0]);
        a[c][1] = _mm512_dpbf16_ps(a[c][1], pk, (__m512bh)pairs[k][c][1]);
      }
    }
    float* og = acc_out + g * D;
    for (int c = 0; c < NP; ++c) {
      const __m512 first = _mm512_permutex2var_ps(a[c][0], first_idx, a[c][1]);
      const __m512 second = _mm512_permutex2var_ps(a[c][0], second_idx, a[c][1]);
      _mm512_storeu_ps(og + 32 * c, _mm512_add_ps(_mm512_loadu_ps(og + 32 * c), first));
      _mm512_storeu_ps(og + 32 * c + 16, _mm512_add_ps(_mm512_loadu_ps(og + 32 * c + 16), second));
    }
  }
}
#endif

// decode_part (below) in one pass for head dims of 64 and 128 (NC = 4, 8) on AVX-512: each
// block's keys, then at once its values, with the softmax kept online (a running max per
// head; the sums so far are rescaled when it grows). Each block's K and V are read back
// to back and its scores stay in registers, where the two-pass form streamed all keys,
// wrote the scores out, then streamed all values. In bf16 the P.V products run on the dot
// product (pv_bf16). On the decode rows of a W1 step in bf16 with contiguous blocks: 1.36x
// faster than the two-pass form (``python -m benchmarks.decode_attention --against
// 206437a``).
template <typename T, int NC>
void decode_part_online(float* acc_out, float* m_out, float* l_out, const T* q_rows, int64_t q_head_stride,
                        int64_t G, const T* kc_head, const T* vc_head, int64_t bs, const int64_t* table,
                        int64_t t_begin, int64_t t_end, int64_t t_lo, float scale) {
#if defined(__AVX512F__)
  constexpr int64_t D = NC * 16;
  constexpr bool kDot = std::is_same_v<T, bf16>;
  V16 qv[16 * NC];  // fp32 q, pre-scaled (fp32 scores)
#if defined(__AVX512BF16__)
  __m512bh qb[16 * NC / 2];  // bf16 q as it is (bf16 scores, scaled after)
#endif
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (kDot) {
#if defined(__AVX512BF16__)
      for (int c = 0; c < NC / 2; ++c)
        qb[g * NC / 2 + c] =
            (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q_rows + g * q_head_stride + c * 32));
#endif
    } else {
      for (int c = 0; c < NC; ++c) qv[g * NC + c] = vmul(vload(q_rows + g * q_head_stride + c * 16), vset(scale));
    }
  }
  float m_run[16], l_run[16];
  for (int64_t g = 0; g < G; ++g) {
    m_run[g] = -INFINITY;
    l_run[g] = 0.f;
  }
  for (int64_t j = 0; j < G * D; ++j) acc_out[j] = 0.f;
  alignas(64) float p[16 * 16];  // [head][token] softmax numerators of one 16-token group
  for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
    const T* kb = kc_head + table[t0 / bs] * bs * D;
    const T* vb = vc_head + table[t0 / bs] * bs * D;
    const int64_t n = std::min(bs, t_end - t0);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - i0);
      const T* rows[16];  // rows past the block repeat a valid row; their lanes are masked
      for (int64_t i = 0; i < 16; ++i) rows[i] = kb + (i0 + i < n ? i0 + i : i0) * D;
      __mmask16 valid = m == 16 ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
      const int64_t first = t0 + i0;  // tokens before t_lo are outside the window
      if (t_lo > first) valid &= t_lo - first >= 16 ? __mmask16(0) : __mmask16(0xFFFFu << (t_lo - first));
      if (valid == 0) continue;
      for (int64_t g = 0; g < G; ++g) {
        V16 r;
        if constexpr (kDot) {
#if defined(__AVX512BF16__)
          r = scores16_bf16<NC>(qb + g * NC / 2, reinterpret_cast<const bf16* const*>(rows), NC, scale);
#endif
        } else {
          r = scores16<T, NC>(qv + g * NC, rows, NC);
        }
        const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, r.v);
        const float top = _mm512_reduce_max_ps(sc);
        if (top > m_run[g]) {
          const float f = m_run[g] == -INFINITY ? 0.f : std::exp(m_run[g] - top);
          m_run[g] = top;
          l_run[g] *= f;
          for (int c = 0; c < NC; ++c) vstore(acc_out + g * D + c * 16, vmul(vset(f), vload(acc_out + g * D + c * 16)));
        }
        const V16 e = vexp(V16{_mm512_sub_ps(sc, _mm512_set1_ps(m_run[g]))});
        l_run[g] += vsum(e);
        vstore(p + g * 16, e);
      }
      if constexpr (kDot) {
#if defined(__AVX512BF16__)
        pv_bf16<NC>(acc_out, p, G, D, vb + i0 * D, m);
#endif
      } else {
        pv_f32<NC>(acc_out, p, G, D, vb + i0 * D, m);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    m_out[g] = m_run[g];
    l_out[g] = l_run[g];
  }
#else
  TORCH_CHECK(false, "decode_part_online needs AVX-512");
#endif
}

// Whether decode_part_online serves T at head dim NC * 16 in this build.
template <typename T, int NC>
constexpr bool online_serves() {
#if defined(__AVX512BF16__)
  return NC == 4 || NC == 8;
#elif defined(__AVX512F__)
  return (NC == 4 || NC == 8) && std::is_same_v<T, float>;
#else
  return false;
#endif
}

// Attention of one query token per head of a GQA group over the cached tokens
// [t_begin, t_end) of one sequence (t_begin on a block edge), read through the block
// table; tokens before ``t_lo`` (a sliding window's first token, t_lo < t_end) are
// masked out, which lets a window start mid-block. Leaves the unnormalized sums in acc
// [G, D] and each head's max score and softmax denominator in m_out, l_out, so that parts
// of a context can be merged. NC = D / 16 chunks (compile-time for common head dims, 0 =
// runtime). Head dims 64 and 128 run decode_part_online; the others two passes here:
// scores for every token, then softmax numerators and the weighted sum of values.
template <typename T, int NC_FIXED>
void decode_part(float* acc_out, float* m_out, float* l_out, const T* q_rows, int64_t q_head_stride,
                 int64_t G, int64_t nc_rt, const T* kc_head, const T* vc_head, int64_t bs,
                 const int64_t* table, int64_t t_begin, int64_t t_end, int64_t t_lo, float scale,
                 std::vector<float>& scores) {
  if constexpr (NC_FIXED > 0 && online_serves<T, NC_FIXED>()) {
    decode_part_online<T, NC_FIXED>(acc_out, m_out, l_out, q_rows, q_head_stride, G, kc_head, vc_head, bs, table,
                                    t_begin, t_end, t_lo, scale);
    return;
  }
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
  // Outside the sliding window: a zero softmax numerator, so pass 2 adds nothing.
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = t_begin; t < std::min(t_lo, t_end); ++t) s[g * ls + (t - t_begin)] = -INFINITY;
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

// How decode attention splits a batch: work items are (sequence, kv head, part of the
// context). A batch with fewer (sequence, kv head) pairs than two per thread splits long
// contexts into parts, on block edges, so that every thread has work; parts merge by
// their max and sum. With ``split`` > 0 (deterministic mode) every context is cut into
// parts of ``split`` tokens (whole blocks) from its first token, whatever the batch, the
// threads or the longest context, and the parts always merge the same way: a row's bits
// then depend on its own context alone.
struct DecodePlan {
  int64_t pairs = 0, parts = 1, blocks_per_part = 0, items = 0, grain = 1;
  bool merge = false;
};

inline DecodePlan decode_plan(int64_t B, int64_t Hkv, const int64_t* lens, int64_t bs, int64_t threads,
                              int64_t split) {
  int64_t total = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    total += lens[b];
    longest = std::max(longest, lens[b]);
  }
  DecodePlan plan;
  plan.pairs = B * Hkv;
  const int64_t blocks_longest = (longest + bs - 1) / bs;
  plan.blocks_per_part = blocks_longest;
  if (split > 0) {
    plan.blocks_per_part = std::max<int64_t>(1, split / bs);
    plan.parts = (blocks_longest + plan.blocks_per_part - 1) / plan.blocks_per_part;
  } else {
    if (threads > 1 && plan.pairs < 2 * threads) {
      const int64_t want = (2 * threads + plan.pairs - 1) / plan.pairs;
      const int64_t max_by_len = std::max<int64_t>(1, longest / std::max<int64_t>(bs, 128));
      plan.parts = std::min<int64_t>({want, max_by_len, 64});
    }
    plan.blocks_per_part = (blocks_longest + plan.parts - 1) / plan.parts;
  }
  plan.merge = split > 0 || plan.parts > 1;
  plan.items = plan.pairs * plan.parts;
  // Below ~8K token-heads of work a parallel region costs more than it saves.
  const int64_t work = total * Hkv;
  plan.grain = plan.merge ? 1 : std::max<int64_t>(1, (int64_t(8192) * plan.items) / std::max<int64_t>(1, work));
  return plan;
}

// One layer's decode attention over a batch: q [B, H, D] and out (strides in elements),
// that layer's K and V caches, the block tables and context lengths (checked by the
// caller), a sliding window (0: none).
template <typename T>
struct DecodeArgs {
  const T* qp;
  int64_t q_s0, q_s1;
  T* op;
  int64_t o_s0, o_s1;
  const T* kc;
  const T* vc;
  int64_t Hkv, NB, bs, G, D, width;
  const int64_t* tables;
  const int64_t* lens;
  float scale;
  int64_t window;
};

// Work items [begin, end) of ``plan``: each part's unnormalized sums and max/denominator
// into part_acc/part_ml where the plan merges, else the normalized rows into out.
template <typename T>
void decode_items(const DecodeArgs<T>& a, const DecodePlan& plan, float* part_acc, float* part_ml, int64_t begin,
                  int64_t end) {
  const int64_t G = a.G, D = a.D, NC = D / 16, parts = plan.parts;
  std::vector<float> scores;
  std::vector<float> acc(size_t(G * D));
  float m[16], l[16];
  for (int64_t it = begin; it < end; ++it) {
    const int64_t pair = it / parts, part = it % parts;
    const int64_t b = pair / a.Hkv, h = pair % a.Hkv;
    const int64_t len = a.lens[b];
    // A sliding window attends to the last ``window`` tokens only: parts wholly before
    // it are empty, and the block it starts in is read from its edge, then masked.
    const int64_t t_lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
    const int64_t t_begin = std::max(std::min(len, part * plan.blocks_per_part * a.bs), t_lo / a.bs * a.bs);
    const int64_t t_end = std::min(len, (part + 1) * plan.blocks_per_part * a.bs);
    float* acc_p = plan.merge ? part_acc + it * G * D : acc.data();
    float* m_p = plan.merge ? part_ml + it * G * 2 : m;
    float* l_p = plan.merge ? m_p + G : l;
    if (t_begin >= t_end) {  // this sequence is shorter than the part's start
      for (int64_t g = 0; g < G; ++g) {
        m_p[g] = -INFINITY;
        l_p[g] = 0.f;
      }
      for (int64_t j = 0; j < G * D; ++j) acc_p[j] = 0.f;
      continue;
    }
    const T* qrows = a.qp + b * a.q_s0 + h * G * a.q_s1;
    const T* kh = a.kc + h * a.NB * a.bs * D;
    const T* vh = a.vc + h * a.NB * a.bs * D;
    const int64_t* table = a.tables + b * a.width;
    if (NC == 4)
      decode_part<T, 4>(acc_p, m_p, l_p, qrows, a.q_s1, G, NC, kh, vh, a.bs, table, t_begin, t_end, t_lo, a.scale,
                        scores);
    else if (NC == 8)
      decode_part<T, 8>(acc_p, m_p, l_p, qrows, a.q_s1, G, NC, kh, vh, a.bs, table, t_begin, t_end, t_lo, a.scale,
                        scores);
    else
      decode_part<T, 0>(acc_p, m_p, l_p, qrows, a.q_s1, G, NC, kh, vh, a.bs, table, t_begin, t_end, t_lo, a.scale,
                        scores);
    if (!plan.merge) {
      for (int64_t g = 0; g < G; ++g) {
        T* orow = a.op + b * a.o_s0 + (h * G + g) * a.o_s1;
        const float inv = 1.f / l_p[g];
        for (int64_t d = 0; d < D; ++d) store_f(orow + d, acc_p[g * D + d] * inv);
      }
    }
  }
}

// The rows of (sequence, kv head) pairs [begin, end) from their parts, where the plan
// merges. Parts in context order; an empty one (past the row's context, or before its
// window) is skipped, so that how many parts the longest context of the batch made never
// shows.
template <typename T>
void decode_merge(const DecodeArgs<T>& a, const DecodePlan& plan, const float* part_acc, const float* part_ml,
                  int64_t begin, int64_t end) {
  const int64_t G = a.G, D = a.D, parts = plan.parts;
  std::vector<float> w(static_cast<size_t>(parts));
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t b = pair / a.Hkv, h = pair % a.Hkv;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part_ml[((pair * parts + p) * G * 2) + g]);
      float denom = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float* ml = part_ml + (pair * parts + p) * G * 2;
        w[p] = ml[g] == -INFINITY ? 0.f : std::exp(ml[g] - mx);
        if (w[p] != 0.f) denom += w[p] * ml[G + g];
      }
      T* orow = a.op + b * a.o_s0 + (h * G + g) * a.o_s1;
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.f;
        for (int64_t p = 0; p < parts; ++p)
          if (w[p] != 0.f) v += w[p] * part_acc[(pair * parts + p) * G * D + g * D + d];
        store_f(orow + d, v / denom);
      }
    }
  }
}

// Checks that every context length fits the block table and every block id it reads is
// in the pool.
inline void check_decode_tables(const int64_t* tables, const int64_t* lens, int64_t B, int64_t width, int64_t bs,
                                int64_t NB) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "decode_attention: context length ", lens[b],
                " outside [1, ", width * bs, "]");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[b * width + j] >= 0 && tables[b * width + j] < NB,
                  "decode_attention: block id out of range");
  }
}

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const T* kc, const T* vc, int64_t Hkv,
                           int64_t NB, int64_t bs, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, int64_t window, int64_t split) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  check_decode_tables(tables, lens, B, width, bs, NB);
  const DecodeArgs<T> args{q.data_ptr<T>(), q.stride(0), q.stride(1), out.data_ptr<T>(), out.stride(0),
                           out.stride(1), kc, vc, Hkv, NB, bs, H / Hkv, D, width, tables, lens, float(scale),
                           window};
  const DecodePlan plan = decode_plan(B, Hkv, lens, bs, at::get_num_threads(), split);
  const size_t G = size_t(H / Hkv);
  std::vector<float> part_acc(plan.merge ? size_t(plan.items) * G * size_t(D) : 0);
  std::vector<float> part_ml(plan.merge ? size_t(plan.items) * G * 2 : 0);
  at::parallel_for(0, plan.items, plan.grain, [&](int64_t begin, int64_t end) {
    decode_items<T>(args, plan, part_acc.data(), part_ml.data(), begin, end);
  });
  if (plan.merge) decode_merge<T>(args, plan, part_acc.data(), part_ml.data(), 0, plan.pairs);
}

// out, q: [B, H, D] (unit last stride); kv_cache: [layers, 2, Hkv, NB, bs, D] contiguous,
// of which layer ``layer`` is read; block_tables: [B, width] int64; context_lens: [B]
// int64 (tokens including the query); window: attend to the last ``window`` tokens only
// (0: the whole context); split: reduce every context in parts of this many tokens
// (whole blocks), merged in one fixed order, so that a row's result does not depend on
// the batch (0: parts chosen per batch for the threads, the fastest).
void decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      int64_t window, int64_t split) {
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
  TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0, got ", window);
  TORCH_CHECK(split >= 0, "decode_attention: split must be >= 0, got ", split);
  if (B == 0) return;
  const int64_t per_kv = Hkv * NB * bs * D;  // elements of one layer's K (or V)
  if (q.scalar_type() == at::kFloat) {
    const float* base = kv_cache.data_ptr<float>() + layer * 2 * per_kv;
    decode_attention_impl<float>(out, q, base, base + per_kv, Hkv, NB, bs, block_tables, context_lens, scale,
                                 window, split);
  } else if (q.scalar_type() == at::kBFloat16) {
    const bf16* base = kv_cache.data_ptr<bf16>() + layer * 2 * per_kv;
    decode_attention_impl<bf16>(out, q, base, base + per_kv, Hkv, NB, bs, block_tables, context_lens, scale,
                                window, split);
  } else {
    TORCH_CHECK(false, "decode_attention: dtype ", q.scalar_type(), " not supported");
  }
}

}  // namespace baton_kernels
