// Every decoder layer of a small decode step in one OpenMP region.
//
// decode_layer composes ops that each open their own parallel region and allocate their
// own outputs: a dozen regions a layer, with the norms, the rotary, the KV write and the
// residual adds run by one thread while the others wait. At batch 1 on SmolLM2-135M the
// weight reads leave the stack ~20% of its time in that serial work (the OpenMP worker
// idle a third of the step). Here one team runs the whole stack: each linear layer's
// panels split between the threads as linear_panels splits them, the attention's work
// items and merges split, the row-wise ops split by rows, with a barrier between phases
// and every buffer allocated once. Each phase runs the same kernels on the same values
// as decode_layer, so the result is decode_stack's bit for bit.
#pragma once

#include <omp.h>

#include <atomic>

#include "attention.h"
#include "panel_linear.h"
#include "pointwise.h"

namespace baton_kernels {

// One layer as the team reads it: panels (pair panels for bf16 with the bf16 dot
// product, else plain fp32 panels for fp32) of qkv, o, gate_up and down.
template <typename T, typename W>
struct TeamLayer {
  const T* in_norm;
  const T* post_norm;
  const T* qkv_b;  // nullptr: no bias
  const W* qkv;
  const W* o;
  const W* gate_up;
  const W* down;
  int64_t window;
};

// The shapes and per-step inputs of a team stack.
struct TeamShape {
  int64_t M, C, H, Hkv, D, I;
  double eps;
  float scale;
};

// How many stacks a team has run in this process: tests tell by it which path ran.
inline std::atomic<int64_t> g_decode_team_runs{0};

int64_t decode_team_runs() { return g_decode_team_runs.load(); }

// Thread tid's panels of y [M, N] = x [M, K] W^T (+ b).
template <typename T, typename W>
inline void team_linear(const T* x, int64_t M, int64_t K, const W* w, int64_t N, const T* b, T* y, int64_t nt,
                        int64_t tid) {
  const auto [pb, pe] = thread_share((N + kPanel - 1) / kPanel, nt, tid);
  if (pb >= pe) return;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<W, bf16>) {
    pair_panels_range(x, K, M, K, w, N, b, y, pb, pe);
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) plain_panels_range<float, W>(x, K, M, K, w, N, b, y, pb, pe);
}

// a + b rounded to T, as at::add rounds it.
template <typename T>
inline void add_row(T* out, const T* a, const T* b, int64_t C) {
  for (int64_t c = 0; c < C; ++c) store_f(out + c, to_f(a[c]) + to_f(b[c]));
}

// The stack over M decode rows: hidden [M, C] in, out [M, C] the last layer's output.
// kv: the cache's base, per_kv elements in one layer's K (or V), slots_per_head its slots;
// cos/sin [P, D] of type CS; the caller checked positions, slots and block tables.
template <typename T, typename W, typename CS>
void decode_team(const T* hidden, T* out, const std::vector<TeamLayer<T, W>>& layers, const TeamShape& s,
                 const int64_t* positions, const CS* cos, const CS* sin, T* kv, int64_t per_kv,
                 int64_t slots_per_head, const int64_t* slots, const int64_t* tables, int64_t width,
                 const int64_t* lens, int64_t NB, int64_t bs, int64_t split, int64_t threads) {
  const int64_t M = s.M, C = s.C, H = s.H, Hkv = s.Hkv, D = s.D, I = s.I;
  const int64_t QKV = (H + 2 * Hkv) * D, G = H / Hkv;
  const DecodePlan plan = decode_plan(M, Hkv, lens, bs, threads, split);
  // One allocation for every activation: x, hs, h1, x2, oo, dn [M, C]; qkv; q, attn
  // [M, H, D]; k [M, Hkv, D]; gu [M, 2I]; act [M, I].
  std::vector<T> buf(size_t(M * (6 * C + QKV + 2 * H * D + Hkv * D + 3 * I)));
  T* x = buf.data();
  T* hs = x + M * C;
  T* h1 = hs + M * C;
  T* x2 = h1 + M * C;
  T* oo = x2 + M * C;
  T* dn = oo + M * C;
  T* qkv = dn + M * C;
  T* qr = qkv + M * QKV;
  T* at = qr + M * H * D;
  T* kr = at + M * H * D;
  T* gu = kr + M * Hkv * D;
  T* act = gu + M * 2 * I;
  std::vector<float> part_acc(plan.merge ? size_t(plan.items * G * D) : 0);
  std::vector<float> part_ml(plan.merge ? size_t(plan.items * G * 2) : 0);
  g_decode_team_runs.fetch_add(1);
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const auto [rb, re] = thread_share(M, nt, tid);
    const auto [ib, ie] = thread_share(plan.items, nt, tid);
    const auto [pb, pe] = thread_share(plan.pairs, nt, tid);
    for (size_t l = 0; l < layers.size(); ++l) {
      const TeamLayer<T, W>& w = layers[l];
      const T* in = l == 0 ? hidden : hs;
      // the residual of the layer before (its output), then this layer's input norm
      for (int64_t r = rb; r < re; ++r) {
        if (l > 0) add_row(hs + r * C, h1 + r * C, dn + r * C, C);
        rms_norm_row<T>(x + r * C, in + r * C, w.in_norm, C, s.eps);
      }
#pragma omp barrier
      team_linear<T, W>(x, M, C, w.qkv, QKV, w.qkv_b, qkv, nt, tid);
#pragma omp barrier
      for (int64_t r = rb; r < re; ++r) {
        const CS* cr = cos + positions[r] * D;
        const CS* sr = sin + positions[r] * D;
        const T* row = qkv + r * QKV;
        rope_rows<T, CS>(qr + r * H * D, row, H, D, D, cr, sr);
        rope_rows<T, CS>(kr + r * Hkv * D, row + H * D, Hkv, D, D, cr, sr);
        T* kc = kv + int64_t(l) * 2 * per_kv;
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t dst = (h * slots_per_head + slots[r]) * D;
          std::memcpy(static_cast<void*>(kc + dst), kr + (r * Hkv + h) * D, size_t(D) * sizeof(T));
          std::memcpy(static_cast<void*>(kc + per_kv + dst), row + (H + Hkv + h) * D, size_t(D) * sizeof(T));
        }
      }
#pragma omp barrier
      {
        const T* kc = kv + int64_t(l) * 2 * per_kv;
        const DecodeArgs<T> args{qr,     H * D, D,    at,  H * D, D,      kc,      kc + per_kv, Hkv,
                                 NB,     bs,    G,    D,   width, tables, lens,    s.scale,     w.window};
        decode_items<T>(args, plan, part_acc.data(), part_ml.data(), ib, ie);
        if (plan.merge) {
#pragma omp barrier
          decode_merge<T>(args, plan, part_acc.data(), part_ml.data(), pb, pe);
        }
      }
#pragma omp barrier
      team_linear<T, W>(at, M, H * D, w.o, C, nullptr, oo, nt, tid);
#pragma omp barrier
      for (int64_t r = rb; r < re; ++r) {
        add_row(h1 + r * C, in + r * C, oo + r * C, C);
        rms_norm_row<T>(x2 + r * C, h1 + r * C, w.post_norm, C, s.eps);
      }
#pragma omp barrier
      team_linear<T, W>(x2, M, C, w.gate_up, 2 * I, nullptr, gu, nt, tid);
#pragma omp barrier
      for (int64_t r = rb; r < re; ++r) silu_and_mul_row<T>(act + r * I, gu + r * 2 * I, I);
#pragma omp barrier
      team_linear<T, W>(act, M, I, w.down, C, nullptr, dn, nt, tid);
#pragma omp barrier
    }
    for (int64_t r = rb; r < re; ++r) add_row(out + r * C, h1 + r * C, dn + r * C, C);
  }
}

}  // namespace baton_kernels
