// Decode-sized linear layers (a few to a few dozen rows) on panel-packed weights.
//
// oneDNN's prepacked matmul reaches ~100 GFLOP/s on the 26-row batches of a W1 decode
// step when the weights come from DRAM (each layer's are read once a step): neither the
// bandwidth nor the FMA units are busy. Here the weight [N, K] is packed as panels of 64
// output columns, so one panel is a single contiguous stream, and the kernel runs every
// row of x against a panel while it sits in L2, with 6 rows x 64 columns of accumulators
// in registers (24 multiply-adds per 10 loads).
//
// - plain panels, [ceil(N / 64)][K][64] in the weight's dtype, for fp32 weights, and for
//   bf16 ones where the build has no AVX512-BF16 (kept bf16 and widened as loaded, which
//   is exact: half the bytes of fp32 panels from memory; on AVX2 each 16 columns are
//   stored in the order two unpacks widen, ``packed_pos``): fp32 FMAs, prefetching the
//   next panel into L2 meanwhile.
// - pair panels, [ceil(N / 64)][K / 2][64][2] bf16, for bf16 weights where it has: each
//   vector holds 16 columns' weights for two consecutive k, the layout of the bf16 dot
//   product, which takes x's (k, k + 1) pair broadcast and sums both products into fp32.
//   Half the bytes of the widened panels and twice the multiply-adds per instruction: on
//   SmolLM2-135M's layers from DRAM, on an AVX512-BF16 host without AMX, 1.15-1.4x
//   oneDNN's prepacked bf16 matmul at 8-96 rows and 1.7x the bf16 GEMV at 4 (even at 1;
//   ``python -m benchmarks.panel_linear --dtype bfloat16``). The route timer decides.
#pragma once

#include <atomic>

#include "linear.h"
#include "vec16.h"

namespace baton_kernels {

constexpr int64_t kPanel = 64;  // output columns per panel: 4 vectors

// Whether pack_panels packs ``w`` as pair panels (bf16 dot product) rather than fp32.
inline bool pair_panels_for(const at::Tensor& w) {
  return kHasBf16Dot && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0;
}

// Plain panels [ceil(N / 64)][K][64] in w's own dtype from w [N, K] (dst zeroed); bf16
// columns sit where vload_packed reads them (packed_pos, within each 16).
template <typename W>
void pack_plain_panels(const W* src, int64_t N, int64_t K, W* dst) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, P, 1, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p)
      for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
        const W* row = src + (p * kPanel + c) * K;
        const int64_t at = std::is_same_v<W, bf16> ? c / 16 * 16 + packed_pos(c % 16) : c;
        W* col = dst + p * K * kPanel + at;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
  });
}

// panels from w [N, K] (fp32 or bf16), zero-padded columns: pair panels [ceil(N / 64),
// K / 2, 64, 2] bf16 where pair_panels_for(w), else plain panels [ceil(N / 64), K, 64]
// in w's dtype (a bf16 weight stays bf16 and is widened as it is loaded: half the bytes).
at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pack_panels: needs an fp32 or bf16 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  if (pair_panels_for(w)) {
    const at::Tensor wc = w.contiguous();
    at::Tensor panels = at::empty({P, K / 2, kPanel, 2}, wc.options());
    const bf16* src = wc.data_ptr<bf16>();
    bf16* dst = panels.data_ptr<bf16>();
    at::parallel_for(0, P, 1, [&](int64_t pb, int64_t pe) {
      for (int64_t p = pb; p < pe; ++p) {
        bf16* panel = dst + p * K * kPanel;
        std::memset(static_cast<void*>(panel), 0, size_t(K * kPanel) * sizeof(bf16));
        for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
          const bf16* row = src + (p * kPanel + c) * K;
          for (int64_t k = 0; k < K; ++k) panel[((k / 2) * kPanel + c) * 2 + (k & 1)] = row[k];
        }
      }
    });
    return panels;
  }
  const at::Tensor wc = w.contiguous();
  at::Tensor panels = at::empty({P, K, kPanel}, wc.options());
  panels.zero_();
  if (w.scalar_type() == at::kFloat)
    pack_plain_panels(wc.data_ptr<float>(), N, K, panels.data_ptr<float>());
  else
    pack_plain_panels(wc.data_ptr<bf16>(), N, K, panels.data_ptr<bf16>());
  return panels;
}

inline void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }

// Cache lines of the next panel prefetched into L2 per k of the current one; -1: the
// tile's own rate (prefetch_lines_per_k). Set only by set_panel_prefetch, for the
// benchmark that measures the rates (benchmarks/panel_linear.py --prefetch).
inline std::atomic<int> g_panel_prefetch{-1};

int64_t set_panel_prefetch(int64_t lines) {
  TORCH_CHECK(lines >= -1 && lines <= 16, "set_panel_prefetch: lines must be in [-1, 16]");
  return g_panel_prefetch.exchange(int(lines));
}

// Rows [0, MR) of x (fp32, row stride xs) against one panel; writes ``cols`` columns of
// y (row stride ys), adding bias when given. Issues ``per_k`` prefetches of the next
// panel per k from ``pf`` up to ``pf_end``. Each output column sums over k in order, one
// multiply-add per k, on every ISA.
#if defined(__AVX512F__)
// The next panel (4 lines a k in fp32) spread over the row tiles that read this one.
inline int prefetch_lines_per_k(int64_t tiles) { return int((4 + tiles - 1) / tiles); }

template <int MR, typename T, typename W>
inline void panel_tile(const float* x, int64_t xs, const W* panel, int64_t K, const T* bias, T* y, int64_t ys,
                       int64_t cols, const char*& pf, const char* pf_end, int per_k) {
  V16 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = panel + k * kPanel;
    const V16 w0 = vload_packed(wk), w1 = vload_packed(wk + 16), w2 = vload_packed(wk + 32),
              w3 = vload_packed(wk + 48);
    for (int m = 0; m < MR; ++m) {
      const V16 xb = vset(x[m * xs + k]);
      acc[m][0] = vfma(xb, w0, acc[m][0]);
      acc[m][1] = vfma(xb, w1, acc[m][1]);
      acc[m][2] = vfma(xb, w2, acc[m][2]);
      acc[m][3] = vfma(xb, w3, acc[m][3]);
    }
    for (int i = 0; i < per_k && pf < pf_end; ++i, pf += 64) prefetch_l2(pf);
  }
  alignas(64) float out[kPanel];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) vstore(out + j * 16, acc[m][j]);
    for (int64_t c = 0; c < cols; ++c) store_f(y + m * ys + c, bias ? out[c] + to_f(bias[c]) : out[c]);
  }
}
#else
// With 16 vector registers (AVX2) the 6 x 64 tile above spills: a pass takes NV of the
// panel's 4 column vectors (V16 = 2 registers), so that MR x NV accumulators, a weight
// vector and the broadcast fit (1 row: all 64 columns, 2 rows: 32, more: 16 per pass).
// The passes after the first read the panel from L2.
//
// One line of the next panel a k, whatever the rows and dtype: each pass runs K k's, and
// faster prefetching competes with the stream the pass reads. A pass over SmolLM2-135M's
// 120 decoder weights on an AMD EPYC without AVX-512 (benchmarks/results/
// panel_linear_2026-12-06_{bfloat16,float32}_avx2.md, --prefetch 0,1,2,4): bf16 at 1 row
// 7.7 ms at one line a k, 10.0 at four (the AVX-512 tile's rate up to 6 rows), 8.4 with
// none; at 16 rows 27.3 against 30.5 at two; fp32 at 4 rows 18.6 against 28.9 at four.
inline int prefetch_lines_per_k(int64_t) { return 1; }

template <int MR, int NV, typename W>
inline void panel_pass(const float* x, int64_t xs, const W* panel, int64_t K, int v0, float* out,
                       const char*& pf, const char* pf_end, int per_k) {
  V16 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = panel + k * kPanel + v0 * 16;
    for (int m = 0; m < MR; ++m) {
      const V16 xb = vset(x[m * xs + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = vfma(xb, vload_packed(wk + j * 16), acc[m][j]);
    }
    for (int i = 0; i < per_k && pf < pf_end; ++i, pf += 64) prefetch_l2(pf);
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) vstore(out + m * kPanel + (v0 + j) * 16, acc[m][j]);
}

template <int MR, typename T, typename W>
inline void panel_tile(const float* x, int64_t xs, const W* panel, int64_t K, const T* bias, T* y, int64_t ys,
                       int64_t cols, const char*& pf, const char* pf_end, int per_k) {
  constexpr int NV = MR == 1 ? 4 : (MR == 2 ? 2 : 1);
  alignas(64) float out[MR * kPanel];
  for (int v0 = 0; v0 < 4; v0 += NV) panel_pass<MR, NV, W>(x, xs, panel, K, v0, out, pf, pf_end, per_k);
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = out[m * kPanel + c];
      store_f(y + m * ys + c, bias ? v + to_f(bias[c]) : v);
    }
}
#endif

template <typename T, typename W>
void panel_rows(const float* x, int64_t xs, int64_t rows, const W* panel, int64_t K, const T* bias, T* y,
                int64_t ys, int64_t cols, const char*& pf, const char* pf_end, int per_k) {
  switch (rows) {
    case 6: return panel_tile<6, T, W>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 5: return panel_tile<5, T, W>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 4: return panel_tile<4, T, W>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 3: return panel_tile<3, T, W>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 2: return panel_tile<2, T, W>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    default: return panel_tile<1, T, W>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
  }
}

// Panels [pb, pe) of y = x W^T (+ b) on plain panels: every row of x against each, in row
// tiles of at most 6 (as even as possible: 26 rows are 6 + 5 + 5 + 5 + 5), prefetching
// the next panel of the range into L2 meanwhile. One thread's share of linear_panels_impl.
template <typename T, typename W>
void plain_panels_range(const float* xp, int64_t xs, int64_t M, int64_t K, const W* wp, int64_t N, const T* bp,
                        T* yp, int64_t pb, int64_t pe) {
  const int64_t tiles = (M + 5) / 6;
  const int64_t base = M / tiles, extra = M % tiles;
  const int forced = g_panel_prefetch.load(std::memory_order_relaxed);
  const int per_k = forced >= 0 ? forced : prefetch_lines_per_k(tiles);
  for (int64_t p = pb; p < pe; ++p) {
    const W* panel = wp + p * K * kPanel;
    const char* pf = reinterpret_cast<const char*>(panel + K * kPanel);
    const char* pf_end = p + 1 < pe ? reinterpret_cast<const char*>(panel + 2 * K * kPanel) : pf;
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const T* bias = bp ? bp + p * kPanel : nullptr;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      panel_rows<T, W>(xp + m * xs, xs, rows, panel, K, bias, yp + m * N + p * kPanel, N, cols, pf, pf_end, per_k);
      m += rows;
    }
  }
}

// The items [begin, end) that thread ``tid`` of ``threads`` takes of n: contiguous runs,
// as at::parallel_for(0, n, ceil(n / threads)) splits them (so each thread streams one
// region of a linear layer's panels).
inline std::pair<int64_t, int64_t> thread_share(int64_t n, int64_t threads, int64_t tid) {
  const int64_t chunk = (n + threads - 1) / threads;
  const int64_t b = std::min(n, tid * chunk);
  return {b, std::min(n, b + chunk)};
}

template <typename T, typename W>
void linear_panels_impl(const float* xp, int64_t xs, int64_t M, int64_t K, const W* wp, int64_t N,
                        const T* bp, T* yp) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, P, (P + threads - 1) / threads, [&](int64_t pb, int64_t pe) {
    plain_panels_range<T, W>(xp, xs, M, K, wp, N, bp, yp, pb, pe);
  });
}

#if defined(__AVX512BF16__)
// Rows [0, MR) of bf16 x (row stride xs) against one pair panel of K2 = K / 2 k-pairs;
// writes ``cols`` columns of y (row stride ys), adding bias when given. No software
// prefetch: the panel is one sequential stream, which the hardware prefetcher follows.
template <int MR>
inline void pair_panel_tile(const bf16* x, int64_t xs, const bf16* panel, int64_t K2, const bf16* bias, bf16* y,
                            int64_t ys, int64_t cols) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const bf16* wk = panel + k * kPanel * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wk));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wk + 32));
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wk + 64));
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wk + 96));
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * xs + 2 * k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xb, w3);
    }
  }
  alignas(64) float out[kPanel];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 4; ++j) _mm512_store_ps(out + j * 16, acc[m][j]);
    for (int64_t c = 0; c < cols; ++c) store_f(y + m * ys + c, bias ? out[c] + to_f(bias[c]) : out[c]);
  }
}

// Pair panels [pb, pe) of y = x W^T (+ b): every row of x against each, in row tiles of
// at most 6, as even as possible. One thread's share of linear_pair_panels_impl.
void pair_panels_range(const bf16* xp, int64_t xs, int64_t M, int64_t K, const bf16* wp, int64_t N,
                       const bf16* bp, bf16* yp, int64_t pb, int64_t pe) {
  const int64_t K2 = K / 2;
  const int64_t tiles = (M + 5) / 6;
  const int64_t base = M / tiles, extra = M % tiles;
  for (int64_t p = pb; p < pe; ++p) {
    const bf16* panel = wp + p * K * kPanel;
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const bf16* bias = bp ? bp + p * kPanel : nullptr;
    for (int64_t t = 0, m = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      const bf16* xm = xp + m * xs;
      bf16* ym = yp + m * N + p * kPanel;
      switch (rows) {
        case 6: pair_panel_tile<6>(xm, xs, panel, K2, bias, ym, N, cols); break;
        case 5: pair_panel_tile<5>(xm, xs, panel, K2, bias, ym, N, cols); break;
        case 4: pair_panel_tile<4>(xm, xs, panel, K2, bias, ym, N, cols); break;
        case 3: pair_panel_tile<3>(xm, xs, panel, K2, bias, ym, N, cols); break;
        case 2: pair_panel_tile<2>(xm, xs, panel, K2, bias, ym, N, cols); break;
        default: pair_panel_tile<1>(xm, xs, panel, K2, bias, ym, N, cols);
      }
      m += rows;
    }
  }
}

void linear_pair_panels_impl(const bf16* xp, int64_t xs, int64_t M, int64_t K, const bf16* wp, int64_t N,
                             const bf16* bp, bf16* yp) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, P, (P + threads - 1) / threads, [&](int64_t pb, int64_t pe) {
    pair_panels_range(xp, xs, M, K, wp, N, bp, yp, pb, pe);
  });
}
#endif

// linear_panels on plain panels of weight type W, for x of either dtype.
template <typename W>
void plain_panels_for(const at::Tensor& x, const W* wp, int64_t M, int64_t K, int64_t n,
                      const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (x.scalar_type() == at::kFloat) {
    linear_panels_impl<float, W>(x.data_ptr<float>(), x.stride(0), M, K, wp, n,
                                 has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  } else {
    const at::Tensor xf = x.to(at::kFloat);  // widening is exact
    linear_panels_impl<bf16, W>(xf.data_ptr<float>(), xf.stride(0), M, K, wp, n,
                                has_bias ? bias->data_ptr<bf16>() : nullptr, y.data_ptr<bf16>());
  }
}

// y = x w^T (+ bias) with ``panels`` = pack_panels(w) for w [n, K]; x [M, K] with unit
// last stride, y [M, n] in x's dtype (bf16: the fp32 sums rounded once). Plain panels
// (fp32 or bf16) take fp32 or bf16 x; pair panels take bf16 x.
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_panels: x must be [M, K] with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_panels: x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1);
  const bool pairs = panels.scalar_type() == at::kBFloat16 && panels.dim() == 4;
  if (pairs) {
    TORCH_CHECK(kHasBf16Dot && x.scalar_type() == at::kBFloat16 && panels.dim() == 4 && panels.is_contiguous() &&
                    panels.size(1) * 2 == K && panels.size(2) == kPanel && panels.size(3) == 2 && n > 0 &&
                    (n + kPanel - 1) / kPanel == panels.size(0),
                "linear_panels: bf16 panels must be pack_panels of a bf16 [n, K] weight, with bf16 x");
  } else {
    TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() &&
                    (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16) &&
                    panels.size(2) == kPanel && panels.size(1) == K && n > 0 &&
                    (n + kPanel - 1) / kPanel == panels.size(0),
                "linear_panels: panels must be pack_panels of an [n, K] weight");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "linear_panels: bias must be contiguous [n] in x's dtype");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(__AVX512BF16__)
  if (pairs) {
    linear_pair_panels_impl(x.data_ptr<bf16>(), x.stride(0), M, K, panels.data_ptr<bf16>(), n,
                            has_bias ? bias->data_ptr<bf16>() : nullptr, y.data_ptr<bf16>());
    return y;
  }
#endif
  if (panels.scalar_type() == at::kFloat)
    plain_panels_for<float>(x, panels.data_ptr<float>(), M, K, n, bias, y);
  else
    plain_panels_for<bf16>(x, panels.data_ptr<bf16>(), M, K, n, bias, y);
  return y;
}

}  // namespace baton_kernels
