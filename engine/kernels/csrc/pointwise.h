// Row-wise ops replicating torch's rounding: RMSNorm, rotary embedding, SiLU-and-mul.
#pragma once

#include "vec16.h"

namespace baton_kernels {

// ---- RMSNorm -----------------------------------------------------------------------------

// HF/torch order: y = x.float() * rsqrt(mean(x.float()^2) + eps); out = weight * y.to(T).
template <typename T>
inline void rms_norm_row(T* orow, const T* xr, const T* wp, int64_t C, double eps) {
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
  for (c = 0; c + 16 <= C; c += 16) vstore_t(orow + c, vmul(vload(wp + c), vround_to<T>(vmul(vload(xr + c), iv))));
  for (; c < C; ++c) {
    const float y = round_to<T>(to_f(xr[c]) * inv);
    store_f(orow + c, to_f(wp[c]) * y);
  }
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t N = x.size(0), C = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / std::max<int64_t>(C, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row<T>(op + r * C, xp + r * xs, wp, C, eps);
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
inline void silu_and_mul_row(T* o, const T* g, int64_t I) {
  const T* u = g + I;
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

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t M = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_and_mul_row<T>(op + r * I, xp + r * xs, I);
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

}  // namespace baton_kernels
