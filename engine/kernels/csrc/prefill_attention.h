// Prefill attention over the paged KV cache: a chunk of a prompt's queries against every
// cached token before and within it (causal, optional sliding window), flash-style.
//
// Why a kernel of our own: torch's SDPA ran W1's prefill attention at ~50 GFLOP/s on 2
// cores (27% of a prefill step), and a chunk after the first had to gather its whole
// context out of the pool (index_select) and pass an explicit mask, every layer.
//
// The layout puts 16 query rows in the lanes of a vector (a row is one query head of one
// token; the heads of a GQA group share their KV head), so that a row's max, sum and
// rescale are lane-wise and nothing is reduced across lanes:
//   - scores: for each pair of head dims, the 16 rows' (q[2c], q[2c+1]) pairs (packed once
//     per row group) times one key's pair broadcast to every lane, with the AVX512-BF16
//     dot product (exact products, fp32 sums), one accumulator per key of a 16-key tile;
//   - online softmax in fp32, per lane;
//   - P.V into the output kept transposed, [D][16 rows]: in bf16 the probabilities are
//     rounded to bf16 (as flash attention does) and paired over keys for the dot product
//     against each pair of values broadcast; in fp32 (and head dims not a multiple of 32)
//     fp32 FMAs against each value broadcast.
// Work items are (KV head, run of kGroups row groups): the groups of a run share each key
// tile while it sits in L1, so a long context is read once per run. Items are taken
// largest first from a shared counter, since a causal row's work grows with its position.
// A row's result depends on its own keys alone (tiles on fixed 16-key edges, masked keys
// adding exact zeros), not on the threads or the rows beside it.
#pragma once

#include <atomic>

#include "vec16.h"

namespace baton_kernels {

namespace prefill_detail {

constexpr int kRows = 16;  // query rows per work item: the lanes of a V16
constexpr int kKeys = 16;  // keys per tile
constexpr int kGroups = 4;  // row groups of one work item, sharing each key tile

// The positions of one group of 16 rows and the keys they may attend to.
struct RowGroup {
  int64_t pos[kRows];   // position of each row's token (past the chunk: a copy of the last)
  int64_t lo, hi;       // keys [lo, hi) that any row of the group may attend to
  int64_t pos_min;
};

// Writes -inf over the scores of keys [k0, k0 + 16) a row may not attend to: after its
// position, at or before position - window, or at/after ``key_end``.
inline void mask_tile(V16* s, const RowGroup& rg, int64_t k0, int64_t key_end, int64_t window) {
  alignas(64) float buf[kKeys * kRows];
  for (int k = 0; k < kKeys; ++k) vstore(buf + k * kRows, s[k]);
  for (int k = 0; k < kKeys; ++k) {
    const int64_t key = k0 + k;
    for (int r = 0; r < kRows; ++r) {
      const bool out = key >= key_end || key > rg.pos[r] || (window > 0 && key <= rg.pos[r] - window);
      if (out) buf[k * kRows + r] = -INFINITY;
    }
  }
  for (int k = 0; k < kKeys; ++k) s[k] = vload(buf + k * kRows);
}

// Whether every row may attend to every key of [k0, k0 + 16) (no mask needed).
inline bool tile_open(const RowGroup& rg, int64_t k0, int64_t key_end, int64_t window) {
  if (k0 + kKeys > key_end || k0 + kKeys - 1 > rg.pos_min) return false;
  if (window > 0) {
    int64_t pos_max = rg.pos_min;
    for (int r = 0; r < kRows; ++r) pos_max = std::max(pos_max, rg.pos[r]);
    if (k0 <= pos_max - window) return false;
  }
  return true;
}

// The cache row of key ``key`` of one head (head base ``head``, block table ``table``).
template <typename T>
inline const T* key_row(const T* head, const int64_t* table, int64_t key, int64_t bs, int64_t D) {
  return head + (table[key / bs] * bs + key % bs) * D;
}

#if defined(__AVX512BF16__)
// out^T[d] = out^T[d] * alpha + sum_k p[k] * v[k][d] with the bf16 dot product over pairs
// of keys: the probabilities rounded to bf16 (as flash attention does in bf16), the
// values exact, the sums in fp32, over ``pack_v_pairs``' interleaved values: unpacklo/hi
// leave each 128-bit lane's 4 dims in place, so dim d sits at (d / 8) * 4 + d % 8 (d % 8 < 4) or 16 + (d / 8) * 4 + d % 8 - 4, per 32.
inline int32_t vpair_index(int64_t d) {
  const int64_t base = (d / 32) * 32, r = d % 32;
  return int32_t(base + (r % 8 < 4 ? (r / 8) * 4 + r % 8 : 16 + (r / 8) * 4 + r % 8 - 4));
}

// The values of keys 2j and 2j + 1 of a tile interleaved into ``vpair`` (8 x D int32),
// once per key tile for every row group that reads it.
inline void pack_v_pairs(const bf16* const* vrow, int64_t D, int32_t* vpair) {
  for (int j = 0; j < kKeys / 2; ++j)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(vrow[2 * j] + d));
      const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(vrow[2 * j + 1] + d));
      _mm512_storeu_si512(vpair + j * D + d, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vpair + j * D + d + 16, _mm512_unpackhi_epi16(a, b));
    }
}

inline void accumulate_pv_bf16(float* ot, const V16* p, V16 alpha, const int32_t* vpair, int64_t D) {
  // Pairs of probabilities, lane r = (p[2j][r], p[2j + 1][r]).
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512bh pp[kKeys / 2];
  for (int j = 0; j < kKeys / 2; ++j)
    pp[j] = (__m512bh)_mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(p[2 * j + 1].v, p[2 * j].v));
  for (int64_t d = 0; d < D; d += 4) {
    const int32_t at = vpair_index(d);  // d..d+3 sit at at..at+3
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 0) * kRows), alpha.v);
    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 1) * kRows), alpha.v);
    __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 2) * kRows), alpha.v);
    __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(ot + (d + 3) * kRows), alpha.v);
    for (int j = 0; j < kKeys / 2; ++j) {
      const int32_t* vj = vpair + j * D + at;
      a0 = _mm512_dpbf16_ps(a0, pp[j], (__m512bh)_mm512_set1_epi32(vj[0]));
      a1 = _mm512_dpbf16_ps(a1, pp[j], (__m512bh)_mm512_set1_epi32(vj[1]));
      a2 = _mm512_dpbf16_ps(a2, pp[j], (__m512bh)_mm512_set1_epi32(vj[2]));
      a3 = _mm512_dpbf16_ps(a3, pp[j], (__m512bh)_mm512_set1_epi32(vj[3]));
    }
    _mm512_storeu_ps(ot + (d + 0) * kRows, a0);
    _mm512_storeu_ps(ot + (d + 1) * kRows, a1);
    _mm512_storeu_ps(ot + (d + 2) * kRows, a2);
    _mm512_storeu_ps(ot + (d + 3) * kRows, a3);
  }
}
#endif

// One row group's running state while it walks the key tiles.
struct GroupState {
  RowGroup rg;
  int64_t r0 = 0;                 // its first row
  std::vector<float> qt;          // queries, [D][16 rows]
  std::vector<int32_t> qpair;     // bf16 queries as pairs, [D/2][16 rows]
  std::vector<float> ot;          // unnormalized output, [D][16 rows]
  V16 m, l;                       // running max and softmax denominator, per lane
  void alloc(int64_t D) {
    qt.resize(size_t(D * kRows));
    qpair.resize(size_t(D / 2 * kRows));
    ot.resize(size_t(D * kRows));
  }
};

// Scaled scores of a row group against a key tile: s[k] holds key k's score for every row.
template <typename T>
inline void tile_scores(V16* s, const GroupState& g, const T* const* krow, bool contiguous, int64_t D, bool dot,
                        float scale) {
  for (int k = 0; k < kKeys; ++k) s[k] = vzero();
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, bf16> && dot) {
    // Contiguous keys: fixed offsets from one base, each key's pair broadcast.
    const int32_t* kb = reinterpret_cast<const int32_t*>(krow[0]);
    for (int64_t c = 0; c < D / 2; ++c) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(g.qpair.data() + c * kRows);
      if (contiguous) {
        for (int k = 0; k < kKeys; ++k)
          s[k].v = _mm512_dpbf16_ps(s[k].v, qv, (__m512bh)_mm512_set1_epi32(kb[k * D / 2 + c]));
      } else {
        for (int k = 0; k < kKeys; ++k) {
          const int32_t kpair = reinterpret_cast<const int32_t*>(krow[k])[c];
          s[k].v = _mm512_dpbf16_ps(s[k].v, qv, (__m512bh)_mm512_set1_epi32(kpair));
        }
      }
    }
  } else
#endif
  {
    if (contiguous) {
      const T* kb = krow[0];
      for (int64_t d = 0; d < D; ++d) {
        const V16 qv = vload(g.qt.data() + d * kRows);
        for (int k = 0; k < kKeys; ++k) s[k] = vfma(qv, vset(to_f(kb[k * D + d])), s[k]);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        const V16 qv = vload(g.qt.data() + d * kRows);
        for (int k = 0; k < kKeys; ++k) s[k] = vfma(qv, vset(to_f(krow[k][d])), s[k]);
      }
    }
  }
  const V16 sv = vset(scale);
  for (int k = 0; k < kKeys; ++k) s[k] = vmul(s[k], sv);
}

// The online softmax step of a tile, lane by lane: scores become probabilities against
// the new running max; returns the factor the output so far is rescaled by.
inline V16 online_softmax(V16* s, GroupState& g) {
  V16 mt = s[0];
  for (int k = 1; k < kKeys; ++k) mt = vmax(mt, s[k]);
  const V16 mnew = vmax(g.m, mt);
  // A row with no key yet (mnew = -inf) takes 0 as its reference: exp(-inf) = 0.
  alignas(64) float mn[kRows];
  vstore(mn, mnew);
  for (int r = 0; r < kRows; ++r)
    if (mn[r] == -INFINITY) mn[r] = 0.f;
  const V16 neg = vmul(vload(mn), vset(-1.f));
  const V16 alpha = vexp(vadd(g.m, neg));
  V16 sum = vzero();
  for (int k = 0; k < kKeys; ++k) {
    s[k] = vexp(vadd(s[k], neg));
    sum = vadd(sum, s[k]);
  }
  g.l = vadd(vmul(g.l, alpha), sum);
  g.m = mnew;
  return alpha;
}

// out^T[d] = out^T[d] * alpha + sum_k p[k] * v[k][d] in fp32; ``v`` is the tile's values,
// [16 keys][D] fp32.
inline void accumulate_pv(float* ot, const V16* p, V16 alpha, const float* v, int64_t D) {
  for (int64_t d = 0; d < D; d += 4) {
    V16 a0 = vmul(vload(ot + (d + 0) * kRows), alpha);
    V16 a1 = vmul(vload(ot + (d + 1) * kRows), alpha);
    V16 a2 = vmul(vload(ot + (d + 2) * kRows), alpha);
    V16 a3 = vmul(vload(ot + (d + 3) * kRows), alpha);
    for (int k = 0; k < kKeys; ++k) {
      const float* vk = v + k * D + d;
      a0 = vfma(p[k], vset(vk[0]), a0);
      a1 = vfma(p[k], vset(vk[1]), a1);
      a2 = vfma(p[k], vset(vk[2]), a2);
      a3 = vfma(p[k], vset(vk[3]), a3);
    }
    vstore(ot + (d + 0) * kRows, a0);
    vstore(ot + (d + 1) * kRows, a1);
    vstore(ot + (d + 2) * kRows, a2);
    vstore(ot + (d + 3) * kRows, a3);
  }
}

}  // namespace prefill_detail

// out: [n, H, D], q: [n, H, D] (unit last stride) for the chunk's tokens at positions
// [start, start + n); kv_cache: [layers, 2, Hkv, NB, bs, D] contiguous, holding the
// chunk's own K/V already (write_kv first); block_ids: the sequence's blocks covering
// [0, start + n). window: attend to the last ``window`` positions only (0: all).
template <typename T>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const T* kc, const T* vc, int64_t Hkv,
                            int64_t NB, int64_t bs, const int64_t* table, int64_t start, double scale_d,
                            int64_t window) {
  using namespace prefill_detail;
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = H / Hkv;
  const int64_t rows_total = n * G;
  const int64_t groups = (rows_total + kRows - 1) / kRows;
  const int64_t key_end = start + n;
  const float scale = float(scale_d);
  // The bf16 dot-product paths take head dims in whole 512-bit registers of bf16.
  const bool dot = D % 32 == 0;
  // Whether the scores take the queries as bf16 pairs (tile_scores' dot product) rather
  // than transposed to fp32: only one of the two is filled.
#if defined(__AVX512BF16__)
  const bool pairs = std::is_same_v<T, bf16> && dot;
#else
  const bool pairs = false;
#endif
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  // Work items: (KV head, run of kGroups row groups). The groups of a run share each key
  // tile while it sits in L1: a long context is read once per run, not once per 16 rows.
  const int64_t runs = (groups + kGroups - 1) / kGroups;
  const int64_t items = runs * Hkv;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    GroupState st[kGroups];
    for (auto& g : st) g.alloc(D);
    std::vector<float> vf(size_t(kKeys * D));
    std::vector<int32_t> vpair(size_t(kKeys / 2 * D));
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      // Largest first: the last row groups see the most keys.
      const int64_t run = runs - 1 - it / Hkv;
      const int64_t h = it % Hkv;
      const int ng = int(std::min<int64_t>(kGroups, groups - run * kGroups));
      int64_t lo = INT64_MAX, hi = 0;
      for (int j = 0; j < ng; ++j) {
        GroupState& g = st[j];
        g.r0 = (run * kGroups + j) * kRows;
        RowGroup& rg = g.rg;
        for (int r = 0; r < kRows; ++r) rg.pos[r] = start + std::min(g.r0 + r, rows_total - 1) / G;
        rg.pos_min = rg.pos[0];
        rg.hi = rg.pos[kRows - 1] + 1;
        rg.lo = window > 0 ? std::max<int64_t>(0, rg.pos_min - window + 1) : 0;
        lo = std::min(lo, rg.lo);
        hi = std::max(hi, rg.hi);
        // Queries as [D/2][16 rows] bf16 pairs for the dot product, else transposed to
        // [D][16 rows] fp32.
        for (int r = 0; r < kRows; ++r) {
          const int64_t row = std::min(g.r0 + r, rows_total - 1);
          const T* qrow = qp + (row / G) * qs0 + (h * G + row % G) * qs1;
          if (pairs) {
            const int32_t* qp2 = reinterpret_cast<const int32_t*>(qrow);
            for (int64_t c = 0; c < D / 2; ++c) g.qpair[size_t(c * kRows + r)] = qp2[c];
          } else {
            for (int64_t d = 0; d < D; ++d) g.qt[size_t(d * kRows + r)] = to_f(qrow[d]);
          }
        }
        g.m = vset(-INFINITY);
        g.l = vzero();
        std::fill(g.ot.begin(), g.ot.end(), 0.f);
      }
      const T* kh = kc + h * NB * bs * D;
      const T* vh = vc + h * NB * bs * D;
      for (int64_t k0 = lo / kKeys * kKeys; k0 < hi; k0 += kKeys) {
        const T* krow[kKeys];
        const T* vrow[kKeys];
        for (int k = 0; k < kKeys; ++k) {
          const int64_t key = std::min(k0 + k, key_end - 1);
          krow[k] = key_row(kh, table, key, bs, D);
          vrow[k] = key_row(vh, table, key, bs, D);
        }
        // 16 keys in one block (block size a multiple of 16), none past the chunk.
        const bool contiguous = bs % kKeys == 0 && k0 + kKeys <= key_end;
        bool packed = false;  // the tile's values, interleaved or widened, for P.V
        const float* vsrc = vf.data();
        for (int j = 0; j < ng; ++j) {
          GroupState& g = st[j];
          if (k0 >= g.rg.hi || k0 + kKeys <= g.rg.lo) continue;
          V16 s[kKeys];
          tile_scores<T>(s, g, krow, contiguous, D, dot, scale);
          if (!tile_open(g.rg, k0, key_end, window)) mask_tile(s, g.rg, k0, key_end, window);
          const V16 alpha = online_softmax(s, g);
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, bf16>) {
            if (dot) {
              if (!packed) pack_v_pairs(vrow, D, vpair.data());
              packed = true;
              accumulate_pv_bf16(g.ot.data(), s, alpha, vpair.data(), D);
              continue;
            }
          }
#endif
          if (!packed) {
            if (std::is_same_v<T, float> && contiguous) {
              vsrc = reinterpret_cast<const float*>(vrow[0]);
            } else {
              for (int k = 0; k < kKeys; ++k)
                for (int64_t d = 0; d < D; d += 16) vstore(vf.data() + k * D + d, vload(vrow[k] + d));
            }
            packed = true;
          }
          accumulate_pv(g.ot.data(), s, alpha, vsrc, D);
        }
      }
      for (int j = 0; j < ng; ++j) {
        const GroupState& g = st[j];
        alignas(64) float inv[kRows];
        vstore(inv, g.l);
        for (int r = 0; r < kRows && g.r0 + r < rows_total; ++r) {
          const int64_t row = g.r0 + r;
          T* orow = op + (row / G) * os0 + (h * G + row % G) * os1;
          const float li = 1.f / inv[r];
          for (int64_t d = 0; d < D; ++d) store_f(orow + d, g.ot[size_t(d * kRows + r)] * li);
        }
      }
    }
  });
}

void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                       const at::Tensor& block_ids, int64_t start, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.sizes() == out.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: q/out must be [n, H, D] with unit last stride");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(1) == 2,
              "prefill_attention: kv_cache must be contiguous [layers, 2, Hkv, NB, bs, D]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "prefill_attention: layer ", layer, " out of range");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "prefill_attention: dtype mismatch");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.dim() == 1,
              "prefill_attention: block_ids must be contiguous int64 [blocks]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv_cache.size(2), NB = kv_cache.size(3), bs = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == D && Hkv > 0 && H % Hkv == 0 && D % 16 == 0 && D <= 256,
              "prefill_attention: needs heads % kv_heads == 0, head_dim % 16 == 0, <= 256");
  TORCH_CHECK(start >= 0 && window >= 0, "prefill_attention: start and window must be >= 0");
  TORCH_CHECK(block_ids.numel() * bs >= start + n, "prefill_attention: block_ids cover ",
              block_ids.numel() * bs, " tokens, the chunk ends at ", start + n);
  const int64_t* table = block_ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < (start + n + bs - 1) / bs; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < NB, "prefill_attention: block id out of range");
  if (n == 0) return;
  const int64_t per_kv = Hkv * NB * bs * D;
  if (q.scalar_type() == at::kFloat) {
    const float* base = kv_cache.data_ptr<float>() + layer * 2 * per_kv;
    prefill_attention_impl<float>(out, q, base, base + per_kv, Hkv, NB, bs, table, start, scale, window);
  } else if (q.scalar_type() == at::kBFloat16) {
    const bf16* base = kv_cache.data_ptr<bf16>() + layer * 2 * per_kv;
    prefill_attention_impl<bf16>(out, q, base, base + per_kv, Hkv, NB, bs, table, start, scale, window);
  } else {
    TORCH_CHECK(false, "prefill_attention: dtype ", q.scalar_type(), " not supported");
  }
}

}  // namespace baton_kernels
