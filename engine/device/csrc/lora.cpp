// LoRA deltas of a step's decode rows on the CPU (engine/lora.py's LoraStack): every slot's shrink
// and expand of one fused linear in two parallel passes, reading each slot's A and B once. The
// torch path (two bmm, a gather and a scatter: ~6 small ops a linear) is bound by per-op and
// per-thread-handoff costs at decode batch sizes; this is one op a linear. AVX2 registers where
// the build has them, plain loops elsewhere (any x86 or ARM level). Rows and sums in float32; A and
// B stored in float32 or bfloat16 (half the bytes a step reads; widened exactly to float32).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is a float32's top half: shift it back up
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// s[i, 0:cols] = sum_k x[i, k] * a[k, 0:cols] for rows i < NR (x rows `xs` apart, a rows `as`).
template <int NR, typename W>
void shrink_rows(const float* x, int64_t xs, const W* a, int64_t as, int64_t in, int64_t cols, float* s,
                 int64_t ss) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= cols; j += 8) {  // 8 columns of NR rows in registers, each A row read once
    __m256 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; ++k) {
      const __m256 av = load8(a + k * as + j);
      for (int i = 0; i < NR; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x[i * xs + k]), av, acc[i]);
    }
    for (int i = 0; i < NR; ++i) _mm256_storeu_ps(s + i * ss + j, acc[i]);
  }
#endif
  for (; j < cols; ++j)
    for (int i = 0; i < NR; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < in; ++k) acc += x[i * xs + k] * widen(a[k * as + j]);
      s[i * ss + j] = acc;
    }
}

// y[i, 0:cols] += sum_j s[i, j] * b[j, 0:cols] for rows i < NR, j < r (b rows `cols` apart).
template <int NR, typename W>
void expand_rows(const float* s, int64_t ss, const W* b, int64_t r, int64_t cols, float* y, int64_t ys) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 8 <= cols; c += 8) {
    __m256 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm256_loadu_ps(y + i * ys + c);
    for (int64_t j = 0; j < r; ++j) {
      const __m256 bv = load8(b + j * cols + c);
      for (int i = 0; i < NR; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(s[i * ss + j]), bv, acc[i]);
    }
    for (int i = 0; i < NR; ++i) _mm256_storeu_ps(y + i * ys + c, acc[i]);
  }
#endif
  for (; c < cols; ++c)
    for (int i = 0; i < NR; ++i) {
      float acc = y[i * ys + c];
      for (int64_t j = 0; j < r; ++j) acc += s[i * ss + j] * widen(b[j * cols + c]);
      y[i * ys + c] = acc;
    }
}

constexpr int kRows = 4;  // rows a block keeps in registers

template <typename F4, typename F1>
void by_blocks(int64_t begin, int64_t end, F4 four, F1 one) {
  int64_t i = begin;
  for (; i + kRows <= end; i += kRows) four(i);
  for (; i < end; ++i) one(i);
}

template <typename W>
void lora_decode(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& row_slot, const at::Tensor& owner, int64_t lo) {
  const int64_t n = row_slot.size(0), in = a.size(1), mr = a.size(2), chunks = b.size(1), r = b.size(2),
                chunk = b.size(3), out = y.size(1);
  const int64_t modules = mr / r;
  const int64_t* slot_of = row_slot.data_ptr<int64_t>();
  const int64_t* owner_of = owner.data_ptr<int64_t>();
  // runs of one slot: [start, end) of rows
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || slot_of[i] != slot_of[i - 1]) starts.push_back(i);
  starts.push_back(n);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  std::vector<float> shrunk(static_cast<size_t>(n * mr));  // [n, M * R]
  const float* xp = x.data_ptr<float>();
  const W* ap = a.data_ptr<W>();
  const W* bp = b.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  float* sp = shrunk.data();

  // shrink: one unit per (run, module), each reading its R columns of the slot's A once
  at::parallel_for(0, runs * modules, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t run = u / modules, m = u % modules;
      const int64_t slot = slot_of[starts[run]];
      const W* a_slot = ap + slot * in * mr + m * r;
      by_blocks(
          starts[run], starts[run + 1],
          [&](int64_t i) { shrink_rows<kRows>(xp + (lo + i) * in, in, a_slot, mr, in, r, sp + i * mr + m * r, mr); },
          [&](int64_t i) { shrink_rows<1>(xp + (lo + i) * in, in, a_slot, mr, in, r, sp + i * mr + m * r, mr); });
    }
  });
  // expand: one unit per (run, chunk), each reading its [R, chunk] block of the slot's B once
  at::parallel_for(0, runs * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t run = u / chunks, c = u % chunks;
      const int64_t slot = slot_of[starts[run]];
      const W* b_chunk = bp + (slot * chunks + c) * r * chunk;
      const int64_t m = owner_of[c];
      by_blocks(
          starts[run], starts[run + 1],
          [&](int64_t i) {
            expand_rows<kRows>(sp + i * mr + m * r, mr, b_chunk, r, chunk, yp + (lo + i) * out + c * chunk, out);
          },
          [&](int64_t i) {
            expand_rows<1>(sp + i * mr + m * r, mr, b_chunk, r, chunk, yp + (lo + i) * out + c * chunk, out);
          });
    }
  });
}

// y[lo + i, :] += row i's delta for the rows lo .. lo + n - 1, ordered by slot (`row_slot`, n).
// x [T, in], y [T, out]; a [S, in, M * R] (each module's A side by side); b [S, C, R, chunk] (the
// fused output in C column chunks, chunk c expanding module owner[c]'s shrink).
void lora_decode_(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& row_slot, const at::Tensor& owner, int64_t lo) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat, "lora_decode_: float32 rows only");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_decode_: A and B both float32 or both bfloat16");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "lora_decode_: contiguous tensors only");
  if (a.scalar_type() == at::kFloat)
    lora_decode<float>(y, x, a, b, row_slot, owner, lo);
  else
    lora_decode<at::BFloat16>(y, x, a, b, row_slot, owner, lo);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgate, m) {
  m.def("lora_decode_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slot, Tensor owner, int lo) -> ()");
}

TORCH_LIBRARY_IMPL(batchgate, CPU, m) { m.impl("lora_decode_", &lora_decode_); }
