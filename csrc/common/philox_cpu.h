// Philox4x32-10 (philox.h) on the CPU, 64 consecutive counters at a time: with AVX-512 one counter per 32-bit lane,
// elsewhere one at a time. The same words as philox4x32_10, so CPU and CUDA kernels draw the same bits.
#pragma once
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common/philox.h"

namespace fused {

// philox64(counter0, key, words): words[4 * l + k] is word k of counter counter0 + l, for l in [0, 64).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
// (hi, lo) 32-bit halves of the 32x32-bit products a * m in every lane.
inline void mulhilo16(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);  // lanes 0, 2, ...: 64-bit products
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), _mm512_srli_epi64(m, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  lo = _mm512_mullo_epi32(a, m);
}

// 64 counters: four independent 16-lane states, so the multiplies of one round overlap.
inline void philox64(uint64_t counter0, uint64_t key, uint32_t words[256]) {
  constexpr int G = 4;
  alignas(64) uint32_t lo32[16 * G], hi32[16 * G];
  for (int l = 0; l < 16 * G; ++l) {
    const uint64_t c = counter0 + uint64_t(l);
    lo32[l] = uint32_t(c);
    hi32[l] = uint32_t(c >> 32);
  }
  __m512i c0[G], c1[G], c2[G], c3[G];
  for (int g = 0; g < G; ++g) {
    c0[g] = _mm512_load_si512(lo32 + 16 * g);
    c1[g] = _mm512_load_si512(hi32 + 16 * g);
    c2[g] = c3[g] = _mm512_setzero_si512();
  }
  const __m512i m0 = _mm512_set1_epi32(int(0xD2511F53u)), m1 = _mm512_set1_epi32(int(0xCD9E8D57u));
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
  for (int r = 0; r < 10; ++r) {
    const __m512i vk0 = _mm512_set1_epi32(int(k0)), vk1 = _mm512_set1_epi32(int(k1));
    for (int g = 0; g < G; ++g) {
      __m512i hi0, lo0, hi1, lo1;
      mulhilo16(c0[g], m0, hi0, lo0);  // D2511F53 * c0
      mulhilo16(c2[g], m1, hi1, lo1);  // CD9E8D57 * c2
      c0[g] = _mm512_xor_si512(_mm512_xor_si512(hi1, c1[g]), vk0);
      c2[g] = _mm512_xor_si512(_mm512_xor_si512(hi0, c3[g]), vk1);
      c1[g] = lo1;
      c3[g] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // words in element order: element 4 * l + k takes word k of counter l
  for (int g = 0; g < G; ++g) {
    alignas(64) uint32_t w[4][16];
    _mm512_store_si512(w[0], c0[g]);
    _mm512_store_si512(w[1], c1[g]);
    _mm512_store_si512(w[2], c2[g]);
    _mm512_store_si512(w[3], c3[g]);
    for (int l = 0; l < 16; ++l)
      for (int k = 0; k < 4; ++k) words[64 * g + 4 * l + k] = w[k][l];
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
