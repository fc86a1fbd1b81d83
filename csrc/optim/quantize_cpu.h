// 8-bit Adam state (fused.optim state_dtype="int8"): blocks of 256 elements in flat memory order, one float32
// scale each. Both codes are square maps, which give small values finer steps than a linear map and cost one
// multiply to decode (no table lookup):
//   exp_avg (int8, signed):      m = sign(q) * (q / 127)^2 * a,   a = max |m| of the block (the stored scale)
//   exp_avg_sq (uint8, on sqrt): sqrt(v) = (q / 255)^2 * u,       u = max sqrt(v) of the block (the stored scale)
// Coding sqrt(v) rather than v halves its exponent range (so a small v is not coded to 0 while its m is not, which
// would make the update m / eps), and the update needs sqrt(v) anyway. Encoding rounds q to nearest (even) in the
// square-root domain: |m' - m| <= a (2 r + 1/254) / 254 with r = sqrt(|m| / a), and the same for sqrt(v) with 255.
// The update writes exp_avg_sq's codes rounded stochastically instead (dithered_code): v moves by (1 - beta2) of
// itself a step, far less than a code step where the block's scale is high, so round to nearest would return the
// same code every step and v would stay where it was (after one gradient spike, for the thousands of steps beta2
// takes to forget it); rounded up with the right probability, v follows Adam's average in expectation.
// A block whose scale is 0, inf or NaN stores codes 0 and that scale: all-zero blocks decode to 0, non-finite
// ones to NaN. quantize()/dequantize() exchange the coded value: exp_avg itself, and for exp_avg_sq its square
// root, which the update divides by anyway (so the root is taken once per step, in the update). fused/optim/quantize.py
// computes the same bits in torch (state dict loading, dequantize_state).
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>

#include "common/vec_math.h"
#include "optim/rounding_keys.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace fused {

constexpr int64_t kQuantBlock = 256;

inline bool usable_scale(float a) { return a > 0.f && a <= std::numeric_limits<float>::max(); }

using FloatVec = at::vec::Vectorized<float>;

// FloatVec::size() codes to floats, and integral floats (within the code's range) to codes: one vector each.
template <typename code_t> inline FloatVec load_codes(const code_t* q) {
  constexpr bool kSigned = std::is_signed_v<code_t>;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  alignas(64) float f[FloatVec::size()];
  for (int64_t i = 0; i < FloatVec::size(); ++i) f[i] = float(q[i]);
  return FloatVec::loadu(f);
#endif
}
template <typename code_t> inline void store_codes(FloatVec r, code_t* q) {
  constexpr bool kSigned = std::is_signed_v<code_t>;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m512i i = _mm512_cvtps_epi32(r);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), kSigned ? _mm512_cvtsepi32_epi8(i) : _mm512_cvtusepi32_epi8(i));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  const __m256i i = _mm256_cvtps_epi32(r);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));  // 8 x int16
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), kSigned ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w));
#else
  alignas(64) float f[FloatVec::size()];
  r.store(f);
  for (int64_t i = 0; i < FloatVec::size(); ++i) q[i] = code_t(f[i]);
#endif
}

// 4 * FloatVec::size() codes from four vectors of integral floats: one 32-byte store on AVX2 (the packs work per
// 128-bit lane, so a last permute puts the four vectors' codes back in order).
template <typename code_t> inline void store_codes4(const FloatVec* r, code_t* q) {
#if defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__) && !defined(CPU_CAPABILITY_AVX512)
  const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(r[0]), _mm256_cvtps_epi32(r[1]));
  const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(r[2]), _mm256_cvtps_epi32(r[3]));
  const __m256i bytes = std::is_signed_v<code_t> ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
#else
  for (int k = 0; k < 4; ++k) store_codes(r[k], q + k * FloatVec::size());
#endif
}
// Running maxima of magnitudes, NaN kept: max(acc, |x|) lane by lane, acc starting at 0. With the sign cleared,
// a float's bits order as integers as the values do, and any NaN's bits are above inf's: one integer max.
inline FloatVec max_magnitude(FloatVec acc, FloatVec x) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_castps_si512(acc), _mm512_castps_si512(x.abs())));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  return _mm256_castsi256_ps(_mm256_max_epi32(_mm256_castps_si256(acc), _mm256_castps_si256(x.abs())));
#else
  return at::vec::maximum(acc, x.abs());
#endif
}

// The scale of a block of coded values: the max of their magnitudes, NaN if any is NaN, from a vector of running
// maxima (max_magnitude).
// With AVX2 / AVX-512 the maxima are integer maxima of the bits (max_magnitude), and so is their reduction: a few
// shuffles, where a loop over the lanes is a chain of compares that the next block's update waits behind.
inline float block_scale(FloatVec running_max) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  return c10::bit_cast<float>(_mm512_reduce_max_epi32(_mm512_castps_si512(running_max)));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  __m256i m = _mm256_castps_si256(running_max);
  m = _mm256_max_epi32(m, _mm256_permute2x128_si256(m, m, 1));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return c10::bit_cast<float>(_mm256_cvtsi256_si32(m));
#else
  float lanes[FloatVec::size()];
  running_max.store(lanes);
  float a = 0.f;
  for (int64_t l = 0; l < FloatVec::size(); ++l) a = std::isnan(lanes[l]) || lanes[l] > a ? lanes[l] : a;
  return a;
#endif
}

// The half-word layout of the dither words (the 8-bit codes' and bf16 moments'): element i takes the 16-bit half
// i % 2 of words[i / 2], the high half for even i.
inline uint32_t half_word(const uint32_t* words, int64_t i) {
  return i % 2 ? words[i / 2] & 0xFFFFu : words[i / 2] >> 16;
}
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
// half_word of elements e.. e + 15 (e even), one a 32-bit lane
inline __m512i half_word_lanes(const uint32_t* words, int64_t e) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + e / 2));
  return _mm512_cvtepu16_epi32(_mm256_rol_epi32(w, 16));  // each word's halves swapped: the high half first
}
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
// half_word of elements e.. e + 7 (e even), one a 32-bit lane
inline __m256i half_word_lanes(const uint32_t* words, int64_t e) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + e / 2));
  return _mm256_cvtepu16_epi32(_mm_or_si128(_mm_srli_epi32(w, 16), _mm_slli_epi32(w, 16)));
}
#endif

// The dither of elements e.. e + FloatVec::size() - 1 of a block (e even): (2 h + 1) / 2^17 in (0, 1), h their
// half_word; as h 2^-16 + 2^-17 in one fma, which is exact (the value has 17 significant bits).
inline FloatVec dither_lanes(const uint32_t* words, int64_t e) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m512 h = _mm512_cvtepi32_ps(half_word_lanes(words, e));
  return _mm512_fmadd_ps(h, _mm512_set1_ps(0x1p-16f), _mm512_set1_ps(0x1p-17f));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  const __m256 h = _mm256_cvtepi32_ps(half_word_lanes(words, e));
  return _mm256_fmadd_ps(h, _mm256_set1_ps(0x1p-16f), _mm256_set1_ps(0x1p-17f));
#else
  alignas(64) float u[FloatVec::size()];
  for (int64_t l = 0; l < FloatVec::size(); ++l) u[l] = float(2 * half_word(words, e + l) + 1) * 0x1p-17f;
  return FloatVec::loadu(u);
#endif
}

// The uint8 code of t = sqrt(sqrt(v) / u) * 255 in [0, 255] (u the block's max sqrt(v)) for a dither d in (0, 1):
// c = floor(t), rounded up when d ((c + 1)^4 - c^4) < t^4 - c^4, so that the decoded v = (code / 255)^4 u^2 is v
// on average. t < 1 takes d = 1/16 (up when t > 1/2: round to nearest, ties to even), so that no v that round to
// nearest codes nonzero is coded 0 (the update would divide m by eps alone). The CUDA and Triton kernels take the
// same steps (no product left to contract into an fma).
inline FloatVec dithered_code(FloatVec t, FloatVec d) {
  using V = FloatVec;
  const V c = t.floor(), c2 = c * c, c4 = c2 * c2, next = c + V(1.f), next2 = next * next, t2 = t * t;
  const V gap = fms_once(next2, next2, c4), above = fms_once(t2, t2, c4);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  // the comparisons' masks used as they are (at::vec widens them to vectors and back)
  const __m512 dither = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, V(0.f), _CMP_EQ_OQ), d, V(0.0625f));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_mul_ps(dither, gap), above, _CMP_LT_OQ), c, next);
#else
  const V dither = V::blendv(d, V(0.0625f), c == V(0.f));
  return V::blendv(c, next, dither * gap < above);
#endif
}

// The codes of coded values x (elements e.. of a block) from r = |x| / a: round(sqrt(r) * levels), signed like x
// for int8 (levels 127), as it is for uint8 (levels 255, x >= 0); kDithered (uint8): dithered_code with the block's
// dither words.
template <typename code_t, bool kDithered>
C10_ALWAYS_INLINE FloatVec code_of(FloatVec x, FloatVec r, const uint32_t* words, int64_t e) {
  using V = FloatVec;
  constexpr bool kSigned = std::is_signed_v<code_t>;
  const V t = r.sqrt() * V(kSigned ? 127.f : 255.f);
  if constexpr (kDithered) return dithered_code(t, dither_lanes(words, e));
  const V code = t.round();
  return kSigned ? code | (x & V(-0.f)) : code;  // -0 codes as 0
}

// Codes of one block of n <= 256 coded values x (exp_avg, or sqrt(exp_avg_sq)) under scale a (block_scale):
// code_of, all 0 when a is 0, inf or NaN. With dither words (uint8 only; 128 words, dither_lanes' layout):
// dithered.
template <typename code_t>
inline void encode_block(const float* x, code_t* q, float a, int64_t n, const uint32_t* words = nullptr) {
  using V = FloatVec;
  constexpr bool kSigned = std::is_signed_v<code_t>;
  constexpr int64_t kLanes = V::size();
  if (!usable_scale(a)) {
    std::memset(q, 0, n * sizeof(code_t));
    return;
  }
  // |x| / a as |x| * (1 / a), but for a denormal a, whose inverse overflows
  const float inv = 1.f / a;
  const V va(a), vinv(inv);
  // the loops for one (by_inverse, dithered) pair, so that neither is tested a vector
  auto encode = [&](auto by_inverse, auto dithered) {
    // the code of elements e.. of the block
    auto code = [&](const V v, int64_t e) C10_ALWAYS_INLINE_ATTRIBUTE {
      const V mag = kSigned ? v.abs() : v;
      return code_of<code_t, dithered>(v, by_inverse ? mag * vinv : mag / va, words, e);
    };
    int64_t i = 0;
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      const V codes[4] = {code(V::loadu(x + i), i), code(V::loadu(x + i + kLanes), i + kLanes),
                          code(V::loadu(x + i + 2 * kLanes), i + 2 * kLanes),
                          code(V::loadu(x + i + 3 * kLanes), i + 3 * kLanes)};
      store_codes4(codes, q + i);
    }
    for (; i < n; i += kLanes) {
      const int64_t cnt = std::min(kLanes, n - i);
      const V code_v = code(cnt == kLanes ? V::loadu(x + i) : V::loadu(x + i, cnt), i);
      if (cnt == kLanes) store_codes(code_v, q + i);
      else {
        code_t tail[kLanes];
        store_codes(code_v, tail);
        std::memcpy(q + i, tail, cnt * sizeof(code_t));
      }
    }
  };
  using Yes = std::true_type;
  using No = std::false_type;
  const bool by_inverse = inv <= std::numeric_limits<float>::max();
  if (!kSigned && words) by_inverse ? encode(Yes{}, Yes{}) : encode(No{}, Yes{});
  else by_inverse ? encode(Yes{}, No{}) : encode(No{}, No{});
}

// encode_block of a whole block of exp_avg (int8) and one of sqrt(exp_avg_sq) (uint8, dithered where words are
// given) in one loop, the two codes' arithmetic interleaved: the same codes (code_of) as two encode_block calls.
// Only for scales that are usable and invertible (usable_pair); encode_block takes the rest.
inline bool usable_pair(float am, float av) {
  return usable_scale(am) && usable_scale(av) && 1.f / am <= std::numeric_limits<float>::max() &&
         1.f / av <= std::numeric_limits<float>::max();
}
template <bool kDithered>
inline void encode_block_pair(const float* m, int8_t* m_codes, float am, const float* root, uint8_t* root_codes,
                              float av, const uint32_t* words) {
  using V = FloatVec;
  constexpr int64_t kLanes = V::size();
  const V inv_m(1.f / am), inv_root(1.f / av);
  for (int64_t i = 0; i < kQuantBlock; i += 4 * kLanes) {
    V cm[4], cr[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t e = i + k * kLanes;
      const V x = V::loadu(m + e), r = V::loadu(root + e);
      cm[k] = code_of<int8_t, false>(x, x.abs() * inv_m, nullptr, e);
      cr[k] = code_of<uint8_t, kDithered>(r, r * inv_root, words, e);
    }
    store_codes4(cm, m_codes + i);
    store_codes4(cr, root_codes + i);
  }
}

// words[w] = dither_word(key, j0 + w) for w < count (a multiple of 8): eight words a vector with AVX2 or AVX-512.
inline void dither_words(uint64_t key, uint64_t j0, uint32_t* words, int count) {
#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
  if (uint32_t(j0) <= 0xFFFFFFFFu - uint32_t(count - 1)) {  // one high half for all: no multiple of 2^32 crossed
    const __m256i base = _mm256_set1_epi32(int(uint32_t(key) + uint32_t(j0 >> 32) * kDitherHighStep));
    const __m256i high = _mm256_set1_epi32(int(uint32_t(key >> 32)));
    const __m256i m1 = _mm256_set1_epi32(0x7FEB352D), m2 = _mm256_set1_epi32(int(0x846CA68Bu));
    __m256i j = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(j0))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int w = 0; w < count; w += 8, j = _mm256_add_epi32(j, _mm256_set1_epi32(8))) {
      __m256i x = _mm256_add_epi32(j, base);
      x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), m1);
      x = _mm256_xor_si256(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)), high);
      x = _mm256_mullo_epi32(x, m2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + w), _mm256_xor_si256(x, _mm256_srli_epi32(x, 16)));
    }
    return;
  }
#endif
  for (int w = 0; w < count; ++w) words[w] = dither_word(key, j0 + w);
}

// The dither words of a tensor's blocks under its key: the 128 words of the block from element e0 (a multiple of
// 256), words[w] = dither_word(key, e0 / 2 + w).
class DitherWords {
 public:
  explicit DitherWords(uint64_t key) : key_(key) {}
  const uint32_t* block(int64_t e0) {
    dither_words(key_, uint64_t(e0) / 2, words_, 128);
    return words_;
  }

 private:
  uint64_t key_;
  alignas(64) uint32_t words_[128];
};

// Codes and scale of one block of n <= 256 coded values (dither words: see encode_block).
template <typename code_t>
inline void quantize_block(const float* x, code_t* q, float* scale, int64_t n, const uint32_t* words = nullptr) {
  using V = FloatVec;
  V vmax(0.f);
  for (int64_t i = 0; i < n; i += V::size()) {
    const V v = i + V::size() <= n ? V::loadu(x + i) : V::loadu(x + i, n - i);
    vmax = max_magnitude(vmax, v);
  }
  *scale = block_scale(vmax);
  encode_block(x, q, *scale, n, words);
}

// cnt <= FloatVec::size() codes as floats (those past cnt: 0).
template <typename code_t> inline FloatVec load_codes(const code_t* q, int64_t cnt) {
  if (cnt == FloatVec::size()) return load_codes(q);
  code_t tail[FloatVec::size()] = {};
  std::memcpy(tail, q, cnt * sizeof(code_t));
  return load_codes(tail);
}

// The coded values (exp_avg, or sqrt(exp_avg_sq)) of cnt codes of a block whose scale a gave step = code_step(a):
// int8 c -> c |c| a / 127^2, uint8 c -> c^2 a / 255^2.
template <typename code_t> inline FloatVec code_step(float scale) {
  return FloatVec(scale / (std::is_signed_v<code_t> ? 16129.f : 65025.f));
}
template <typename code_t> inline FloatVec decode(const code_t* q, int64_t cnt, FloatVec step) {
  const FloatVec c = load_codes(q, cnt);
  return (std::is_signed_v<code_t> ? c * c.abs() : c * c) * step;
}

// The coded values of one block.
template <typename code_t> inline void dequantize_block(const code_t* q, float scale, float* x, int64_t n) {
  using V = FloatVec;
  constexpr int64_t kLanes = V::size();
  const V s = code_step<code_t>(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t cnt = std::min(kLanes, n - i);
    const V value = decode(q + i, cnt, s);
    if (cnt == kLanes) value.store(x + i);
    else value.store(x + i, cnt);
  }
}

// n coded values from element `offset` (a multiple of 256) of a tensor's codes and scales.
template <typename code_t>
inline void dequantize(const code_t* codes, const float* scales, int64_t offset, float* x, int64_t n) {
  for (int64_t b = 0; b < n; b += kQuantBlock)
    dequantize_block(codes + offset + b, scales[(offset + b) / kQuantBlock], x + b, std::min(kQuantBlock, n - b));
}
// dither: the DitherWords of the tensor's stochastic rounding (uint8 only), or null to round to nearest.
template <typename code_t>
inline void quantize(const float* x, code_t* codes, float* scales, int64_t offset, int64_t n,
                     DitherWords* dither = nullptr) {
  for (int64_t b = 0; b < n; b += kQuantBlock)
    quantize_block(x + b, codes + offset + b, scales + (offset + b) / kQuantBlock, std::min(kQuantBlock, n - b),
                   dither ? dither->block(offset + b) : nullptr);
}

}  // namespace fused
