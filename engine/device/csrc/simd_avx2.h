// AVX2 helpers shared by the kernels (kernels.cpp, qmatmul_x86.cpp): horizontal reductions of one
// register. Include only where __AVX2__ is defined; engine/device/native.py digests this file with the
// sources, so a change here rebuilds the cache.
#pragma once

#include <immintrin.h>

namespace batchgate_simd {

// The sum of the 8 lanes: upper half plus lower half, then within 128 bits.
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The largest of the 8 lanes, in the same steps.
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

}  // namespace batchgate_simd
