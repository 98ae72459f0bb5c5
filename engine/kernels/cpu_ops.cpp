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

#include <string>

#include "csrc/attention.h"
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

// The linear layer the Python path (engine.kernels.ops.linear) would run for these rows:
// the route measured for their row class (``routes``) where it serves them; otherwise
// the bf16 GEMV up to kGemvMaxRows rows, then the panel-packed kernel up to kPanelMaxRows
// when there are panels, else the prepacked weight when there is one (not for a single
// fp32 row, where MKL's GEMV is at the bandwidth), else at::linear.
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& packed,
                        const std::optional<at::Tensor>& panels, const std::optional<at::Tensor>& bias,
                        at::IntArrayRef routes = {}) {
  const int64_t M = x.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool has_panels = panels.has_value() && panels->defined();
  const bool has_packed = packed.has_value() && packed->defined() && packed->scalar_type() == x.scalar_type();
  switch (route_for(routes, M)) {
    case kTorch: return at::linear(x, w, bias);
    case kGemv: if (bf16 && kHasBf16Dot) return linear_bf16(x, w, bias); break;
    case kPanels: if (has_panels) return linear_panels(x, *panels, w.size(0), bias); break;
    case kOnednn: if (has_packed) return packed_linear(x, *packed, bias); break;
    default: break;
  }
  if (bf16 && M <= kGemvMaxRows && kHasBf16Dot) return linear_bf16(x, w, bias);
  if (panels.has_value() && panels->defined() && M <= kPanelMaxRows) return linear_panels(x, *panels, w.size(0), bias);
  if (packed.has_value() && packed->defined() && packed->scalar_type() == x.scalar_type() && (bf16 || M > 1))
    return packed_linear(x, *packed, bias);
  return at::linear(x, w, bias);
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

// Every decoder layer of a decode-only step, layer l on KV layer l, in one call: at batch
// 1 the Python around thirty separate decode_layer calls cost a tenth of the forward.
// The lists hold each layer's arguments of decode_layer; windows[l] is layer l's window.
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
  const size_t L = qkv_w.size();
  TORCH_CHECK(in_norm_w.size() == L && qkv_b.size() == L && o_w.size() == L && post_norm_w.size() == L &&
                  gate_up_w.size() == L && down_w.size() == L && qkv_p.size() == L && o_p.size() == L &&
                  gate_up_p.size() == L && down_p.size() == L && qkv_pp.size() == L && o_pp.size() == L &&
                  gate_up_pp.size() == L && down_pp.size() == L && windows.size() == L,
              "decode_stack: every per-layer list needs one entry per layer");
  TORCH_CHECK(int64_t(L) <= kv_cache.size(0), "decode_stack: ", L, " layers but a KV cache of ", kv_cache.size(0));
  at::Tensor h = hidden;
  for (size_t l = 0; l < L; ++l)
    h = decode_layer(h, positions, kv_cache, int64_t(l), slot_mapping, block_tables, context_lens, cos, sin,
                     in_norm_w[l], qkv_w[l], entry(qkv_b, l), o_w[l], post_norm_w[l], gate_up_w[l], down_w[l],
                     entry(qkv_p, l), entry(o_p, l), entry(gate_up_p, l), entry(down_p, l), entry(qkv_pp, l),
                     entry(o_pp, l), entry(gate_up_pp, l), entry(down_pp, l), num_heads, eps, scale, windows[l],
                     routes, split);
  return h;
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
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("set_panel_prefetch(int lines) -> int", &set_panel_prefetch);
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
}

// The prepacked weights decode_layer may take are MkldnnCPU tensors, which make the
// dispatcher look for that backend's kernel: it is the same function.
TORCH_LIBRARY_IMPL(baton_cpu, MkldnnCPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_stack", &decode_stack);
}
