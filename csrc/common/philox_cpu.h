// Philox4x32-10 (philox.h) on the CPU, 64 consecutive counters at a time: with AVX-512 or AVX2 one counter per
// 32-bit lane, elsewhere one at a time. The same words as philox4x32_10, so CPU and CUDA kernels draw the same bits.
#pragma once
#include <cstdint>

#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
#include <immintrin.h>
#endif

#include "common/philox.h"

namespace fused {

// philox64(counter0, key, words): words[4 * l + k] is word k of counter counter0 + l, for l in [0, 64).
#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
// 16 32-bit lanes
struct PhiloxLanes {
  using V = __m512i;
  static constexpr int kLanes = 16;
  static V load(const uint32_t* p) { return _mm512_load_si512(p); }
  static void store(uint32_t* p, V v) { _mm512_store_si512(p, v); }
  static V set1(uint32_t x) { return _mm512_set1_epi32(int(x)); }
  static V zero() { return _mm512_setzero_si512(); }
  static V xor3(V a, V b, V c) { return _mm512_xor_si512(_mm512_xor_si512(a, b), c); }
  // (hi, lo) 32-bit halves of the 32x32-bit products a * m in every lane
  static void mulhilo(V a, V m, V& hi, V& lo) {
    const V even = _mm512_mul_epu32(a, m);  // lanes 0, 2, ...: 64-bit products
    const V odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), _mm512_srli_epi64(m, 32));
    hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
    lo = _mm512_mullo_epi32(a, m);
  }
};
#else
// 8 32-bit lanes
struct PhiloxLanes {
  using V = __m256i;
  static constexpr int kLanes = 8;
  static V load(const uint32_t* p) { return _mm256_load_si256(reinterpret_cast<const V*>(p)); }
  static void store(uint32_t* p, V v) { _mm256_store_si256(reinterpret_cast<V*>(p), v); }
  static V set1(uint32_t x) { return _mm256_set1_epi32(int(x)); }
  static V zero() { return _mm256_setzero_si256(); }
  static V xor3(V a, V b, V c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  static void mulhilo(V a, V m, V& hi, V& lo) {
    const V even = _mm256_mul_epu32(a, m);
    const V odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(m, 32));
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    lo = _mm256_mullo_epi32(a, m);
  }
};
#endif

// 64 counters, one a lane: 64 / kLanes independent states, so the multiplies of one round overlap.
inline void philox64(uint64_t counter0, uint64_t key, uint32_t words[256]) {
  using L = PhiloxLanes;
  using V = L::V;
  constexpr int W = L::kLanes, G = 64 / W;
  alignas(64) uint32_t lo32[64], hi32[64];
  for (int l = 0; l < 64; ++l) {
    const uint64_t c = counter0 + uint64_t(l);
    lo32[l] = uint32_t(c);
    hi32[l] = uint32_t(c >> 32);
  }
  V c0[G], c1[G], c2[G], c3[G];
  for (int g = 0; g < G; ++g) {
    c0[g] = L::load(lo32 + W * g);
    c1[g] = L::load(hi32 + W * g);
    c2[g] = c3[g] = L::zero();
  }
  const V m0 = L::set1(0xD2511F53u), m1 = L::set1(0xCD9E8D57u);
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
  for (int r = 0; r < 10; ++r) {
    const V vk0 = L::set1(k0), vk1 = L::set1(k1);
    for (int g = 0; g < G; ++g) {
      V hi0, lo0, hi1, lo1;
      L::mulhilo(c0[g], m0, hi0, lo0);  // D2511F53 * c0
      L::mulhilo(c2[g], m1, hi1, lo1);  // CD9E8D57 * c2
      c0[g] = L::xor3(hi1, c1[g], vk0);
      c2[g] = L::xor3(hi0, c3[g], vk1);
      c1[g] = lo1;
      c3[g] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // words in element order: element 4 * l + k takes word k of counter l
  for (int g = 0; g < G; ++g) {
    alignas(64) uint32_t w[4][W];
    L::store(w[0], c0[g]);
    L::store(w[1], c1[g]);
    L::store(w[2], c2[g]);
    L::store(w[3], c3[g]);
    for (int l = 0; l < W; ++l)
      for (int k = 0; k < 4; ++k) words[4 * W * g + 4 * l + k] = w[k][l];
  }
}
#else
inline void philox64(uint64_t counter0, uint64_t key, uint32_t words[256]) {
  for (int l = 0; l < 64; ++l) {
    const Philox4 w = philox4x32_10(counter0 + uint64_t(l), key);
    for (int k = 0; k < 4; ++k) words[4 * l + k] = w.v[k];
  }
}
#endif

}  // namespace fused
