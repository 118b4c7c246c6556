// Quantized linear layers for x86 CPUs with AVX2, and AVX-512 VNNI where the CPU has it (engine/device/quant.py
//
// y = x @ W^T for weights kept in groups of 32 along K, as the GGUF formats hold them:
//   q4: Q4_1, w = d * q + m with q in 0..15 (d, m fp16 per group and row);
//   q8: Q8_0, w = d * q with q in -127..127 (d fp16 per group and row).
// Activations are quantized on the fly per row and group of 32 to integers qx = 255 * hi + lo
// (hi, lo signed bytes) at a step dx = max|x| / 32512, so each group's dot product is exact
// integer arithmetic, scaled once: sum(w * x) = dw * dx * sum(qw * qx) + m * dx * sum(qx).
// A group's lo bytes are used only where its largest value is an outlier (max|x| > ratio *
// mean|x|): there the small values beside it keep 15 bits, at the cost of a second vpmaddubsw per
// product; elsewhere lo = 0 and hi alone is an int8 quantization at max|x| / 127.5 (as llama.cpp's
// Q8_1). Each output row depends only on its own input row: a token's result does not depend on
// the batch it is computed in (prefill, chunked prefill and decode agree).
//
// Layout: output rows in blocks of 8, each block's groups contiguous, so one 32-byte load feeds
// all 8 rows. In a q4 group (160 bytes): four 32-byte chunks p = 0..3 whose byte 4j + t holds
// row j's weights k = 4p + t (low nibble) and 16 + 4p + t (high nibble), then the 8 rows' d and
// m (fp16). A q8 group (272 bytes): eight chunks c whose byte 4j + t is row j's weight 4c + t,
// then the 8 d. vpmaddubsw multiplies unsigned weight bytes by a broadcast of 4 activation
// bytes, so each 32-bit lane sums one row's products: no horizontal sums.
//
// This file is the only ISA-specific part; a NEON/SVE port is one more file with the same ops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "simd_avx2.h"
#include "steal_pool.h"
#define BATCHGATE_QMATMUL_AVX2 1
// AVX-512 VNNI on 256-bit registers (with AVX-512 VL): vpdpbusd in place of vpmaddubsw + vpmaddwd.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BATCHGATE_QMATMUL_VNNI 1
#endif
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 8;
constexpr int64_t kQ4GroupBytes = 160;
constexpr int64_t kQ8GroupBytes = 272;
// Activation rows per work item of a batched step, a multiple of the tiles' 3 or 4 rows: their bytes
// stay in L2 while the weight blocks pass (all of a long prefill's rows did not).
constexpr int64_t kChunkRows = 48;

bool has_qmatmul() {
#ifdef BATCHGATE_QMATMUL_AVX2
  return true;
#else
  return false;
#endif
}

// The instruction set the tiles below were built for: "avx512_vnni", "avx2" or "" (none).
std::string qmatmul_isa() {
#if defined(BATCHGATE_QMATMUL_VNNI)
  return "avx512_vnni";
#elif defined(BATCHGATE_QMATMUL_AVX2)
  return "avx2";
#else
  return "";
#endif
}

#ifdef BATCHGATE_QMATMUL_AVX2

using batchgate_simd::hmax8;
using batchgate_simd::hsum8;

inline __m256i pack_bytes(const __m256i v[4]) {
  // int32 -> int8 with packs (which interleave 128-bit lanes), then the lanes back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One group of 32 activations -> hi and lo bytes, the step d, d * sum(q), sum(q) and whether lo is
// used.
inline void quantize_group(const float* x, int8_t* hi, int8_t* lo, float* d, float* s, int32_t* qsum,
                           uint8_t* wide, float ratio) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps(), asum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    amax = _mm256_max_ps(amax, a);
    asum = _mm256_add_ps(asum, a);
  }
  const float maxabs = hmax8(amax);
  const bool outlier = maxabs > ratio * (hsum8(asum) / kGroup);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 base = _mm256_set1_ps(255.0f);
  __m256i h[4], l[4];
  __m256 total = _mm256_setzero_ps();
  if (outlier) {
    const __m256 inv = _mm256_set1_ps(maxabs > 0.0f ? 32512.0f / maxabs : 0.0f);
    const __m256 inv_base = _mm256_set1_ps(1.0f / 255.0f);
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_round_ps(_mm256_mul_ps(v[i], inv), kRound);  // |q| <= 32512
      const __m256 hf = _mm256_round_ps(_mm256_mul_ps(q, inv_base), kRound);  // |hf| <= 127
      total = _mm256_add_ps(total, q);
      h[i] = _mm256_cvtps_epi32(hf);
      l[i] = _mm256_cvtps_epi32(_mm256_fnmadd_ps(hf, base, q));  // exact: small integers
    }
  } else {
    const __m256 inv = _mm256_set1_ps(maxabs > 0.0f ? (32512.0f / 255.0f) / maxabs : 0.0f);
    for (int i = 0; i < 4; ++i) {
      const __m256 hf = _mm256_round_ps(_mm256_mul_ps(v[i], inv), kRound);  // |hf| <= 127
      total = _mm256_fmadd_ps(hf, base, total);
      h[i] = _mm256_cvtps_epi32(hf);
      l[i] = _mm256_setzero_si256();
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), pack_bytes(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), pack_bytes(l));
  *d = maxabs / 32512.0f;
  const float sum = hsum8(total);  // the sum of at most 32 integers below 2^15: exact in float
  *s = *d * sum;
  *qsum = static_cast<int32_t>(sum);
  *wide = outlier;
}

// A decode step of one row reads each weight once: its tiles ask for a group's cache lines
// kPrefetch bytes ahead (faster than the hardware prefetcher alone, docs/BENCHMARKS.md). Tiles
// of more rows reuse each block from L1, and the prefetches only took load slots there.
constexpr int64_t kPrefetch = 2048;

template <int64_t kBytes>
inline void prefetch_ahead(const uint8_t* group) {
  for (int64_t line = 0; line < kBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetch + line), _MM_HINT_T0);
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// The activations of a step: rows of hi bytes, then rows of lo bytes, per-group d, d * sum(q),
// sum(q) and flags, each [M, K / 32].
struct Activations {
  const int8_t* hi;
  int64_t lo_offset;
  const float* d;
  const float* s;
  const int32_t* qsum;
  const uint8_t* wide;
  int64_t k;
  int64_t groups;
};

// 255 * hi + lo, from the two 32-bit sums.
inline __m256i combine(__m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(hi, 8), hi), lo);
}

// MR activation rows (from row r0) times one block of 8 q4 rows: out[r * ldo + j] for j < 8.
template <int MR>
inline void q4_tile(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t ldo) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = w + g * kQ4GroupBytes;
    if (MR == 1) prefetch_ahead<kQ4GroupBytes>(wg);
    bool wide = false;
    for (int r = 0; r < MR; ++r) wide |= a.wide[(r0 + r) * a.groups + g] != 0;
    // Up to 8 products of 15 * 127 per 16-bit lane pair: at most 30,480, no saturation.
    __m256i dh[MR], dl[MR];
    for (int r = 0; r < MR; ++r) dh[r] = dl[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * p));
      const __m256i lo = _mm256_and_si256(packed, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xh = a.hi + (r0 + r) * a.k + g * kGroup;
        dh[r] = _mm256_add_epi16(dh[r], _mm256_maddubs_epi16(lo, broadcast4(xh + 4 * p)));
        dh[r] = _mm256_add_epi16(dh[r], _mm256_maddubs_epi16(hi, broadcast4(xh + 16 + 4 * p)));
        if (wide) {
          const int8_t* xl = xh + a.lo_offset;
          dl[r] = _mm256_add_epi16(dl[r], _mm256_maddubs_epi16(lo, broadcast4(xl + 4 * p)));
          dl[r] = _mm256_add_epi16(dl[r], _mm256_maddubs_epi16(hi, broadcast4(xl + 16 + 4 * p)));
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 128)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 144)));
    for (int r = 0; r < MR; ++r) {
      const __m256i sum = combine(_mm256_madd_epi16(dh[r], ones), _mm256_madd_epi16(dl[r], ones));
      const int64_t gi = (r0 + r) * a.groups + g;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[gi])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[gi]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// The same for q8 (signed) weights: |w| times x with w's sign, as vpmaddubsw takes one unsigned
// side; each 16-bit pair (at most 2 * 127 * 127) is widened to 32 bits at once.
template <int MR>
inline void q8_tile(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = w + g * kQ8GroupBytes;
    if (MR == 1) prefetch_ahead<kQ8GroupBytes>(wg);
    bool wide = false;
    for (int r = 0; r < MR; ++r) wide |= a.wide[(r0 + r) * a.groups + g] != 0;
    __m256i dh[MR], dl[MR];
    for (int r = 0; r < MR; ++r) dh[r] = dl[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i wc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
      const __m256i magnitude = _mm256_sign_epi8(wc, wc);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xh = a.hi + (r0 + r) * a.k + g * kGroup + 4 * c;
        const __m256i h = _mm256_sign_epi8(broadcast4(xh), wc);
        dh[r] = _mm256_add_epi32(dh[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, h), ones));
        if (wide) {
          const __m256i l = _mm256_sign_epi8(broadcast4(xh + a.lo_offset), wc);
          dl[r] = _mm256_add_epi32(dl[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, l), ones));
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 256)));
    for (int r = 0; r < MR; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(r0 + r) * a.groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(combine(dh[r], dl[r])), scale, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#ifdef BATCHGATE_QMATMUL_VNNI
// The same tiles with vpdpbusd, which sums 4 u8 x s8 products into each 32-bit lane in one
// instruction. Its latency (several cycles) would bound a single accumulator chain a row, so each
// row keeps two (even and odd chunks), summed once a group: the integer sums, and so the results,
// are those of the AVX2 tiles bit for bit. AVX-512 VL gives 32 registers: four rows a tile fit.
template <int MR>
inline void q4_tile_vnni(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t ldo) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = w + g * kQ4GroupBytes;
    if (MR == 1) prefetch_ahead<kQ4GroupBytes>(wg);
    bool wide = false;
    for (int r = 0; r < MR; ++r) wide |= a.wide[(r0 + r) * a.groups + g] != 0;
    __m256i h0[MR], h1[MR], l0[MR], l1[MR];
    for (int r = 0; r < MR; ++r) h0[r] = h1[r] = l0[r] = l1[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * p));
      const __m256i lo = _mm256_and_si256(packed, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xh = a.hi + (r0 + r) * a.k + g * kGroup;
        h0[r] = _mm256_dpbusd_epi32(h0[r], lo, broadcast4(xh + 4 * p));
        h1[r] = _mm256_dpbusd_epi32(h1[r], hi, broadcast4(xh + 16 + 4 * p));
        if (wide) {
          const int8_t* xl = xh + a.lo_offset;
          l0[r] = _mm256_dpbusd_epi32(l0[r], lo, broadcast4(xl + 4 * p));
          l1[r] = _mm256_dpbusd_epi32(l1[r], hi, broadcast4(xl + 16 + 4 * p));
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 128)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 144)));
    for (int r = 0; r < MR; ++r) {
      const __m256i sum = combine(_mm256_add_epi32(h0[r], h1[r]), _mm256_add_epi32(l0[r], l1[r]));
      const int64_t gi = (r0 + r) * a.groups + g;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[gi])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[gi]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

template <int MR>
inline void q8_tile_vnni(const uint8_t* w, const Activations& a, int64_t r0, float* out, int64_t ldo) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = w + g * kQ8GroupBytes;
    if (MR == 1) prefetch_ahead<kQ8GroupBytes>(wg);
    bool wide = false;
    for (int r = 0; r < MR; ++r) wide |= a.wide[(r0 + r) * a.groups + g] != 0;
    __m256i h0[MR], h1[MR], l0[MR], l1[MR];
    for (int r = 0; r < MR; ++r) h0[r] = h1[r] = l0[r] = l1[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c += 2) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c + 32));
      const __m256i m0 = _mm256_sign_epi8(w0, w0), m1 = _mm256_sign_epi8(w1, w1);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xh = a.hi + (r0 + r) * a.k + g * kGroup + 4 * c;
        h0[r] = _mm256_dpbusd_epi32(h0[r], m0, _mm256_sign_epi8(broadcast4(xh), w0));
        h1[r] = _mm256_dpbusd_epi32(h1[r], m1, _mm256_sign_epi8(broadcast4(xh + 4), w1));
        if (wide) {
          const int8_t* xl = xh + a.lo_offset;
          l0[r] = _mm256_dpbusd_epi32(l0[r], m0, _mm256_sign_epi8(broadcast4(xl), w0));
          l1[r] = _mm256_dpbusd_epi32(l1[r], m1, _mm256_sign_epi8(broadcast4(xl + 4), w1));
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 256)));
    for (int r = 0; r < MR; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(r0 + r) * a.groups + g]));
      const __m256i sum = combine(_mm256_add_epi32(h0[r], h1[r]), _mm256_add_epi32(l0[r], l1[r]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// Two blocks of 8 rows side by side in 512-bit registers (lanes 0-7 block b, 8-15 block b + 1; the
// packing is unchanged): half the activation broadcasts and scale steps per product of the 256-bit
// tiles, faster at 16 rows and more (docs/BENCHMARKS.md). The q8 weights are made unsigned
// by flipping their top bit (w + 128), and 128 * sum(q) is taken off the integer sum: the same
// integers as the 256-bit tiles, without their sign steps.
inline __m512i load_pair(const uint8_t* b0, const uint8_t* b1) {
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1)), 1);
}

inline __m512 halves_pair(const uint8_t* b0, const uint8_t* b1) {  // 8 + 8 fp16 -> 16 floats
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(low),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1)), 1));
}

inline __m512i broadcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

inline __m512i combine_512(__m512i hi, __m512i lo) {
  return _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), hi), lo);
}

template <int64_t kBytes>
inline void prefetch_pair(const uint8_t* g0, const uint8_t* g1) {
  prefetch_ahead<kBytes>(g0);
  prefetch_ahead<kBytes>(g1);
}

template <int MR>
inline void q4_pair_tile(const uint8_t* w0, const uint8_t* w1, const Activations& a, int64_t r0, float* out,
                         int64_t ldo) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* g0 = w0 + g * kQ4GroupBytes;
    const uint8_t* g1 = w1 + g * kQ4GroupBytes;
    if (MR == 1) prefetch_pair<kQ4GroupBytes>(g0, g1);
    bool wide = false;
    for (int r = 0; r < MR; ++r) wide |= a.wide[(r0 + r) * a.groups + g] != 0;
    __m512i h0[MR], h1[MR], l0[MR], l1[MR];
    for (int r = 0; r < MR; ++r) h0[r] = h1[r] = l0[r] = l1[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i packed = load_pair(g0 + 32 * p, g1 + 32 * p);
      const __m512i lo = _mm512_and_si512(packed, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xh = a.hi + (r0 + r) * a.k + g * kGroup;
        h0[r] = _mm512_dpbusd_epi32(h0[r], lo, broadcast4_512(xh + 4 * p));
        h1[r] = _mm512_dpbusd_epi32(h1[r], hi, broadcast4_512(xh + 16 + 4 * p));
        if (wide) {
          const int8_t* xl = xh + a.lo_offset;
          l0[r] = _mm512_dpbusd_epi32(l0[r], lo, broadcast4_512(xl + 4 * p));
          l1[r] = _mm512_dpbusd_epi32(l1[r], hi, broadcast4_512(xl + 16 + 4 * p));
        }
      }
    }
    const __m512 dw = halves_pair(g0 + 128, g1 + 128);
    const __m512 mw = halves_pair(g0 + 144, g1 + 144);
    for (int r = 0; r < MR; ++r) {
      const __m512i sum = combine_512(_mm512_add_epi32(h0[r], h1[r]), _mm512_add_epi32(l0[r], l1[r]));
      const int64_t gi = (r0 + r) * a.groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[gi])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[gi]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <int MR>
inline void q8_pair_tile(const uint8_t* w0, const uint8_t* w1, const Activations& a, int64_t r0, float* out,
                         int64_t ldo) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* g0 = w0 + g * kQ8GroupBytes;
    const uint8_t* g1 = w1 + g * kQ8GroupBytes;
    if (MR == 1) prefetch_pair<kQ8GroupBytes>(g0, g1);
    bool wide = false;
    for (int r = 0; r < MR; ++r) wide |= a.wide[(r0 + r) * a.groups + g] != 0;
    __m512i h0[MR], h1[MR], l0[MR], l1[MR];
    for (int r = 0; r < MR; ++r) h0[r] = h1[r] = l0[r] = l1[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      const __m512i u0 = _mm512_xor_si512(load_pair(g0 + 32 * c, g1 + 32 * c), flip);
      const __m512i u1 = _mm512_xor_si512(load_pair(g0 + 32 * c + 32, g1 + 32 * c + 32), flip);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xh = a.hi + (r0 + r) * a.k + g * kGroup + 4 * c;
        h0[r] = _mm512_dpbusd_epi32(h0[r], u0, broadcast4_512(xh));
        h1[r] = _mm512_dpbusd_epi32(h1[r], u1, broadcast4_512(xh + 4));
        if (wide) {
          const int8_t* xl = xh + a.lo_offset;
          l0[r] = _mm512_dpbusd_epi32(l0[r], u0, broadcast4_512(xl));
          l1[r] = _mm512_dpbusd_epi32(l1[r], u1, broadcast4_512(xl + 4));
        }
      }
    }
    const __m512 dw = halves_pair(g0 + 256, g1 + 256);
    for (int r = 0; r < MR; ++r) {
      const int64_t gi = (r0 + r) * a.groups + g;
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[gi]));
      const __m512i sum = _mm512_sub_epi32(combine_512(_mm512_add_epi32(h0[r], h1[r]), _mm512_add_epi32(l0[r], l1[r])),
                                           _mm512_set1_epi32(128 * a.qsum[gi]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}
#endif

using Tile = void (*)(const uint8_t*, const Activations&, int64_t, float*, int64_t);

// Activation rows a tile: AVX2's 16 registers hold three (four spill, slower at 64 rows and up);
// AVX-512 VL's 32 hold four of the VNNI tiles' five accumulators a row.
#ifdef BATCHGATE_QMATMUL_VNNI
constexpr int64_t kTileRows = 4;
#else
constexpr int64_t kTileRows = 3;
#endif

// The same for two adjacent blocks at once (16 output rows), where the ISA has such tiles, for
// steps of at least kPairMinRows rows: below, a step reads its weights from memory once and the
// one-block tiles' single stream of them is faster.
constexpr int64_t kPairMinRows = 16;
using PairTile = void (*)(const uint8_t*, const uint8_t*, const Activations&, int64_t, float*, int64_t);

struct Kernel {
  int64_t group_bytes;
  Tile tiles[kTileRows];  // 1..kTileRows activation rows at a time
  PairTile pair_tiles[kTileRows];  // all null: one block at a time
};

#ifdef BATCHGATE_QMATMUL_VNNI
constexpr Kernel kQ4 = {kQ4GroupBytes,
                        {q4_tile_vnni<1>, q4_tile_vnni<2>, q4_tile_vnni<3>, q4_tile_vnni<4>},
                        {q4_pair_tile<1>, q4_pair_tile<2>, q4_pair_tile<3>, q4_pair_tile<4>}};
constexpr Kernel kQ8 = {kQ8GroupBytes,
                        {q8_tile_vnni<1>, q8_tile_vnni<2>, q8_tile_vnni<3>, q8_tile_vnni<4>},
                        {q8_pair_tile<1>, q8_pair_tile<2>, q8_pair_tile<3>, q8_pair_tile<4>}};
#else
constexpr Kernel kQ4 = {kQ4GroupBytes, {q4_tile<1>, q4_tile<2>, q4_tile<3>}, {}};
constexpr Kernel kQ8 = {kQ8GroupBytes, {q8_tile<1>, q8_tile<2>, q8_tile<3>}, {}};
#endif

// Small steps (at most kPoolRows rows) on the calling thread and its helpers, where it has them
// (set_matmul_helpers; engine/device/runner.py chooses by measurement): items are blocks of 8 output rows,
// which a helper that was descheduled hands back (steal_pool.h), so no step waits for one.
constexpr int64_t kPoolRows = 4;
static_assert(kPoolRows * kBlockRows <= batchgate_pool::kItemFloats, "an item's result must fit");

struct PoolJob {
  const Kernel* kernel;
  const uint8_t* w;
  Activations acts;
  int64_t m, block_bytes, padded;
  float* out;
};

void pool_compute(const PoolJob& job, int64_t block, float* local) {
  const uint8_t* wb = job.w + block * job.block_bytes;
  for (int64_t r = 0; r < job.m; r += kTileRows)
    job.kernel->tiles[std::min<int64_t>(kTileRows, job.m - r) - 1](wb, job.acts, r, local + r * kBlockRows, kBlockRows);
}

void pool_store(const PoolJob& job, int64_t block, const float* local) {
  for (int64_t r = 0; r < job.m; ++r)
    std::memcpy(job.out + r * job.padded + block * kBlockRows, local + r * kBlockRows, kBlockRows * sizeof(float));
}

using Pool = batchgate_pool::StealPool<PoolJob>;

// The calling thread's pool (each engine thread has its own; helpers end with the thread).
Pool& caller_pool() {
  thread_local Pool pool;
  return pool;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias,
                   double outlier_ratio, const Kernel& kernel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qlinear: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == kernel.group_bytes,
              "qlinear: w must be packed [N / 8, K / 32, ", kernel.group_bytes, "] uint8");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), groups = k / kGroup, blocks = w.size(0);
  TORCH_CHECK(k % kGroup == 0 && w.size(1) == groups, "qlinear: K must match the packed weight");
  TORCH_CHECK(n > (blocks - 1) * kBlockRows && n <= blocks * kBlockRows, "qlinear: n must match w");
  if (m == 0) return at::empty({0, n}, xc.options());  // the LM head of a step that samples nothing
  Pool& pool = caller_pool();
  const bool pooled = m <= kPoolRows && pool.helpers() > 0;
  // Quantized activations: in the pool's scratch on its path (a late helper may still read them).
  at::Tensor bytes, scales, sums;
  int8_t* qp;
  float* dp;
  int32_t* qs;
  if (pooled) {
    const int64_t floats = 3 * m * groups;  // d, s, then the sums (int32, same size)
    float* base = static_cast<float*>(pool.scratch(floats * sizeof(float) + 2 * m * k + m * groups));
    dp = base;
    qs = reinterpret_cast<int32_t*>(base + 2 * m * groups);
    qp = reinterpret_cast<int8_t*>(base + floats);
  } else {
    bytes = at::empty({2 * m * k + m * groups}, xc.options().dtype(at::kChar));
    scales = at::empty({2, m, groups}, xc.options());
    sums = at::empty({m, groups}, xc.options().dtype(at::kInt));
    qp = bytes.data_ptr<int8_t>();
    dp = scales.data_ptr<float>();
    qs = sums.data_ptr<int32_t>();
  }
  uint8_t* flags = reinterpret_cast<uint8_t*>(qp + 2 * m * k);
  float* sp = dp + m * groups;
  const float* xp = xc.data_ptr<float>();
  const float ratio = static_cast<float>(outlier_ratio);
  auto quantize = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_group(xp + i * kGroup, qp + i * kGroup, qp + m * k + i * kGroup, dp + i, sp + i, qs + i, flags + i,
                     ratio);
  };
  if (pooled)
    quantize(0, m * groups);
  else
    at::parallel_for(0, m * groups, 256, quantize);
  const Activations acts{qp, m * k, dp, sp, qs, flags, k, groups};
  const int64_t padded = blocks * kBlockRows;
  at::Tensor out = at::empty({m, padded}, xc.options());
  float* op = out.data_ptr<float>();
  const at::Tensor wc = w.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  // Work items: (chunk of kChunkRows activation rows, span of 1 or 2 blocks of 8 output rows),
  // chunk-major, so a thread's items run each chunk's rows (kept in L2) against one span of weight
  // blocks after another. An odd last block goes alone.
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t span = kernel.pair_tiles[0] != nullptr && m >= kPairMinRows ? 2 : 1;
  const int64_t spans = (blocks + span - 1) / span;
  const int64_t block_bytes = groups * kernel.group_bytes;
  if (pooled) {
    pool.run(PoolJob{&kernel, wp, acts, m, block_bytes, padded, op}, {pool_compute, pool_store}, blocks);
  } else {
    // Threads take items from a counter, not equal ranges: where one is descheduled or slowed (the
    // server and its clients share the cores), the others take on its items instead of waiting.
    const int64_t items = chunks * spans;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t b = (i % spans) * span, first = (i / spans) * kChunkRows;
        const int64_t last = std::min(m, first + kChunkRows);
        const uint8_t* wb = wp + b * block_bytes;
        for (int64_t r = first; r < last; r += kTileRows) {
          const int64_t rows = std::min<int64_t>(kTileRows, last - r);
          float* o = op + r * padded + b * kBlockRows;
          if (span == 2 && b + 1 < blocks)
            kernel.pair_tiles[rows - 1](wb, wb + block_bytes, acts, r, o, padded);
          else
            kernel.tiles[rows - 1](wb, acts, r, o, padded);
        }
      }
    });
  }
  if (padded != n) out = out.narrow(1, 0, n).contiguous();
  if (bias.has_value()) out.add_(*bias);
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias,
                     double outlier_ratio) {
  return qlinear(x, w, n, bias, outlier_ratio, kQ4);
}

// The calling thread's matmul helpers for steps of at most kPoolRows rows (0: OpenMP as for any).
void set_matmul_helpers(int64_t n) {
  TORCH_CHECK(n >= 0 && n < 1024, "set_matmul_helpers: n must be in 0..1023");
  caller_pool().set_helpers(static_cast<int>(n));
}

// Tests: the calling thread's helpers hold each run they compute until released, so that the
// caller must take it back (`at_claim`: the helper that claims a job's first run holds right after
// its claim); returns how many runs the caller took back so far.
int64_t hold_matmul_helpers(bool hold, bool at_claim) {
  caller_pool().hold_helpers(hold, at_claim);
  return caller_pool().taken_back();
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias,
                     double outlier_ratio) {
  return qlinear(x, w, n, bias, outlier_ratio, kQ8);
}

// An expert's rows take the two-block tiles from this many: a decode step's few rows per expert
// (32 streams, top 2 of 8: ~8) run them ~1.7x faster than one block at a time
// (bench/moe_throughput.py), where a whole dense step of that few rows does not (kPairMinRows).
constexpr int64_t kGroupedPairMinRows = kTileRows;

// A mixture-of-experts layer's projection (engine/device/models/moe.py): rows offsets[e] ..
// offsets[e + 1] - 1 of x (the tokens routed to expert e, grouped) times expert e's weight, one
// call for every expert. w: [E, N / 8, K / 32, bytes], each expert packed as qlinear's; bias: none,
// or [E, N] float32. The activations are quantized once; work items are (expert, chunk of its rows,
// span of weight blocks), taken from a counter as qlinear's, so an expert's weights are read once
// for all its rows and experts with no rows cost nothing.
at::Tensor qlinear_grouped(const at::Tensor& x, const at::Tensor& w, int64_t n, const at::Tensor& offsets,
                           const c10::optional<at::Tensor>& bias, double outlier_ratio, const Kernel& kernel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qlinear_grouped: x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kByte && w.size(3) == kernel.group_bytes,
              "qlinear_grouped: w must be packed [E, N / 8, K / 32, ", kernel.group_bytes, "] uint8");
  const int64_t experts = w.size(0), blocks = w.size(1);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.size(0) == experts + 1,
              "qlinear_grouped: offsets must be [E + 1] int64");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->dim() == 2 &&
                                    bias->size(0) == experts && bias->size(1) == n),
              "qlinear_grouped: bias must be [E, N] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && w.size(2) == groups, "qlinear_grouped: K must match the packed weight");
  TORCH_CHECK(n > (blocks - 1) * kBlockRows && n <= blocks * kBlockRows, "qlinear_grouped: n must match w");
  const at::Tensor offs = offsets.contiguous();
  const int64_t* op_rows = offs.data_ptr<int64_t>();
  TORCH_CHECK(op_rows[0] == 0 && op_rows[experts] == m, "qlinear_grouped: offsets must run from 0 to M");
  for (int64_t e = 0; e < experts; ++e) TORCH_CHECK(op_rows[e] <= op_rows[e + 1], "qlinear_grouped: offsets must grow");
  const int64_t padded = blocks * kBlockRows;
  at::Tensor out = at::empty({m, padded}, xc.options());
  if (m == 0) return out.narrow(1, 0, n);
  at::Tensor bytes = at::empty({2 * m * k + m * groups}, xc.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, m, groups}, xc.options());
  at::Tensor sums = at::empty({m, groups}, xc.options().dtype(at::kInt));
  int8_t* qp = bytes.data_ptr<int8_t>();
  float* dp = scales.data_ptr<float>();
  int32_t* qs = sums.data_ptr<int32_t>();
  uint8_t* flags = reinterpret_cast<uint8_t*>(qp + 2 * m * k);
  float* sp = dp + m * groups;
  const float* xp = xc.data_ptr<float>();
  const float ratio = static_cast<float>(outlier_ratio);
  at::parallel_for(0, m * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_group(xp + i * kGroup, qp + i * kGroup, qp + m * k + i * kGroup, dp + i, sp + i, qs + i, flags + i,
                     ratio);
  });
  const Activations acts{qp, m * k, dp, sp, qs, flags, k, groups};
  float* o = out.data_ptr<float>();
  const at::Tensor wc = w.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const int64_t block_bytes = groups * kernel.group_bytes;
  // The items: (expert, first row of a chunk, span start, span length), experts' rows in order.
  struct Item {
    int64_t expert, first, last, block, span;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t lo = op_rows[e], hi = op_rows[e + 1];
    if (lo == hi) continue;
    const int64_t span = kernel.pair_tiles[0] != nullptr && hi - lo >= kGroupedPairMinRows ? 2 : 1;
    for (int64_t first = lo; first < hi; first += kChunkRows)
      for (int64_t b = 0; b < blocks; b += span)
        items.push_back({e, first, std::min(hi, first + kChunkRows), b, span});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& it = items[i];
      const uint8_t* wb = wp + (it.expert * blocks + it.block) * block_bytes;
      for (int64_t r = it.first; r < it.last; r += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, it.last - r);
        float* dst = o + r * padded + it.block * kBlockRows;
        if (it.span == 2 && it.block + 1 < blocks)
          kernel.pair_tiles[rows - 1](wb, wb + block_bytes, acts, r, dst, padded);
        else
          kernel.tiles[rows - 1](wb, acts, r, dst, padded);
      }
    }
  });
  if (padded != n) out = out.narrow(1, 0, n).contiguous();
  if (bias.has_value()) {
    const at::Tensor bc = bias->contiguous();
    const float* bp = bc.data_ptr<float>();
    float* y = out.data_ptr<float>();
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = op_rows[e]; r < op_rows[e + 1]; ++r)
        for (int64_t j = 0; j < n; ++j) y[r * n + j] += bp[e * n + j];
  }
  return out;
}

at::Tensor q4_grouped_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const at::Tensor& offsets,
                             const c10::optional<at::Tensor>& bias, double outlier_ratio) {
  return qlinear_grouped(x, w, n, offsets, bias, outlier_ratio, kQ4);
}

at::Tensor q8_grouped_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const at::Tensor& offsets,
                             const c10::optional<at::Tensor>& bias, double outlier_ratio) {
  return qlinear_grouped(x, w, n, offsets, bias, outlier_ratio, kQ8);
}

#else  // no AVX2: the ops exist (so the library loads) but refuse; the engine never calls them

void set_matmul_helpers(int64_t) {}
int64_t hold_matmul_helpers(bool, bool) { return 0; }

at::Tensor q4_linear(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&, double) {
  TORCH_CHECK(false, "q4_linear: needs AVX2, FMA and F16C");
}
at::Tensor q8_linear(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&, double) {
  TORCH_CHECK(false, "q8_linear: needs AVX2, FMA and F16C");
}
at::Tensor q4_grouped_linear(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                             const c10::optional<at::Tensor>&, double) {
  TORCH_CHECK(false, "q4_grouped_linear: needs AVX2, FMA and F16C");
}
at::Tensor q8_grouped_linear(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                             const c10::optional<at::Tensor>&, double) {
  TORCH_CHECK(false, "q8_grouped_linear: needs AVX2, FMA and F16C");
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgate, m) {
  m.def("q4_linear(Tensor x, Tensor w, int n, Tensor? bias, float outlier_ratio) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor w, int n, Tensor? bias, float outlier_ratio) -> Tensor");
  m.def("q4_grouped_linear(Tensor x, Tensor w, int n, Tensor offsets, Tensor? bias, float outlier_ratio) -> Tensor");
  m.def("q8_grouped_linear(Tensor x, Tensor w, int n, Tensor offsets, Tensor? bias, float outlier_ratio) -> Tensor");
  m.def("has_qmatmul() -> bool", &has_qmatmul);
  m.def("qmatmul_isa() -> str", &qmatmul_isa);
  m.def("set_matmul_helpers(int n) -> ()", &set_matmul_helpers);  // no tensors: catch-all kernels
  m.def("hold_matmul_helpers(bool hold, bool at_claim=False) -> int", &hold_matmul_helpers);
}

TORCH_LIBRARY_IMPL(batchgate, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("q4_grouped_linear", &q4_grouped_linear);
  m.impl("q8_grouped_linear", &q8_grouped_linear);
}
