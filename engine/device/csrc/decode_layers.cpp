// A step that only decodes, through every layer of a Llama-family model in one call, on our
// quantized weights (engine/device/model.py's forward for such a step, engine/device/quant.py's packing).
//
// The same ops as the Python loop, in the same order and through the same dispatcher entries, so
// the result is bit for bit the same; what goes is the Python between them (~20 calls a layer),
// which at one or a few sequences is a third of a step. Architecture-neutral: the ISA-specific
// parts are the ops it calls.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

using Tensor = at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Per layer, in `weights`: input norm, qkv, o, post-attention norm, gate_up, down.
constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kLinearsPerLayer = 4;

// Returns (hidden, residual) after the last layer; the caller applies the final norm and the head.
// kinds: per linear, 0 for q4 and 1 for q8 weights; ns: per linear, its output size; windows: per
// layer, its sliding window (0: the whole context).
// LoRA (engine/lora.py's LoraStack, engine/step.py's LoraDecodePlan), where lora_slots is given
// (else the lists are empty):
// per linear, its stack's A, B and chunk owners (an empty A: no adapter targets it); rows
// lora_lo .. lora_lo + len(lora_slots) - 1 add their slot's delta after the base matmul, through
// the same lora_decode_ op as the Python loop.
std::tuple<Tensor, Tensor> decode_layers(const Tensor& hidden, at::TensorList weights, at::IntArrayRef kinds,
                                         at::IntArrayRef ns, at::TensorList k_caches, at::TensorList v_caches,
                                         const Tensor& positions, const Tensor& slot_mapping,
                                         const Tensor& block_tables, const Tensor& context_lens, const Tensor& cos,
                                         const Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, double scale, double eps, double outlier_ratio,
                                         at::IntArrayRef windows, at::TensorList lora_a, at::TensorList lora_b,
                                         at::TensorList lora_owner, const c10::optional<Tensor>& lora_slots,
                                         int64_t lora_lo) {
  using Linear = Tensor(const Tensor&, const Tensor&, int64_t, const c10::optional<Tensor>&, double);
  static const auto q4 = find_op<Linear>("batchgate::q4_linear");
  static const auto q8 = find_op<Linear>("batchgate::q8_linear");
  static const auto rms_norm = find_op<Tensor(const Tensor&, const Tensor&, double)>("batchgate::rms_norm");
  static const auto add_rms_norm =
      find_op<Tensor(const Tensor&, Tensor, const Tensor&, double)>("batchgate::add_rms_norm");
  static const auto rope =
      find_op<void(Tensor, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>("batchgate::rope_");
  static const auto write_kv =
      find_op<void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&)>("batchgate::write_kv_");
  static const auto attention = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                               const Tensor&, double, int64_t, const c10::optional<Tensor>&)>(
      "batchgate::paged_decode_attention");
  static const auto lora_decode =
      find_op<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t)>(
          "batchgate::lora_decode_");

  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer &&
                  static_cast<int64_t>(kinds.size()) == layers * kLinearsPerLayer && kinds.size() == ns.size() &&
                  v_caches.size() == k_caches.size() && static_cast<int64_t>(windows.size()) == layers,
              "decode_layers: ", layers, " layers need ", kWeightsPerLayer, " weights and ", kLinearsPerLayer,
              " linears each");
  TORCH_CHECK(!lora_slots.has_value() || (static_cast<int64_t>(lora_a.size()) == layers * kLinearsPerLayer &&
                                            lora_b.size() == lora_a.size() && lora_owner.size() == lora_a.size()),
              "decode_layers: LoRA needs A, B and owners for each of the ", layers * kLinearsPerLayer, " linears");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "decode_layers: hidden must be [T, H] float32");
  const c10::optional<Tensor> no_bias, no_sinks;
  auto linear = [&](const Tensor& x, int64_t layer, int64_t which) {
    const int64_t j = layer * kLinearsPerLayer + which;
    const Tensor& w = weights[layer * kWeightsPerLayer + (which < 2 ? 1 + which : 2 + which)];
    Tensor y = (kinds[j] == 0 ? q4 : q8).call(x, w, ns[j], no_bias, outlier_ratio);
    if (lora_slots.has_value() && lora_a[j].numel() > 0)
      lora_decode.call(y, x.contiguous(), lora_a[j], lora_b[j], *lora_slots, lora_owner[j], lora_lo);
    return y;
  };
  const int64_t tokens = hidden.size(0);
  Tensor residual = hidden;
  Tensor out = hidden;
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = weights.data() + i * kWeightsPerLayer;
    Tensor x = i == 0 ? rms_norm.call(out, w[0], eps) : add_rms_norm.call(out, residual, w[0], eps);
    Tensor qkv = linear(x, i, 0);
    rope.call(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
    const Tensor heads = qkv.view({tokens, num_heads + 2 * num_kv_heads, head_dim});
    const Tensor& k_cache = k_caches[i];
    const Tensor& v_cache = v_caches[i];
    write_kv.call(k_cache, v_cache, heads.narrow(1, num_heads, num_kv_heads),
                  heads.narrow(1, num_heads + num_kv_heads, num_kv_heads), slot_mapping);
    const Tensor attn = attention.call(heads.narrow(1, 0, num_heads), k_cache, v_cache, block_tables, context_lens,
                                       scale, windows[i], no_sinks);
    const Tensor o = linear(attn.view({tokens, num_heads * head_dim}), i, 1);
    x = add_rms_norm.call(o, residual, w[3], eps);
    const Tensor gate_up = linear(x, i, 2);
    const int64_t inner = gate_up.size(1) / 2;
    out = linear(at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner)), i, 3);
  }
  return {out, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgate, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, int[] kinds, int[] ns, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
      "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, float scale, float eps, "
      "float outlier_ratio, int[] windows, Tensor[] lora_a, Tensor[] lora_b, Tensor[] lora_owner, "
      "Tensor? lora_slots, int lora_lo) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(batchgate, CPU, m) { m.impl("decode_layers", &decode_layers); }
