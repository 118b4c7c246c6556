// The engine's CPU kernels (engine/device/native.py builds and loads them):
//
// - paged_decode_attention: decode attention straight from the paged KV cache;
// - write_kv_: a step's new K/V into their cache slots, both in one pass (fp32 rounded to a bf16
//   cache where the engine keeps one);
// - rms_norm, add_rms_norm, rope_: the elementwise parts of a layer, fused. Each replaces 5-10
//   torch ops (and as many dispatches) and rounds exactly where the torch ops they replace round,
//   so results match the torch path (bitwise for bf16, except for the order of the sum of squares
//   in rms_norm);
// - silu_mul: SiLU-and-multiply in one pass, bf16 with AVX-512 only (a portable version with an
//   auto-vectorized exp lost to torch's two ops, so elsewhere the model keeps those);
// - argmax_rows: greedy sampling's argmax over each row of the logits;
// - set_caller_threads: the engine thread's OpenMP threads for one step.
//
// Decode attention:
// One query token per sequence attends to its context, read block by block through its block
// table: no gathered copy of K/V (the torch path copies every layer's context out of the cache
// and reads it twice more). Work is split over (sequence, KV head) pairs; each pair's `group`
// query heads share one pass over that head's keys and values. Softmax and sums in fp32.
// A banded layer (window W > 0) reads only the last W positions of each context; attention sinks
// (gpt-oss: a learned logit per query head) join each softmax's denominator, with no value.
//
// q:            [D, num_heads, head_dim]                      (bf16 / fp16 / fp32)
// k/v_cache:    [num_kv_heads, num_blocks, block_size, head_dim] (q's dtype, or bf16 under fp32 q)
// block_tables: [D, max_blocks] int64, context_lens: [D] int64
// window:       0 (the whole context) or W;  sinks: none, or [num_heads] float32
// returns:      [D, num_heads, head_dim]

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BATCHGATE_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd_avx2.h"
#define BATCHGATE_AVX2_FMA 1
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// float -> bf16, round to nearest even, as c10's conversion, but branch-free so loops vectorize.
template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(is_nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Loops marked `omp simd` are vectorized, reductions included, without -ffast-math for the file.
// Built with -ffp-contract=off, so that the elementwise kernels round exactly as the torch ops
// they replace; attention asks for its fused multiply-adds explicitly (std::fma).
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum = std::fma(a[d], b[d], sum);
  return sum;
}

// exp(x) for softmax: Cephes' expf, relative error ~1e-7, written so that a loop of it vectorizes
// (std::exp is a scalar libm call per element). Inputs are clamped to [-87, 88].
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
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

// A decode batch's tensors as raw pointers and sizes, shared by the attention kernels below:
// queries and outputs of type T, the caches of type C (T, or bf16 under float32 queries).
template <typename T, typename C = T>
struct PagedBatch {
  int64_t num_seqs, num_heads, head_dim, num_kv, group, num_blocks, block_size, max_blocks, window;
  const T* q;
  const C *k, *v;
  const int64_t *tables, *lens;
  const float* sinks;  // [num_heads], or null
  T* out;

  PagedBatch(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out_, int64_t window_ = 0,
             const float* sinks_ = nullptr)
      : num_seqs(q_.size(0)), num_heads(q_.size(1)), head_dim(q_.size(2)), num_kv(k_cache.size(0)),
        group(q_.size(1) / k_cache.size(0)), num_blocks(k_cache.size(1)), block_size(k_cache.size(2)),
        max_blocks(block_tables.size(1)), window(window_), q(q_.data_ptr<T>()), k(k_cache.data_ptr<C>()),
        v(v_cache.data_ptr<C>()), tables(block_tables.data_ptr<int64_t>()),
        lens(context_lens.data_ptr<int64_t>()), sinks(sinks_), out(out_.data_ptr<T>()) {}

  const T* query(int64_t s, int64_t head) const { return q + (s * num_heads + head) * head_dim; }
  T* output(int64_t s, int64_t head) const { return out + (s * num_heads + head) * head_dim; }
  // The first context position sequence s attends to: 0, or the window's first.
  int64_t first(int64_t s) const { return window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0; }
  // The sinks of KV head h's query heads, or null.
  const float* sink(int64_t h) const { return sinks == nullptr ? nullptr : sinks + h * group; }

  // f(s, h, n, scores) for each (sequence, KV head) pair, the pairs split over the threads, KV
  // head by KV head: a prefill chunk's rows read one context, which then stays in L2 from row to
  // row; `scores` is the pair's scratch of rows x n floats (n: the positions s attends to).
  template <typename F>
  void for_each_pair(int64_t rows, F&& f) const {
    at::parallel_for(0, num_seqs * num_kv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t work = begin; work < end; ++work) {
        const int64_t s = work % num_seqs, n = lens[s] - first(s);
        scores.resize(rows * n);
        f(s, work / num_seqs, n, scores.data());
      }
    });
  }

  // f(t0, rows, n) for each block of the positions sequence s attends to in KV head h of `cache`
  // (k or v): t0 the first one's index among them, its rows [n, head_dim]. The next block's lines
  // are asked for while f runs: blocks are scattered, each its own run of memory that the
  // hardware prefetcher would find only after the first misses.
  template <typename F>
  void for_each_block(const C* cache, int64_t s, int64_t h, F&& f) const {
    const int64_t ctx = lens[s], from = first(s);
    const int64_t* table = tables + s * max_blocks;
    const C* head = cache + h * num_blocks * block_size * head_dim;
    const int64_t block_bytes = block_size * head_dim * static_cast<int64_t>(sizeof(C));
    for (int64_t p0 = from - from % block_size; p0 < ctx; p0 += block_size) {
      if (p0 + block_size < ctx) {
        const char* next = reinterpret_cast<const char*>(head + table[p0 / block_size + 1] * block_size * head_dim);
        for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(next + line);
      }
      const int64_t lo = std::max(p0, from);
      f(lo - from, head + (table[p0 / block_size] * block_size + lo - p0) * head_dim,
        std::min(p0 + block_size, ctx) - lo);
    }
  }
};

// Softmax of each of `rows` rows of `n` scores, in place; `sink` (null: none) adds row g's sink
// logit sink[g] to its denominator.
inline void softmax_rows(float* scores, int64_t rows, int64_t n, const float* sink = nullptr) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * n;
    float m = sink == nullptr ? -std::numeric_limits<float>::infinity() : sink[g];
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
    float sum = sink == nullptr ? 0.f : fast_exp(sink[g] - m);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      sg[t] = fast_exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
  }
}

#ifdef BATCHGATE_AVX2_FMA
using batchgate_simd::hmax8;
using batchgate_simd::hsum8;

// fast_exp on 8 lanes, the same steps (without FMA contractions), so a lane rounds as fast_exp.
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// softmax_rows with the exponentials 8 at a time (the compiler leaves fast_exp scalar where the
// attention kernel inlines it).
inline void softmax_rows8(float* scores, int64_t rows, int64_t n, const float* sink) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * n;
    float m = sink == nullptr ? -std::numeric_limits<float>::infinity() : sink[g];
    int64_t t = 0;
    if (n >= 8) {
      __m256 m8 = _mm256_loadu_ps(sg);
      for (t = 8; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sg + t));
      m = std::max(m, hmax8(m8));
    }
    for (; t < n; ++t) m = std::max(m, sg[t]);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
      const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
      _mm256_storeu_ps(sg + t, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum8(sum8) + (sink == nullptr ? 0.f : fast_exp(sink[g] - m));
    for (; t < n; ++t) {
      sg[t] = fast_exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (t = 0; t < n; ++t) sg[t] *= inv;
  }
}
#endif

#ifdef BATCHGATE_AVX512_BF16
#ifndef BATCHGATE_AVX2_FMA
#error "the bf16 path's softmax (softmax_rows8) needs AVX2 and FMA, as every AVX512-BF16 CPU has"
#endif
// The bf16 fast path (CPUs with AVX512-BF16, e.g. Zen 4, Sapphire Rapids), for head_dim HD and
// G query heads per KV head known at compile time, so that the queries (G x HD bf16) and the value
// accumulators (G x HD fp32) stay in registers for a whole context. q . k straight from bf16 with
// the dot-product instruction (exact products, fp32 sums), 16 keys' scores summed into one
// register at a time; the softmax 8 lanes at a time; values converted to fp32 and accumulated
// with FMAs; the output rounded to bf16 to nearest even, as `round_to`.
inline __m512 load_bf16x16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The lane sums of the 16 registers a[0..15], as the 16 lanes of one, in order: a transposing
// tree of shuffles and adds (45 instructions, against ~8 for each register's horizontal sum).
inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: [x0+x2, y0+y2, x1+x3, y1+y3] of a[2i] (x), a[2i+1] (y)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: a part of the sums of a[4i..4i+3]
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Then across the 128-bit quarters: [q0 + q1 of a[0..3], q2 + q3 of a[0..3], the same of a[4..7]].
  const __m512 lo =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi =
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

template <int G, int HD>
void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                           at::Tensor& out, int64_t window, const float* sinks) {
  constexpr int KR = HD / 32;  // zmm registers of bf16 per row
  constexpr int VR = HD / 16;  // zmm registers of fp32 per row
  using T = c10::BFloat16;
  const PagedBatch<T> b(q, k_cache, v_cache, block_tables, context_lens, out, window, sinks);
  b.for_each_pair(G, [&](int64_t s, int64_t h, int64_t ctx, float* sc) {
    __m512bh qv[G][KR];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < KR; ++j) qv[g][j] = (__m512bh)_mm512_loadu_si512(b.query(s, h * G + g) + j * 32);
    const __m512 scale16 = _mm512_set1_ps(scale);
    b.for_each_block(b.k, s, h, [&](int64_t t0, const T* rows, int64_t n) {
      for (int64_t i0 = 0; i0 < n; i0 += 16) {  // 16 keys at a time: their scores in one register
        const int m = static_cast<int>(std::min<int64_t>(16, n - i0));
        const T* keys = rows + i0 * HD;
        for (int g = 0; g < G; ++g) {
          __m512 acc[16];
          for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_setzero_ps();
            if (i < m)
              for (int j = 0; j < KR; ++j)
                acc[i] = _mm512_dpbf16_ps(acc[i], qv[g][j], (__m512bh)_mm512_loadu_si512(keys + i * HD + j * 32));
          }
          _mm512_mask_storeu_ps(sc + g * ctx + t0 + i0, static_cast<__mmask16>((1u << m) - 1),
                                _mm512_mul_ps(sum_lanes16(acc), scale16));
        }
      }
    });
    softmax_rows8(sc, G, ctx, b.sink(h));
    __m512 acc[G][VR];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < VR; ++j) acc[g][j] = _mm512_setzero_ps();
    b.for_each_block(b.v, s, h, [&](int64_t t0, const T* rows, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        __m512 v[VR];
        for (int j = 0; j < VR; ++j) v[j] = load_bf16x16(rows + i * HD + j * 16);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(sc[g * ctx + t0 + i]);
          for (int j = 0; j < VR; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
        }
      }
    });
    for (int g = 0; g < G; ++g) {
      T* o = b.output(s, h * G + g);
      for (int j = 0; j < VR; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j * 16), (__m256i)_mm512_cvtneps_pbh(acc[g][j]));
    }
  });
}

template <int HD>
bool decode_attention_bf16_group(int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& tables, const at::Tensor& lens, float scale, at::Tensor& out,
                                 int64_t w, const float* sk) {
  switch (group) {
    case 1: decode_attention_bf16<1, HD>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 2: decode_attention_bf16<2, HD>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 3: decode_attention_bf16<3, HD>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 4: decode_attention_bf16<4, HD>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 8: decode_attention_bf16<8, HD>(q, k, v, tables, lens, scale, out, w, sk); return true;
    default: return false;
  }
}
#endif

#ifdef BATCHGATE_AVX2_FMA
// 8 cache values as floats: fp32 as they are, bf16 widened (exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The fp32 fast path (AVX2 and FMA), for G query heads per KV head known at compile time and
// head_dim a multiple of 32, over an fp32 or a bf16 cache (C): each key row is loaded once for
// the G dot products, and the values are summed in registers over the whole context, a slice of
// head_dim at a time.
template <int G, typename C>
void decode_attention_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                          at::Tensor& out, int64_t window, const float* sinks) {
  constexpr int KA = G <= 4 ? 2 : 1;  // accumulators per query head for q . k
  constexpr int VW = G <= 3 ? 4 : 2;  // registers (of 8 floats) per query head for the values
  const PagedBatch<float, C> b(q, k_cache, v_cache, block_tables, context_lens, out, window, sinks);
  const int64_t hd = b.head_dim;
  b.for_each_pair(G, [&](int64_t s, int64_t h, int64_t ctx, float* sc) {
    const float* qg[G];
    for (int g = 0; g < G; ++g) qg[g] = b.query(s, h * G + g);
    b.for_each_block(b.k, s, h, [&](int64_t t0, const C* rows, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const C* kr = rows + i * hd;
        __m256 acc[G][KA];
        for (int g = 0; g < G; ++g)
          for (int a = 0; a < KA; ++a) acc[g][a] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8 * KA)
          for (int a = 0; a < KA; ++a) {
            const __m256 kv = load8(kr + d + 8 * a);
            for (int g = 0; g < G; ++g)
              acc[g][a] = _mm256_fmadd_ps(_mm256_loadu_ps(qg[g] + d + 8 * a), kv, acc[g][a]);
          }
        for (int g = 0; g < G; ++g) {
          __m256 sum = acc[g][0];
          for (int a = 1; a < KA; ++a) sum = _mm256_add_ps(sum, acc[g][a]);
          sc[g * ctx + t0 + i] = hsum8(sum) * scale;
        }
      }
    });
    softmax_rows8(sc, G, ctx, b.sink(h));
    for (int64_t d0 = 0; d0 < hd; d0 += 8 * VW) {
      __m256 acc[G][VW];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < VW; ++j) acc[g][j] = _mm256_setzero_ps();
      b.for_each_block(b.v, s, h, [&](int64_t t0, const C* rows, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          __m256 v[VW];
          for (int j = 0; j < VW; ++j) v[j] = load8(rows + i * hd + d0 + 8 * j);
          for (int g = 0; g < G; ++g) {
            const __m256 p = _mm256_set1_ps(sc[g * ctx + t0 + i]);
            for (int j = 0; j < VW; ++j) acc[g][j] = _mm256_fmadd_ps(p, v[j], acc[g][j]);
          }
        }
      });
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < VW; ++j) _mm256_storeu_ps(b.output(s, h * G + g) + d0 + 8 * j, acc[g][j]);
    }
  });
}

template <typename C>
bool decode_attention_f32_group(int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& tables, const at::Tensor& lens, float scale, at::Tensor& out,
                                int64_t w, const float* sk) {
  switch (group) {
    case 1: decode_attention_f32<1, C>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 2: decode_attention_f32<2, C>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 3: decode_attention_f32<3, C>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 4: decode_attention_f32<4, C>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 6: decode_attention_f32<6, C>(q, k, v, tables, lens, scale, out, w, sk); return true;
    case 8: decode_attention_f32<8, C>(q, k, v, tables, lens, scale, out, w, sk); return true;
    default: return false;
  }
}
#endif

// The fast path's shapes where the CPU has it; false: use the portable kernel.
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                           const at::Tensor& lens, double scale, at::Tensor& out, int64_t w, const float* sk) {
  const int64_t group = q.size(1) / k.size(0);
  const float fscale = static_cast<float>(scale);
#ifdef BATCHGATE_AVX512_BF16
  if (q.scalar_type() == at::kBFloat16 && q.size(2) == 64)
    return decode_attention_bf16_group<64>(group, q, k, v, tables, lens, fscale, out, w, sk);
  if (q.scalar_type() == at::kBFloat16 && q.size(2) == 128)
    return decode_attention_bf16_group<128>(group, q, k, v, tables, lens, fscale, out, w, sk);
#endif
#ifdef BATCHGATE_AVX2_FMA
  if (q.scalar_type() == at::kFloat && q.size(2) % 32 == 0)
    return k.scalar_type() == at::kFloat
               ? decode_attention_f32_group<float>(group, q, k, v, tables, lens, fscale, out, w, sk)
               : decode_attention_f32_group<c10::BFloat16>(group, q, k, v, tables, lens, fscale, out, w, sk);
#endif
  (void)group, (void)fscale, (void)w, (void)sk;
  (void)q, (void)k, (void)v, (void)tables, (void)lens, (void)scale, (void)out;
  return false;
}

template <typename T, typename C = T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      at::Tensor& out, int64_t window, const float* sinks) {
  const PagedBatch<T, C> b(q, k_cache, v_cache, block_tables, context_lens, out, window, sinks);
  const int64_t group = b.group, head_dim = b.head_dim;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, b.num_seqs * b.num_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / b.num_kv, h = work % b.num_kv;
      const int64_t ctx = b.lens[s] - b.first(s);
      scores.assign(group * ctx, 0.f);
      for (int64_t g = 0; g < group; ++g) load_row(b.query(s, h * group + g), qf.data() + g * head_dim, head_dim);
      // Visits the attended rows of one head's cache in order, converted to fp32 in `row`:
      // f(t, row) for t in [0, ctx).
      auto for_each_row = [&](const C* cache, auto&& f) {
        b.for_each_block(cache, s, h, [&](int64_t t0, const C* rows, int64_t n) {
          for (int64_t i = 0; i < n; ++i) {
            load_row(rows + i * head_dim, row.data(), head_dim);
            f(t0 + i, row.data());
          }
        });
      };
      // Scores: q . k for every context token.
      for_each_row(b.k, [&](int64_t t, const float* r) {
        for (int64_t g = 0; g < group; ++g) scores[g * ctx + t] = dot(qf.data() + g * head_dim, r, head_dim) * fscale;
      });
      softmax_rows(scores.data(), group, ctx, b.sink(h));
      // Weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(b.v, [&](int64_t t, const float* r) {
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] = std::fma(p, r[d], ag[d]);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        T* o = b.output(s, h * group + g);
        const float* ag = acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] = round_to<T>(ag[d]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "the caches must share q's dtype, or be bf16 under float32 q");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "head mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "batch mismatch");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                                     sinks->size(0) == q.size(1)),
              "sinks must be [num_heads] float32");
  const at::Tensor sinks_c = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  const float* sk = sinks.has_value() ? sinks_c.data_ptr<float>() : nullptr;
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
  if (decode_attention_fast(qc, kc, vc, tables, lens, scale, out, window, sk)) return out;
  if (q.scalar_type() != k_cache.scalar_type()) {
    decode_attention<float, c10::BFloat16>(qc, kc, vc, tables, lens, scale, out, window, sk);
    return out;
  }
  switch (q.scalar_type()) {
    case at::kBFloat16: decode_attention<c10::BFloat16>(qc, kc, vc, tables, lens, scale, out, window, sk); break;
    case at::kHalf: decode_attention<c10::Half>(qc, kc, vc, tables, lens, scale, out, window, sk); break;
    case at::kFloat: decode_attention<float>(qc, kc, vc, tables, lens, scale, out, window, sk); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

// ---- fused elementwise kernels ----------------------------------------------------------------

// Rows in parallel only when there is enough work: a decode step's [32, 576] runs inline, with no
// OpenMP region at all.
inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

// out = w * round(x * rsqrt(mean(x^2) + eps)), and optionally residual = round(x + residual) first.
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> v(cols);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      float sum = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) {
          rr[c] = round_to<T>(to_float(xr[c]) + to_float(rr[c]));
          v[c] = to_float(rr[c]);
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) v[c] = to_float(xr[c]);
      }
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) sum += v[c] * v[c];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
      T* o = out + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) o[c] = round_to<T>(to_float(w[c]) * to_float(round_to<T>(v[c] * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm: bad shapes");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w must share a dtype");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual += x (rounded), then returns rms_norm(residual); `residual` is updated in place.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  w.dim() == 1 && w.size(0) == x.size(1),
              "add_rms_norm: bad shapes");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: dtypes differ");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// In place on the first w.size(0) heads of each row of qkv [T, heads_total * D] (q's, then k's):
// each head's D values RMS-normalized and multiplied by its row of w [heads, D], rounded as
// rms_norm rounds (Qwen3's and Gemma 3's q/k norms, one weight row per head).
template <typename T>
void head_rms_norm_rows(T* base, const T* w, int64_t rows, int64_t stride, int64_t heads, int64_t d, float eps) {
  at::parallel_for(0, rows, row_grain(heads * d), [&](int64_t begin, int64_t end) {
    std::vector<float> v(d);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        T* x = base + r * stride + h * d;
        const T* wh = w + h * d;
        float sum = 0.f;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) v[c] = to_float(x[c]);
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < d; ++c) sum += v[c] * v[c];
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) x[c] = round_to<T>(to_float(wh[c]) * to_float(round_to<T>(v[c] * inv)));
      }
  });
}

void head_rms_norm_(at::Tensor qkv, const at::Tensor& w, int64_t head_dim, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && w.dim() == 2 && w.is_contiguous() && w.size(1) == head_dim &&
                  qkv.size(1) >= w.size(0) * head_dim,
              "head_rms_norm_: bad shapes");
  TORCH_CHECK(qkv.scalar_type() == w.scalar_type(), "head_rms_norm_: qkv and w must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "head_rms_norm_", [&] {
    head_rms_norm_rows<scalar_t>(qkv.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), qkv.size(0), qkv.size(1), w.size(0),
                                 head_dim, static_cast<float>(eps));
  });
}

// In place on the first `num_heads` heads of each row of qkv [T, heads_total * D] (q's heads, then
// k's): x = round(round(x * cos) + round(rotate_half(x) * sin)), cos/sin [max_pos, D] rows by position.
template <typename T>
void rope_rows(T* base, const int64_t* p, const T* cs, const T* sn, int64_t rows, int64_t stride, int64_t num_heads,
               int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, row_grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> x(head_dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cs + p[r] * head_dim;
      const T* s = sn + p[r] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = base + r * stride + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) x[d] = to_float(v[d]);
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) {
          // rotate_half: (-x[half:], x[:half]); negation is exact in any dtype.
          const float rot = d < half ? -x[d + half] : x[d - half];
          const float a = to_float(round_to<T>(x[d] * to_float(c[d])));
          const float b = to_float(round_to<T>(rot * to_float(s[d])));
          v[d] = round_to<T>(a + b);
        }
      }
    }
  });
}

void rope_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) >= num_heads * head_dim, "rope_: bad qkv");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == qkv.size(0), "rope_: bad positions");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim && cos.sizes() == sin.sizes(),
              "rope_: bad cos/sin");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rope_: dtypes");
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < qkv.size(0); ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "rope_: position out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), p, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), qkv.size(0),
                        qkv.size(1), num_heads, head_dim);
  });
}

// silu(gate) * up for gate_up = [gate | up] rows of a bf16 [rows, 2 * n] tensor -> [rows, n], rounded
// as the two torch ops round (silu in fp32 to bf16, then the product in fp32 to bf16). AVX-512 only:
// elsewhere (and for other dtypes) the model keeps the torch ops.
#ifdef BATCHGATE_AVX512_BF16
// exp(x), x <= 0 here (the argument is -|x| or below): 2^n * p(r), r = x - n ln 2 in two parts,
// p Cephes' degree-6 polynomial; relative error ~1e-7, as torch's vectorized exp.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512i bf16_bits(__m512 x) {  // 16 floats -> their bf16 (RNE) in the low halves
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}
#endif

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 32 == 0, "silu_mul: bad input");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: bf16 only");
#ifdef BATCHGATE_AVX512_BF16
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  const auto* in = gate_up.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = in + r * 2 * n;
      const c10::BFloat16* u = g + n;
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 x = load_bf16x16(g + j);
        // x * sigmoid(x) computed as torch's silu does: x / (1 + exp(-x)).
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        const __m512 silu_b = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(silu), 16));
        const __m512 y = _mm512_mul_ps(silu_b, load_bf16x16(u + j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + r * n + j), (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "silu_mul: needs AVX512-BF16");
#endif
}

bool has_fast_silu_mul() {
#ifdef BATCHGATE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// k/v: [T, num_kv, head_dim] (rows may be strided, e.g. views into the fused QKV output; the last
// dimension contiguous) -> the caches' slots `slot_mapping` [T] of each KV head. One pass for
// both, instead of two index_copy_ calls on transposed views.
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "write_kv_: bad caches");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(3),
              "write_kv_: bad k/v shapes");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv_: head_dim must be contiguous");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k.scalar_type() == k_cache.scalar_type() ||
                   (k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "write_kv_: the caches must share k's dtype, or be bf16 under float32 k");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == k.size(0), "write_kv_: slots");
  auto slots = slot_mapping.contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t tokens = k.size(0), num_kv = k.size(1), head_dim = k.size(2);
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "write_kv_: slot out of range");
  if (k.scalar_type() != k_cache.scalar_type()) {  // float32 rows into a bf16 cache, rounded to nearest even
    auto* kc = k_cache.data_ptr<c10::BFloat16>();
    auto* vc = v_cache.data_ptr<c10::BFloat16>();
    const float* ks = k.data_ptr<float>();
    const float* vs = v.data_ptr<float>();
    at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < num_kv; ++h) {
          const int64_t dst = ((h * num_slots) + sl[t]) * head_dim;
          const float* kr = ks + t * k.stride(0) + h * k.stride(1);
          const float* vr = vs + t * v.stride(0) + h * v.stride(1);
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) {
            kc[dst + d] = round_to<c10::BFloat16>(kr[d]);
            vc[dst + d] = round_to<c10::BFloat16>(vr[d]);
          }
        }
    });
    return;
  }
  const int64_t elt = k.element_size(), row_bytes = head_dim * elt;
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < num_kv; ++h) {
        const int64_t dst = ((h * num_slots) + sl[t]) * row_bytes;
        std::memcpy(kc + dst, ks + (t * k.stride(0) + h * k.stride(1)) * elt, row_bytes);
        std::memcpy(vc + dst, vs + (t * v.stride(0) + h * v.stride(1)) * elt, row_bytes);
      }
  });
}

// ---- greedy sampling --------------------------------------------------------------------------

// The index of row x's largest value, the first one if it repeats; a NaN counts as the largest
// (the first NaN), as torch.argmax. Each lane keeps its own first maximum (a strictly greater
// value replaces it, so a lane's index only grows), then the lanes' smallest index among the
// largest value wins: one pass, where torch's argmax takes several (docs/BENCHMARKS.md).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
#ifdef BATCHGATE_AVX2_FMA
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
    __m256 unordered = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 greater = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
      vmax = _mm256_blendv_ps(vmax, v, greater);
      vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(greater));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float m[8];
    alignas(32) int32_t k[8];
    _mm256_store_ps(m, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(k), vidx);
    top = m[0], best = k[0];
    for (int j = 1; j < 8; ++j)
      if (m[j] > top || (m[j] == top && k[j] < best)) top = m[j], best = k[j];
  }
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    if (x[i] > top || i == 0) top = x[i], best = i;
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best;
}

// The OpenMP threads of the calling thread's parallel regions (torch's ops and ours), leaving every
// other thread's and torch's own setting (which threads started later copy) as they are.
void set_caller_threads(int64_t n) {
  TORCH_CHECK(n >= 1, "set_caller_threads: n must be >= 1");
  omp_set_num_threads(static_cast<int>(n));
}

// argmax(dim=-1) of float32 logits [S, V] -> int64 [S].
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_rows: logits must be [S, V] float32");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "argmax_rows: bad vocabulary size");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(batchgate, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, Tensor? sinks=None) -> Tensor");
  m.def("head_rms_norm_(Tensor(a!) qkv, Tensor w, int head_dim, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("has_fast_silu_mul() -> bool", &has_fast_silu_mul);  // no tensors: a catch-all kernel
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("set_caller_threads(int n) -> ()", &set_caller_threads);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(batchgate, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("head_rms_norm_", &head_rms_norm_);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("write_kv_", &write_kv_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
