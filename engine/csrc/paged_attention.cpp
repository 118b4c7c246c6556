// Decode attention straight from the paged KV cache, for the CPU.
//
// One query token per sequence attends to its whole context, read block by block through its
// block table: no gathered copy of K/V (the torch path copies every layer's context out of the
// cache and reads it twice more). Work is split over (sequence, KV head) pairs; each pair's
// `group` query heads share one pass over that head's keys and values. Softmax and sums in fp32.
//
// q:            [D, num_heads, head_dim]                      (bf16 / fp16 / fp32)
// k/v_cache:    [num_kv_heads, num_blocks, block_size, head_dim] (same dtype as q)
// block_tables: [D, max_blocks] int64, context_lens: [D] int64
// returns:      [D, num_heads, head_dim]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Loops marked `omp simd` are vectorized, reductions included, without -ffast-math for the file.
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// exp(x) for x <= 0 (softmax after subtracting the max): Cephes' expf, relative error ~1e-7,
// written so that a loop of it vectorizes (std::exp is a scalar libm call per element).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv, max_blocks = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / num_kv, h = work % num_kv;
      const int64_t ctx = lens[s];
      scores.assign(group * ctx, 0.f);
      for (int64_t g = 0; g < group; ++g)
        load_row(q_ptr + (s * num_heads + h * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
      const T* k_head = k_ptr + h * num_blocks * block_size * head_dim;
      const T* v_head = v_ptr + h * num_blocks * block_size * head_dim;
      // Scores: q . k for every context token, block by block.
      for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const int64_t block = tables[s * max_blocks + t0 / block_size];
        const int64_t n = std::min(block_size, ctx - t0);
        const T* kb = k_head + block * block_size * head_dim;
        for (int64_t i = 0; i < n; ++i) {
          load_row(kb + i * head_dim, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g)
            scores[g * ctx + t0 + i] = dot(qf.data() + g * head_dim, row.data(), head_dim) * fscale;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * ctx;
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = exp_nonpositive(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < ctx; ++t) sg[t] *= inv;
      }
      // Weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const int64_t block = tables[s * max_blocks + t0 / block_size];
        const int64_t n = std::min(block_size, ctx - t0);
        const T* vb = v_head + block * block_size * head_dim;
        for (int64_t i = 0; i < n; ++i) {
          load_row(vb + i * head_dim, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * ctx + t0 + i];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_ptr + (s * num_heads + h * group + g) * head_dim;
        const float* ag = acc.data() + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ag[d]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "head mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "batch mismatch");
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(2), max_blocks = tables.size(1);
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(l[s] >= 1 && l[s] <= max_blocks * bs, "context length out of range");
    for (int64_t b = 0; b < (l[s] + bs - 1) / bs; ++b)
      TORCH_CHECK(t[s * max_blocks + b] >= 0 && t[s * max_blocks + b] < k_cache.size(1), "block id out of range");
  }
  auto out = at::empty_like(qc);
  switch (q.scalar_type()) {
    case at::kBFloat16: decode_attention<c10::BFloat16>(qc, kc, vc, tables, lens, scale, out); break;
    case at::kHalf: decode_attention<c10::Half>(qc, kc, vc, tables, lens, scale, out); break;
    case at::kFloat: decode_attention<float>(qc, kc, vc, tables, lens, scale, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(batchgate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgate, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
