// Small-batch bf16 linear layers on the AVX512-BF16 dot product.
#pragma once

#include "vec16.h"

namespace baton_kernels {

// ---- small-batch bf16 linear -------------------------------------------------------------

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for MB rows of x and R = 16 / MB rows of w
// at a time: 16 accumulators, summed in one transpose-and-add tree. The R rows of w are
// read whole, one after another: the tile is then one sequential stream that the hardware
// prefetcher follows, where stepping all R rows along k together made R short strided
// streams (batch-1 layers read 1.2-1.45x slower that way; software prefetch only hurt).
template <int MB>
inline void gemv_tile(const bf16* x, int64_t xs, const bf16* w, int64_t K, const bf16* bias, bf16* y,
                      int64_t ys, int64_t n0, int64_t n1) {
  constexpr int R = MB == 3 ? 4 : 16 / MB;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    V16 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = vzero();  // MB == 3 leaves four unused
    for (int r = 0; r < R; ++r) {
      const bf16* wr = w + (n + r) * K;
      __m512 a[MB];
      for (int m = 0; m < MB; ++m) a[m] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wr + k));
        for (int m = 0; m < MB; ++m)
          a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + m * xs + k)), wv);
      }
      for (int m = 0; m < MB; ++m) acc[m * R + r].v = a[m];
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

}  // namespace baton_kernels
