// Greedy sampling's argmax over each row of fp32 or bf16 logits, as torch.argmax(dim=-1)
// gives it. bf16 rows are widened as they are read (exactly), so a greedy step of a bf16
// model needs no fp32 copy of its logits.
//
// torch's CPU argmax reduces one element at a time: ~42 us over SmolLM2's 49,152-entry
// vocabulary, per row, every step. Here a vector pass finds the row's maximum and a
// scalar pass its first index (~10 us). torch's answer is the first index of the
// maximum, and the first NaN's where the row has one; a row with a NaN or an infinity
// (masked logits are -inf) takes an exact scalar pass that keeps those rules.
#pragma once

#include <cmath>

#include "vec16.h"

namespace baton_kernels {

// The exact pass: the first NaN, else the first index of the largest value.
template <typename T>
inline int64_t argmax_row_exact(const T* x, int64_t V) {
  float best = to_f(x[0]);
  int64_t at = 0;
  if (std::isnan(best)) return 0;
  for (int64_t i = 1; i < V; ++i) {
    const float v = to_f(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return at;
}

template <typename T>
inline int64_t argmax_row(const T* x, int64_t V) {
  V16 mx = vset(-INFINITY), probe = vzero();
  const V16 zero = vzero();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const V16 v = vload(x + i);
    mx = vmax(v, mx);
    probe = vadd(probe, vmul(v, zero));  // NaN once any value is NaN or infinite
  }
  float m = vhmax(mx);
  float tail = 0.f;
  for (; i < V; ++i) {
    const float v = to_f(x[i]);
    m = std::max(m, v);
    tail += v * 0.f;
  }
  if (std::isnan(vsum(probe) + tail)) return argmax_row_exact(x, V);
  for (int64_t j = 0; j < V; ++j)
    if (to_f(x[j]) == m) return j;
  return argmax_row_exact(x, V);  // not reached: m is one of the row's values
}

template <typename T>
void argmax_rows_of(const at::Tensor& x, at::Tensor& out) {
  const int64_t S = x.size(0), V = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, S, std::max<int64_t>(1, 32768 / V), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * xs, V);
  });
}

// x: [S, V] fp32 or bf16 with unit last stride; returns [S] int64, torch.argmax(x, dim=-1).
at::Tensor argmax_rows(const at::Tensor& x) {
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf || x.scalar_type() == at::kFloat) && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be fp32 or bf16 [S, V] with V > 0 and unit last stride");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (bf)
    argmax_rows_of<bf16>(x, out);
  else
    argmax_rows_of<float>(x, out);
  return out;
}

}  // namespace baton_kernels
