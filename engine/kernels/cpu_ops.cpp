// CPU kernels for the decode hot path, registered as torch.ops.baton_cpu.*.
//
// Built once per machine by engine/kernels/cpu.py (g++ -O3 -march=native -fopenmp
// -ffp-contract=off). Every op is an optional plug-in with a plain-torch twin that gives
// the same result: rms_norm and rotary replicate torch's rounding step by step (bit-exact);
// linear differs from torch only in fp32 summation order, and so does decode_attention,
// except that in bf16 it rounds the softmax numerators to bf16 for P.V (as flash
// attention and prefill_attention do).
//
// Vector code is written once against a 16-lane fp32 type, V16, which is one AVX-512
// register where the compiler targets AVX-512, two AVX2 registers where it targets AVX2
// and FMA, and a plain array elsewhere.

// The kernels live in csrc/*.h, one translation unit so the build stays one compile.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/linear.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/argmax.h"
#include "csrc/attention.h"
#include "csrc/decode_team.h"
#include "csrc/linear.h"
#include "csrc/panel_linear.h"
#include "csrc/pointwise.h"
#include "csrc/prefill_attention.h"
#include "csrc/vec16.h"

namespace baton_kernels {

// ---- one decoder layer for the decode rows of a step ----------------------------------

// Rows up to which the bf16 GEMV kernel beats oneDNN (engine/kernels/ops.py GEMV_MAX_ROWS).
constexpr int64_t kGemvMaxRows = 4;
// Rows up to which the panel-packed kernel runs (engine/kernels/ops.py PANEL_MAX_ROWS).
constexpr int64_t kPanelMaxRows = 64;

// y = x W^T (+ b) with a weight that torch.ops.mkldnn._reorder_linear_weight prepacked,
// through the dispatcher (the op lives in libtorch_cpu's mkldnn library).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x,
                                 packed,
                                 bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Route codes of decode_layer's ``routes`` (engine/kernels/ops.py ROUTE_CODES): one per
// row class, rows <= kGemvMaxRows, <= kPanelMaxRows, above.
enum Route : int64_t { kConstants = 0, kTorch = 1, kGemv = 2, kPanels = 3, kOnednn = 4 };

// The route ``routes`` names for M rows, kConstants when it names none.
int64_t route_for(at::IntArrayRef routes, int64_t M) {
  const size_t cls = M <= kGemvMaxRows ? 0 : (M <= kPanelMaxRows ? 1 : 2);
  return cls < routes.size() ? routes[cls] : kConstants;
}

// The kernel the Python path (engine.kernels.ops.linear) would run for M rows: the route
// measured for their row class (``routes``) where it serves them; otherwise the
// panel-packed kernel up to kPanelMaxRows when there are panels, else the bf16 GEMV up to
// kGemvMaxRows rows, else the prepacked weight when there is one (not for a single fp32
// row, where MKL's GEMV is at the bandwidth), else at::linear (kTorch).
int64_t linear_route(at::IntArrayRef routes, int64_t M, bool bf16, bool has_panels, bool has_packed) {
  switch (route_for(routes, M)) {
    case kTorch: return kTorch;
    case kGemv: if (bf16 && kHasBf16Dot) return kGemv; break;
    case kPanels: if (has_panels) return kPanels; break;
    case kOnednn: if (has_packed) return kOnednn; break;
    default: break;
  }
  if (has_panels && M <= kPanelMaxRows) return kPanels;
  if (bf16 && M <= kGemvMaxRows && kHasBf16Dot) return kGemv;
  if (has_packed && (bf16 || M > 1)) return kOnednn;
  return kTorch;
}

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// y = x W^T (+ b) on the kernel linear_route picks.
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& packed,
                        const std::optional<at::Tensor>& panels, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef routes = {}) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool has_packed = defined(packed) && packed->scalar_type() == x.scalar_type();
  switch (linear_route(routes, x.size(0), bf16, defined(panels), has_packed)) {
    case kGemv: return linear_bf16(x, w, bias);
    case kPanels: return linear_panels(x, *panels, w.size(0), bias);
    case kOnednn: return packed_linear(x, *packed, bias);
    default: return at::linear(x, w, bias);
  }
}

// A Llama-family decoder layer (pre-norm attention and SiLU MLP, residuals) over the M
// decode rows of a decode-only step, as the ops in csrc/ compose it, in one call: the
// per-op dispatch of the Python layer costs about as much as the attention itself, and the
// whole layer runs without the GIL. Weights are HF-packed: qkv_w [(H + 2 Hkv) D, C],
// o_w [C, H D], gate_up_w [2 I, C], down_w [C, I]; *_p are their oneDNN-prepacked copies
// (or None), *_pp their panel-packed copies (pack_panels, or None). Each linear layer is
// the one ``layer_linear`` picks for M rows under ``routes`` (empty: the constants);
// ``split`` is decode_attention's (0: per batch; > 0: fixed parts, deterministic mode).
at::Tensor decode_layer(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& kv_cache, int64_t layer,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& in_norm_w, const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_b,
                        const at::Tensor& o_w, const at::Tensor& post_norm_w, const at::Tensor& gate_up_w,
                        const at::Tensor& down_w, const std::optional<at::Tensor>& qkv_p,
                        const std::optional<at::Tensor>& o_p, const std::optional<at::Tensor>& gate_up_p,
                        const std::optional<at::Tensor>& down_p, const std::optional<at::Tensor>& qkv_pp,
                        const std::optional<at::Tensor>& o_pp, const std::optional<at::Tensor>& gate_up_pp,
                        const std::optional<at::Tensor>& down_pp, int64_t num_heads, double eps, double scale,
                        int64_t window, at::IntArrayRef routes, int64_t split) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layer: hidden must be contiguous [M, C]");
  const int64_t M = hidden.size(0);
  const int64_t Hkv = kv_cache.size(2), D = kv_cache.size(5), H = num_heads;
  TORCH_CHECK(qkv_w.size(0) == (H + 2 * Hkv) * D, "decode_layer: qkv_w rows != (heads + 2 kv_heads) * head_dim");
  const at::Tensor x = rms_norm(hidden, in_norm_w, eps);
  const at::Tensor qkv = layer_linear(x, qkv_w, qkv_p, qkv_pp, qkv_b, routes);
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({M, H, D});
  const at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({M, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({M, Hkv, D});
  auto [qr, kr] = rotary(q, k, cos, sin, positions);
  write_kv(kv_cache, layer, kr, v, slot_mapping);
  at::Tensor attn = at::empty({M, H, D}, hidden.options());
  decode_attention(attn, qr, kv_cache, layer, block_tables, context_lens, scale, window, split);
  const at::Tensor h1 = at::add(hidden, layer_linear(attn.view({M, H * D}), o_w, o_p, o_pp, std::nullopt, routes));
  const at::Tensor x2 = rms_norm(h1, post_norm_w, eps);
  const at::Tensor act = silu_and_mul(layer_linear(x2, gate_up_w, gate_up_p, gate_up_pp, std::nullopt, routes));
  return at::add(h1, layer_linear(act, down_w, down_p, down_pp, std::nullopt, routes));
}

// The optional entry ``i`` of a ``Tensor?[]`` argument.
std::optional<at::Tensor> entry(const c10::List<std::optional<at::Tensor>>& list, size_t i) {
  std::optional<at::Tensor> t = list.get(i);
  return t.has_value() && t->defined() ? t : std::nullopt;
}

// Whether ``panels`` are what pack_panels makes of an [n, K] weight for the team: pair
// panels for bf16, plain fp32 panels for fp32.
bool team_panels_ok(const std::optional<at::Tensor>& panels, at::ScalarType dtype, int64_t n, int64_t K) {
  if (!defined(panels) || !panels->is_contiguous() || panels->scalar_type() != dtype ||
      panels->size(0) != (n + kPanel - 1) / kPanel)
    return false;
  if (dtype == at::kBFloat16)
    return kHasBf16Dot && panels->dim() == 4 && panels->size(1) * 2 == K && panels->size(2) == kPanel &&
           panels->size(3) == 2;
  return panels->dim() == 3 && panels->size(1) == K && panels->size(2) == kPanel;
}

// decode_stack in one OpenMP team (csrc/decode_team.h) where every linear layer of every
// layer runs on its panels for these rows (as layer_linear would pick them), the dtype is
// bf16 with the bf16 dot product or fp32, and everything has the layout the kernels read;
// else nullopt, and the stack runs layer by layer.
std::optional<at::Tensor> decode_stack_team(
    const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList in_norm_w, at::TensorList qkv_w, const c10::List<std::optional<at::Tensor>>& qkv_b,
    at::TensorList o_w, at::TensorList post_norm_w, at::TensorList gate_up_w, at::TensorList down_w,
    const c10::List<std::optional<at::Tensor>>& qkv_p, const c10::List<std::optional<at::Tensor>>& o_p,
    const c10::List<std::optional<at::Tensor>>& gate_up_p, const c10::List<std::optional<at::Tensor>>& down_p,
    const c10::List<std::optional<at::Tensor>>& qkv_pp, const c10::List<std::optional<at::Tensor>>& o_pp,
    const c10::List<std::optional<at::Tensor>>& gate_up_pp, const c10::List<std::optional<at::Tensor>>& down_pp,
    int64_t num_heads, double eps, double scale, at::IntArrayRef windows, at::IntArrayRef routes, int64_t split) {
  const auto dtype = hidden.scalar_type();
  const bool is_bf16 = dtype == at::kBFloat16;
  if (!(is_bf16 ? kHasBf16Dot : dtype == at::kFloat) || omp_in_parallel() || hidden.dim() != 2 ||
      !hidden.is_contiguous() || hidden.size(0) < 1 || kv_cache.dim() != 6 || !kv_cache.is_contiguous() ||
      kv_cache.size(1) != 2 || kv_cache.scalar_type() != dtype || !cos.is_contiguous() || !sin.is_contiguous() ||
      cos.dim() != 2 || cos.sizes() != sin.sizes() || cos.scalar_type() != sin.scalar_type() ||
      !(cos.scalar_type() == at::kFloat || (is_bf16 && cos.scalar_type() == at::kBFloat16)))
    return std::nullopt;
  const int64_t M = hidden.size(0), C = hidden.size(1), L = int64_t(qkv_w.size());
  const int64_t Hkv = kv_cache.size(2), NB = kv_cache.size(3), bs = kv_cache.size(4), D = kv_cache.size(5);
  const int64_t H = num_heads, QKV = (H + 2 * Hkv) * D;
  if (L == 0 || H % Hkv != 0 || H / Hkv > 16 || D % 16 != 0 || D > 256 || cos.size(1) != D || split < 0)
    return std::nullopt;
  const int64_t I = gate_up_w[0].size(0) / 2;
  auto is_vec = [&](const at::Tensor& t, int64_t n) {
    return t.dim() == 1 && t.is_contiguous() && t.scalar_type() == dtype && t.size(0) == n;
  };
  for (int64_t l = 0; l < L; ++l) {
    const bool has[4] = {defined(entry(qkv_pp, l)), defined(entry(o_pp, l)), defined(entry(gate_up_pp, l)),
                         defined(entry(down_pp, l))};
    const std::optional<at::Tensor> packed[4] = {entry(qkv_p, l), entry(o_p, l), entry(gate_up_p, l),
                                                 entry(down_p, l)};
    for (int i = 0; i < 4; ++i)
      if (linear_route(routes, M, is_bf16, has[i], defined(packed[i]) && packed[i]->scalar_type() == dtype) != kPanels)
        return std::nullopt;
    const std::optional<at::Tensor> bias = entry(qkv_b, l);
    if (qkv_w[l].size(0) != QKV || qkv_w[l].size(1) != C || o_w[l].size(0) != C || o_w[l].size(1) != H * D ||
        gate_up_w[l].size(0) != 2 * I || gate_up_w[l].size(1) != C || down_w[l].size(0) != C ||
        down_w[l].size(1) != I || !is_vec(in_norm_w[l], C) || !is_vec(post_norm_w[l], C) ||
        (defined(bias) && !is_vec(*bias, QKV)) || windows[l] < 0 ||
        !team_panels_ok(entry(qkv_pp, l), dtype, QKV, C) || !team_panels_ok(entry(o_pp, l), dtype, C, H * D) ||
        !team_panels_ok(entry(gate_up_pp, l), dtype, 2 * I, C) || !team_panels_ok(entry(down_pp, l), dtype, C, I))
      return std::nullopt;
  }
  // What decode_layer's ops would refuse, refused the same way before the team starts.
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == M,
              "rotary: positions must be contiguous int64 [T]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == M,
              "write_kv: slot_mapping must be contiguous int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == M && context_lens.scalar_type() == at::kLong &&
                  context_lens.is_contiguous() && context_lens.numel() == M,
              "decode_attention: block_tables/context_lens must be contiguous int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "rotary: position ", pos[r], " outside the table");
    TORCH_CHECK(slots[r] >= 0 && slots[r] < NB * bs, "write_kv: slot ", slots[r], " out of range");
  }
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  check_decode_tables(tables, lens, M, width, bs, NB);
  const TeamShape shape{M, C, H, Hkv, D, I, eps, float(scale)};
  const int64_t per_kv = Hkv * NB * bs * D;
  at::Tensor out = at::empty({M, C}, hidden.options());
  const int64_t threads = at::get_num_threads();
  auto run = [&](auto tag_t, auto tag_cs) {
    using T = decltype(tag_t);
    using CS = decltype(tag_cs);
    std::vector<TeamLayer<T, T>> layers;
    for (int64_t l = 0; l < L; ++l) {
      const std::optional<at::Tensor> bias = entry(qkv_b, l);
      layers.push_back({in_norm_w[l].data_ptr<T>(), post_norm_w[l].data_ptr<T>(),
                        defined(bias) ? bias->data_ptr<T>() : nullptr, entry(qkv_pp, l)->data_ptr<T>(),
                        entry(o_pp, l)->data_ptr<T>(), entry(gate_up_pp, l)->data_ptr<T>(),
                        entry(down_pp, l)->data_ptr<T>(), windows[l]});
    }
    decode_team<T, T, CS>(hidden.data_ptr<T>(), out.data_ptr<T>(), layers, shape, pos, cos.data_ptr<CS>(),
                          sin.data_ptr<CS>(), kv_cache.data_ptr<T>(), per_kv, NB * bs, slots, tables, width, lens,
                          NB, bs, split, threads);
  };
  if (!is_bf16)
    run(float(), float());
  else if (cos.scalar_type() == at::kFloat)
    run(bf16(), float());
  else
    run(bf16(), bf16());
  return out;
}

// decode_stack's per-layer lists (each layer's arguments of decode_layer; windows[l] is
// layer l's window), checked once and kept as the kernels read them.
struct StackArgs {
  std::vector<at::Tensor> in_norm_w, qkv_w, o_w, post_norm_w, gate_up_w, down_w;
  c10::List<std::optional<at::Tensor>> qkv_b, qkv_p, o_p, gate_up_p, down_p, qkv_pp, o_pp, gate_up_pp, down_pp;
  int64_t num_heads;
  double eps, scale;
  std::vector<int64_t> windows, routes;
  int64_t split;
};

StackArgs stack_args(at::TensorList in_norm_w, at::TensorList qkv_w,
                     const c10::List<std::optional<at::Tensor>>& qkv_b, at::TensorList o_w,
                     at::TensorList post_norm_w, at::TensorList gate_up_w, at::TensorList down_w,
                     const c10::List<std::optional<at::Tensor>>& qkv_p,
                     const c10::List<std::optional<at::Tensor>>& o_p,
                     const c10::List<std::optional<at::Tensor>>& gate_up_p,
                     const c10::List<std::optional<at::Tensor>>& down_p,
                     const c10::List<std::optional<at::Tensor>>& qkv_pp,
                     const c10::List<std::optional<at::Tensor>>& o_pp,
                     const c10::List<std::optional<at::Tensor>>& gate_up_pp,
                     const c10::List<std::optional<at::Tensor>>& down_pp, int64_t num_heads, double eps,
                     double scale, at::IntArrayRef windows, at::IntArrayRef routes, int64_t split) {
  const size_t L = qkv_w.size();
  TORCH_CHECK(in_norm_w.size() == L && qkv_b.size() == L && o_w.size() == L && post_norm_w.size() == L &&
                  gate_up_w.size() == L && down_w.size() == L && qkv_p.size() == L && o_p.size() == L &&
                  gate_up_p.size() == L && down_p.size() == L && qkv_pp.size() == L && o_pp.size() == L &&
                  gate_up_pp.size() == L && down_pp.size() == L && windows.size() == L,
              "decode_stack: every per-layer list needs one entry per layer");
  return StackArgs{in_norm_w.vec(), qkv_w.vec(),     o_w.vec(),   post_norm_w.vec(), gate_up_w.vec(),
                   down_w.vec(),    qkv_b.copy(),    qkv_p.copy(), o_p.copy(),       gate_up_p.copy(),
                   down_p.copy(),   qkv_pp.copy(),   o_pp.copy(),  gate_up_pp.copy(), down_pp.copy(),
                   num_heads,       eps,             scale,        windows.vec(),     routes.vec(),
                   split};
}

// Every decoder layer of a decode-only step, layer l on KV layer l, in one call: at batch
// 1 the Python around thirty separate decode_layer calls cost a tenth of the forward.
at::Tensor decode_stack_with(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& kv_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                             const StackArgs& a) {
  const size_t L = a.qkv_w.size();
  TORCH_CHECK(int64_t(L) <= kv_cache.size(0), "decode_stack: ", L, " layers but a KV cache of ", kv_cache.size(0));
  if (std::optional<at::Tensor> out = decode_stack_team(
          hidden, positions, kv_cache, slot_mapping, block_tables, context_lens, cos, sin, a.in_norm_w, a.qkv_w,
          a.qkv_b, a.o_w, a.post_norm_w, a.gate_up_w, a.down_w, a.qkv_p, a.o_p, a.gate_up_p, a.down_p, a.qkv_pp,
          a.o_pp, a.gate_up_pp, a.down_pp, a.num_heads, a.eps, a.scale, a.windows, a.routes, a.split))
    return *out;
  at::Tensor h = hidden;
  for (size_t l = 0; l < L; ++l)
    h = decode_layer(h, positions, kv_cache, int64_t(l), slot_mapping, block_tables, context_lens, cos, sin,
                     a.in_norm_w[l], a.qkv_w[l], entry(a.qkv_b, l), a.o_w[l], a.post_norm_w[l], a.gate_up_w[l],
                     a.down_w[l], entry(a.qkv_p, l), entry(a.o_p, l), entry(a.gate_up_p, l), entry(a.down_p, l),
                     entry(a.qkv_pp, l), entry(a.o_pp, l), entry(a.gate_up_pp, l), entry(a.down_pp, l),
                     a.num_heads, a.eps, a.scale, a.windows[l], a.routes, a.split);
  return h;
}

at::Tensor decode_stack(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList in_norm_w, at::TensorList qkv_w,
                        const c10::List<std::optional<at::Tensor>>& qkv_b, at::TensorList o_w,
                        at::TensorList post_norm_w, at::TensorList gate_up_w, at::TensorList down_w,
                        const c10::List<std::optional<at::Tensor>>& qkv_p,
                        const c10::List<std::optional<at::Tensor>>& o_p,
                        const c10::List<std::optional<at::Tensor>>& gate_up_p,
                        const c10::List<std::optional<at::Tensor>>& down_p,
                        const c10::List<std::optional<at::Tensor>>& qkv_pp,
                        const c10::List<std::optional<at::Tensor>>& o_pp,
                        const c10::List<std::optional<at::Tensor>>& gate_up_pp,
                        const c10::List<std::optional<at::Tensor>>& down_pp, int64_t num_heads, double eps,
                        double scale, at::IntArrayRef windows, at::IntArrayRef routes, int64_t split) {
  return decode_stack_with(hidden, positions, kv_cache, slot_mapping, block_tables, context_lens, cos, sin,
                           stack_args(in_norm_w, qkv_w, qkv_b, o_w, post_norm_w, gate_up_w, down_w, qkv_p, o_p,
                                      gate_up_p, down_p, qkv_pp, o_pp, gate_up_pp, down_pp, num_heads, eps, scale,
                                      windows, routes, split));
}

// Passed through the dispatcher every step, decode_stack's 14 lists of 30 tensors took
// ~50 us more to convert than a handle (a batch-1 step of SmolLM2-135M is ~7 ms):
// decode_stack_prepare keeps them here under a handle, and decode_stack_run takes the
// handle and the step's own tensors.
inline std::mutex g_stacks_mutex;
inline std::unordered_map<int64_t, std::shared_ptr<const StackArgs>> g_stacks;
inline int64_t g_next_stack = 1;

int64_t decode_stack_prepare(at::TensorList in_norm_w, at::TensorList qkv_w,
                             const c10::List<std::optional<at::Tensor>>& qkv_b, at::TensorList o_w,
                             at::TensorList post_norm_w, at::TensorList gate_up_w, at::TensorList down_w,
                             const c10::List<std::optional<at::Tensor>>& qkv_p,
                             const c10::List<std::optional<at::Tensor>>& o_p,
                             const c10::List<std::optional<at::Tensor>>& gate_up_p,
                             const c10::List<std::optional<at::Tensor>>& down_p,
                             const c10::List<std::optional<at::Tensor>>& qkv_pp,
                             const c10::List<std::optional<at::Tensor>>& o_pp,
                             const c10::List<std::optional<at::Tensor>>& gate_up_pp,
                             const c10::List<std::optional<at::Tensor>>& down_pp, int64_t num_heads, double eps,
                             double scale, at::IntArrayRef windows, at::IntArrayRef routes, int64_t split) {
  auto args = std::make_shared<const StackArgs>(stack_args(in_norm_w, qkv_w, qkv_b, o_w, post_norm_w, gate_up_w,
                                                           down_w, qkv_p, o_p, gate_up_p, down_p, qkv_pp, o_pp,
                                                           gate_up_pp, down_pp, num_heads, eps, scale, windows,
                                                           routes, split));
  std::lock_guard<std::mutex> lock(g_stacks_mutex);
  const int64_t handle = g_next_stack++;
  g_stacks.emplace(handle, std::move(args));
  return handle;
}

void decode_stack_release(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_stacks_mutex);
  g_stacks.erase(handle);
}

// decode_stack over the lists decode_stack_prepare kept under ``handle``.
at::Tensor decode_stack_run(const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, const at::Tensor& cos, const at::Tensor& sin,
                            int64_t handle) {
  std::shared_ptr<const StackArgs> a;
  {
    std::lock_guard<std::mutex> lock(g_stacks_mutex);
    const auto it = g_stacks.find(handle);
    TORCH_CHECK(it != g_stacks.end(), "decode_stack_run: no prepared stack ", handle);
    a = it->second;
  }
  return decode_stack_with(hidden, positions, kv_cache, slot_mapping, block_tables, context_lens, cos, sin, *a);
}

}  // namespace baton_kernels

using namespace baton_kernels;

TORCH_LIBRARY(baton_cpu, m) {
  m.def("write_kv(Tensor(a!) kv_cache, int layer, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def(
      "decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, int layer, Tensor block_tables, "
      "Tensor context_lens, float scale, int window=0, int split=0) -> ()");
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, int layer, Tensor block_ids, int start, "
      "float scale, int window=0) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor positions) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("linear_panels(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def(
      "decode_layer(Tensor hidden, Tensor positions, Tensor(a!) kv_cache, int layer, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor cos, Tensor sin, Tensor in_norm_w, Tensor qkv_w, "
      "Tensor? qkv_b, Tensor o_w, Tensor post_norm_w, Tensor gate_up_w, Tensor down_w, Tensor? qkv_p, "
      "Tensor? o_p, Tensor? gate_up_p, Tensor? down_p, Tensor? qkv_pp, Tensor? o_pp, Tensor? gate_up_pp, "
      "Tensor? down_pp, int num_heads, float eps, float scale, int window=0, int[] routes=[], int split=0) -> "
      "Tensor");
  m.def(
      "decode_stack(Tensor hidden, Tensor positions, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor cos, Tensor sin, Tensor[] in_norm_w, Tensor[] qkv_w, "
      "Tensor?[] qkv_b, Tensor[] o_w, Tensor[] post_norm_w, Tensor[] gate_up_w, Tensor[] down_w, "
      "Tensor?[] qkv_p, Tensor?[] o_p, Tensor?[] gate_up_p, Tensor?[] down_p, Tensor?[] qkv_pp, "
      "Tensor?[] o_pp, Tensor?[] gate_up_pp, Tensor?[] down_pp, int num_heads, float eps, float scale, "
      "int[] windows, int[] routes=[], int split=0) -> Tensor");
  // Catch-all kernels: the prepacked weights among the lists are MkldnnCPU tensors.
  m.def(
      "decode_stack_prepare(Tensor[] in_norm_w, Tensor[] qkv_w, Tensor?[] qkv_b, Tensor[] o_w, "
      "Tensor[] post_norm_w, Tensor[] gate_up_w, Tensor[] down_w, Tensor?[] qkv_p, Tensor?[] o_p, "
      "Tensor?[] gate_up_p, Tensor?[] down_p, Tensor?[] qkv_pp, Tensor?[] o_pp, Tensor?[] gate_up_pp, "
      "Tensor?[] down_pp, int num_heads, float eps, float scale, int[] windows, int[] routes=[], "
      "int split=0) -> int",
      &decode_stack_prepare);
  m.def("decode_stack_release(int handle) -> ()", &decode_stack_release);
  m.def(
      "decode_stack_run(Tensor hidden, Tensor positions, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor context_lens, Tensor cos, Tensor sin, int handle) -> Tensor",
      &decode_stack_run);
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("set_panel_prefetch(int lines) -> int", &set_panel_prefetch);
  m.def("decode_team_runs() -> int", &decode_team_runs);
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton_cpu, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("pack_panels", &pack_panels);
  m.impl("linear_panels", &linear_panels);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_stack", &decode_stack);
  m.impl("argmax_rows", &argmax_rows);
}

// The prepacked weights decode_layer may take are MkldnnCPU tensors, which make the
// dispatcher look for that backend's kernel: it is the same function.
TORCH_LIBRARY_IMPL(baton_cpu, MkldnnCPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_stack", &decode_stack);
}
