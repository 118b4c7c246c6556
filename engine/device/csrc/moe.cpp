// A mixture-of-experts MLP on our quantized kernels in one call (engine/device/models/moe.py's
// Experts, for experts packed as q4/q8): route, group by expert, the two grouped matmuls
// (qmatmul_x86.cpp's q4/q8_grouped_linear, through the dispatcher), activate, weight and add back.
//
// The same steps as the torch ops of moe.py, without their ~20 dispatches and Python calls a layer
// (a third of the layer's time at 32 streams of a top-2-of-8 model, bench/moe_throughput.py):
//   router logits [T, E] = x @ router.T (+ bias)        at::linear
//   each token's top k, weighted as its family routes:   softmax then top k (renormalized or not),
//                                                        or top k then their softmax
//   the T * k (token, expert) pairs, stably by expert:   a counting sort
//   gate_up = grouped(x[tokens]) [T * k, 2 I]; act; down = grouped(act) [T * k, H]
//   out[token] += weight * down, pairs in sorted order (the order of moe.py's index_add_)
// Architecture-neutral: the ISA-specific part is the grouped matmul it calls.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

using Tensor = at::Tensor;
using Grouped = Tensor(const Tensor&, const Tensor&, int64_t, const Tensor&, const c10::optional<Tensor>&, double);

c10::TypedOperatorHandle<Grouped> grouped_op(int64_t kind) {
  static const auto q4 = c10::Dispatcher::singleton().findSchemaOrThrow("batchgate::q4_grouped_linear", "").typed<Grouped>();
  static const auto q8 = c10::Dispatcher::singleton().findSchemaOrThrow("batchgate::q8_grouped_linear", "").typed<Grouped>();
  return kind == 0 ? q4 : q8;
}

// Each token's k experts and their weights from its router logits (float32 [T, E]).
void route(const float* logits, int64_t tokens, int64_t experts, int64_t k, bool topk_softmax, bool normalize,
           int64_t* ids, float* weights) {
  std::vector<float> p(experts);
  std::vector<int64_t> order(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * experts;
    if (topk_softmax) {
      std::copy(l, l + experts, p.begin());
    } else {  // softmax over every expert first
      const float m = *std::max_element(l, l + experts);
      float sum = 0.f;
      for (int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(l[e] - m));
      for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    }
    std::iota(order.begin(), order.end(), 0);
    // The k largest, ties to the lower expert (as torch.topk's order among equal values is not
    // promised, any consistent choice will do).
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float* w = weights + t * k;
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      w[j] = p[order[j]];
    }
    if (topk_softmax) {  // the softmax of the top k logits
      const float m = w[0];
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(w[j] - m));
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    } else if (normalize) {
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += w[j];
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    }
  }
}

// x [T, H] float32 -> the layer's MLP output [T, H]. gate_up: packed [E, 2I / 8, H / 32, bytes] of
// each expert's gate rows then its up rows; down: [E, H / 8, I / 32, bytes]; kinds 0 q4, 1 q8.
// swiglu_limit > 0: gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), gate <= limit and
// |up| <= limit; else silu(gate) * up.
Tensor moe_experts(const Tensor& x, const Tensor& router, const c10::optional<Tensor>& router_bias, int64_t top_k,
                   bool topk_softmax, bool normalize, const Tensor& gate_up, int64_t gate_up_kind,
                   const c10::optional<Tensor>& gate_up_bias, const Tensor& down, int64_t down_kind,
                   const c10::optional<Tensor>& down_bias, double swiglu_limit, double swiglu_alpha,
                   double outlier_ratio) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_experts: x must be [T, H] float32");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_experts: top_k must be in 1..", experts);
  TORCH_CHECK(gate_up.dim() == 4 && gate_up.size(0) == experts && down.dim() == 4 && down.size(0) == experts,
              "moe_experts: packed experts must be [E, N / 8, K / 32, bytes]");
  const int64_t inner = down.size(2) * 32;  // I: down's input
  const int64_t rows = tokens * top_k;
  const Tensor xc = x.contiguous();
  const Tensor logits = at::linear(xc, router, router_bias).to(at::kFloat).contiguous();
  std::vector<int64_t> ids(rows);
  std::vector<float> weights(rows);
  route(logits.data_ptr<float>(), tokens, experts, top_k, topk_softmax, normalize, ids.data(), weights.data());
  // Group the pairs by expert (stable: by token within an expert).
  Tensor offsets = at::zeros({experts + 1}, at::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) ++off[ids[r] + 1];
  for (int64_t e = 0; e < experts; ++e) off[e + 1] += off[e];
  std::vector<int64_t> next(off, off + experts), token_of(rows);
  std::vector<float> weight_of(rows);
  Tensor xs = at::empty({rows, hidden}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at_row = next[ids[r]]++;
    token_of[at_row] = r / top_k;
    weight_of[at_row] = weights[r];
    std::memcpy(xsp + at_row * hidden, xp + (r / top_k) * hidden, hidden * sizeof(float));
  }
  const Tensor h = grouped_op(gate_up_kind).call(xs, gate_up, 2 * inner, offsets, gate_up_bias, outlier_ratio);
  Tensor gate = h.narrow(1, 0, inner).contiguous();
  const Tensor up = h.narrow(1, inner, inner);
  Tensor act;
  if (swiglu_limit > 0) {
    gate.clamp_max_(swiglu_limit);
    act = (up.clamp(-swiglu_limit, swiglu_limit) + 1).mul_(gate * at::sigmoid(gate * swiglu_alpha));
  } else {
    act = at::silu_(gate).mul_(up);
  }
  const Tensor y = grouped_op(down_kind).call(act, down, hidden, offsets, down_bias, outlier_ratio);
  Tensor out = at::zeros({tokens, hidden}, xc.options());
  float* op = out.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* o = op + token_of[r] * hidden;
    const float* yr = yp + r * hidden;
    const float w = weight_of[r];
#pragma omp simd
    for (int64_t c = 0; c < hidden; ++c) o[c] += yr[c] * w;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgate, m) {
  m.def(
      "moe_experts(Tensor x, Tensor router, Tensor? router_bias, int top_k, bool topk_softmax, bool normalize, "
      "Tensor gate_up, int gate_up_kind, Tensor? gate_up_bias, Tensor down, int down_kind, Tensor? down_bias, "
      "float swiglu_limit, float swiglu_alpha, float outlier_ratio) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgate, CPU, m) { m.impl("moe_experts", &moe_experts); }
