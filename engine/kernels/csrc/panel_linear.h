// Decode-sized linear layers (a few to a few dozen rows) on panel-packed fp32 weights.
//
// oneDNN's prepacked matmul reaches ~100 GFLOP/s on the 26-row batches of a W1 decode
// step when the weights come from DRAM (each layer's are read once a step): neither the
// bandwidth nor the FMA units are busy. Here the weight [N, K] is packed as panels of 64
// output columns, [ceil(N / 64)][K][64] fp32, so one panel is a single contiguous stream,
// and the kernel runs every row of x against a panel while it sits in L2, with 6 rows x
// 64 columns of accumulators in registers (24 FMAs per 10 loads), prefetching the next
// panel into L2 meanwhile. bf16 weights are widened into the panels (exact), so bf16
// layers get the fp32 FMA rate, which on CPUs without AMX is above the bf16 one.
#pragma once

#include "vec16.h"

namespace baton_kernels {

constexpr int64_t kPanel = 64;  // output columns per panel: 4 vectors

// panels: [ceil(N / 64), K, 64] fp32 from w [N, K] (fp32 or bf16), zero-padded columns.
at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pack_panels: needs an fp32 or bf16 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  const at::Tensor wf = w.to(at::kFloat).contiguous();
  at::Tensor panels = at::empty({P, K, kPanel}, wf.options());
  panels.zero_();
  const float* src = wf.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p)
      for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
        const float* row = src + (p * kPanel + c) * K;
        float* col = dst + p * K * kPanel + c;
        for (int64_t k = 0; k < K; ++k) col[k * kPanel] = row[k];
      }
  });
  return panels;
}

inline void prefetch_l2(const char* p) {
#if defined(__AVX512F__)
  _mm_prefetch(p, _MM_HINT_T1);
#else
  (void)p;
#endif
}

// Rows [0, MR) of x (fp32, row stride xs) against one panel; writes ``cols`` columns of
// y (row stride ys), adding bias when given. Issues ``per_k`` prefetches of the next
// panel per k from ``pf`` up to ``pf_end``.
template <int MR, typename T>
inline void panel_tile(const float* x, int64_t xs, const float* panel, int64_t K, const T* bias, T* y, int64_t ys,
                       int64_t cols, const char*& pf, const char* pf_end, int per_k) {
  V16 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * kPanel;
    const V16 w0 = vload(wk), w1 = vload(wk + 16), w2 = vload(wk + 32), w3 = vload(wk + 48);
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

template <typename T>
void panel_rows(const float* x, int64_t xs, int64_t rows, const float* panel, int64_t K, const T* bias, T* y,
                int64_t ys, int64_t cols, const char*& pf, const char* pf_end, int per_k) {
  switch (rows) {
    case 6: return panel_tile<6>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 5: return panel_tile<5>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 4: return panel_tile<4>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 3: return panel_tile<3>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    case 2: return panel_tile<2>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
    default: return panel_tile<1>(x, xs, panel, K, bias, y, ys, cols, pf, pf_end, per_k);
  }
}

template <typename T>
void linear_panels_impl(const float* xp, int64_t xs, int64_t M, int64_t K, const float* wp, int64_t N,
                        const T* bp, T* yp) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  // Row tiles of at most 6, as even as possible (26 rows: 6 + 5 + 5 + 5 + 5).
  const int64_t tiles = (M + 5) / 6;
  const int64_t base = M / tiles, extra = M % tiles;
  // The next panel is K lines of 4 cache lines each: spread its prefetch over the tiles.
  const int per_k = int((4 + tiles - 1) / tiles);
  const int64_t threads = at::get_num_threads();
  // Contiguous runs of panels per thread: each streams one region of memory.
  at::parallel_for(0, P, (P + threads - 1) / threads, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      const float* panel = wp + p * K * kPanel;
      const char* pf = reinterpret_cast<const char*>(panel + K * kPanel);
      const char* pf_end = p + 1 < pe ? reinterpret_cast<const char*>(panel + 2 * K * kPanel) : pf;
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      const T* bias = bp ? bp + p * kPanel : nullptr;
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t rows = base + (t < extra ? 1 : 0);
        panel_rows<T>(xp + m * xs, xs, rows, panel, K, bias, yp + m * N + p * kPanel, N, cols, pf, pf_end, per_k);
        m += rows;
      }
    }
  });
}

// y = x w^T (+ bias) with ``panels`` = pack_panels(w) for w [n, K]; x [M, K] fp32 or bf16
// with unit last stride, y [M, n] in x's dtype (bf16: the fp32 sums rounded once).
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_panels: x must be [M, K] with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_panels: x must be fp32 or bf16");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat &&
                  panels.size(2) == kPanel && panels.size(1) == x.size(1) && n > 0 &&
                  (n + kPanel - 1) / kPanel == panels.size(0),
              "linear_panels: panels must be pack_panels of an [n, K] weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "linear_panels: bias must be contiguous [n] in x's dtype");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* wp = panels.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    linear_panels_impl<float>(x.data_ptr<float>(), x.stride(0), M, K, wp, n,
                              has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  } else {
    const at::Tensor xf = x.to(at::kFloat);  // widening is exact
    linear_panels_impl<bf16>(xf.data_ptr<float>(), xf.stride(0), M, K, wp, n,
                             has_bias ? bias->data_ptr<bf16>() : nullptr, y.data_ptr<bf16>());
  }
  return y;
}

}  // namespace baton_kernels
