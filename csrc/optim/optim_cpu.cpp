// CPU kernels of the fused optimizer family. Every list of tensors is cut into fixed chunks (a function of
// the tensor sizes alone); chunks run in parallel, vectorised with at::vec in float (double for double).
// Pass 1 leaves one partial per chunk in a fixed slot and adds them in order: deterministic for any thread count.
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/cpu_convert.h"
#include "common/cpu_utils.h"
#include "common/philox_cpu.h"
#include "optim/optim_args.h"
#include "optim/quantize_cpu.h"
#include "optim/rounding_keys.h"

namespace fused {
namespace {

// max that keeps NaN, like torch's inf-norm (std::max(r, NaN) returns r)
inline double nan_max(double a, double b) { return std::isnan(b) || b > a ? b : a; }

constexpr int64_t kChunk = 32768;  // elements per parallel work item

struct Chunk {
  int64_t tensor, start, len;
};

std::vector<Chunk> make_chunks(at::TensorList ts) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < (int64_t)ts.size(); ++t)
    for (int64_t s = 0; s < ts[t].numel(); s += kChunk) chunks.push_back({t, s, std::min(kChunk, ts[t].numel() - s)});
  return chunks;
}

// Runs body(c, chunk) over every chunk of `ts`, chunks in parallel.
template <typename F> void parallel_chunks(const std::vector<Chunk>& chunks, const F& body) {
  at::parallel_for(0, chunks.size(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) body(c, chunks[c]);
  });
}

const at::Device kCpu(at::kCPU);

// 1 / grad_scale, the reciprocal taken in double as torch's GradScaler does.
float inverse_scale(const std::optional<at::Tensor>& grad_scale, const char* op) {
  if (!grad_scale) return 1.f;
  check_scalar(op, "grad_scale", *grad_scale, kCpu);
  return float(1.0 / double(grad_scale->item<float>()));
}

// ---- pass 1: sum of |g|^p with the finite check ----
enum class Norm { L2, L1, Inf, P };

template <typename T> struct GradIn {
  T inv_scale, clip_value;  // clip_value = inf: no value clipping
  bool clip;
  C10_ALWAYS_INLINE Vec<T> operator()(Vec<T> x) const {
    x = x * Vec<T>(inv_scale);
    if (clip) x = at::vec::clamp(x, Vec<T>(-clip_value), Vec<T>(clip_value));
    return x;
  }
};

template <Norm N, typename T> inline Vec<T> accumulate(Vec<T> acc, Vec<T> x, T p) {
  if constexpr (N == Norm::L2) return fma_once(x, x, acc);
  else if constexpr (N == Norm::L1) return acc + x.abs();
  else if constexpr (N == Norm::Inf) return at::vec::maximum(acc, x.abs());
  else return acc + x.abs().pow(Vec<T>(p));
}

// Returns the chunk's partial; sets nonfinite when an input is inf or NaN.
template <Norm N, typename scalar_t>
double norm_chunk(const scalar_t* g, int64_t n, const GradIn<at::opmath_type<scalar_t>>& in, double p,
                  bool& nonfinite) {
  using T = at::opmath_type<scalar_t>;
  using V = Vec<T>;
  V acc(0), nan_probe(0);
  T buf[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t len = std::min(kBlock, n - i);
    const T* x;
    if constexpr (std::is_same_v<scalar_t, T>) x = g + i;
    else {
      widen_block(g + i, buf, len);
      x = buf;
    }
    int64_t k = 0;
    for (; k + V::size() <= len; k += V::size()) {
      V v = V::loadu(x + k);
      nan_probe = nan_probe + (v - v);  // NaN exactly when some v is inf or NaN
      acc = accumulate<N>(acc, in(v), T(p));
    }
    if (k < len) {
      V v = V::loadu(x + k, len - k);  // zero-filled tail: adds nothing to any norm
      nan_probe = nan_probe + (v - v);
      acc = accumulate<N>(acc, in(v), T(p));
    }
  }
  T lanes[V::size()], probe[V::size()];
  acc.store(lanes);
  nan_probe.store(probe);
  double r = 0;
  for (int64_t l = 0; l < V::size(); ++l) {
    if (std::isnan(probe[l])) nonfinite = true;
    r = N == Norm::Inf ? nan_max(r, double(lanes[l])) : r + double(lanes[l]);
  }
  return r;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_norm_cpu(at::TensorList grads,
                                                             const std::optional<at::Tensor>& found_inf,
                                                             const std::optional<at::Tensor>& grad_scale,
                                                             double norm_type, double max_norm, double clip_value,
                                                             bool finish) {
  const char* op = "grad_norm";
  check_floating_list(op, "grads", grads, kCpu);
  if (found_inf) check_scalar(op, "found_inf", *found_inf, kCpu);
  check_norm_args(op, norm_type, max_norm, clip_value);
  const float inv = inverse_scale(grad_scale, op);
  const Norm kind = norm_type == 2 ? Norm::L2 : norm_type == 1 ? Norm::L1 : std::isinf(norm_type) ? Norm::Inf : Norm::P;

  const auto chunks = make_chunks(grads);
  std::vector<double> partial(chunks.size(), 0.0);
  std::vector<char> nonfinite(chunks.size(), 0);
  parallel_chunks(chunks, [&](int64_t c, const Chunk& ch) {
    const at::Tensor& g = grads[ch.tensor];
    bool nf = false;
    FUSED_DISPATCH_FLOATING(g.scalar_type(), "grad_norm", [&] {
      using T = at::opmath_type<scalar_t>;
      const GradIn<T> in{T(inv), T(clip_value), !std::isinf(clip_value)};
      const scalar_t* gp = g.const_data_ptr<scalar_t>() + ch.start;
      switch (kind) {
        case Norm::L2: partial[c] = norm_chunk<Norm::L2>(gp, ch.len, in, norm_type, nf); break;
        case Norm::L1: partial[c] = norm_chunk<Norm::L1>(gp, ch.len, in, norm_type, nf); break;
        case Norm::Inf: partial[c] = norm_chunk<Norm::Inf>(gp, ch.len, in, norm_type, nf); break;
        case Norm::P: partial[c] = norm_chunk<Norm::P>(gp, ch.len, in, norm_type, nf); break;
      }
    });
    nonfinite[c] = nf;
  });
  double acc = 0;
  bool any_nonfinite = false;
  for (size_t c = 0; c < chunks.size(); ++c) {  // fixed order
    acc = kind == Norm::Inf ? nan_max(acc, partial[c]) : acc + partial[c];
    any_nonfinite |= nonfinite[c] != 0;
  }
  if (found_inf && found_inf->item<float>() != 0.f) any_nonfinite = true;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor found = at::scalar_tensor(any_nonfinite ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat));
  if (!finish) return {at::scalar_tensor(acc, f64), at::empty({0}, f64), found};
  double norm = kind == Norm::L2                        ? std::sqrt(acc)
                : kind == Norm::L1 || kind == Norm::Inf ? acc
                                                        : std::pow(acc, 1.0 / norm_type);
  // inf and NaN propagate into the norm (and a NaN norm into the coefficient) as in torch's clip_grad_norm_.
  const double coef = std::isinf(max_norm) ? 1.0 : std::isnan(norm) ? norm : std::min(1.0, max_norm / (norm + 1e-6));
  return {at::scalar_tensor(norm, at::TensorOptions().dtype(norm_dtype(grads))), at::scalar_tensor(coef, f64), found};
}

void scale_grads_cpu(at::TensorList grads, const at::Tensor& clip_coef) {
  const char* op = "scale_grads_";
  check_floating_list(op, "grads", grads, kCpu);
  check_scalar(op, "clip_coef", clip_coef, kCpu, at::kDouble);
  const double coef = clip_coef.item<double>();
  parallel_chunks(make_chunks(grads), [&](int64_t, const Chunk& ch) {
    FUSED_DISPATCH_FLOATING(grads[ch.tensor].scalar_type(), "scale_grads_", [&] {
      using T = at::opmath_type<scalar_t>;
      scalar_t* gp = grads[ch.tensor].data_ptr<scalar_t>() + ch.start;
      T buf[kBlock];
      for (int64_t i = 0; i < ch.len; i += kBlock) {
        const int64_t len = std::min(kBlock, ch.len - i);
        widen_block(gp + i, buf, len);
        vec_map(buf, len, [&](auto v) { return v * decltype(v)(T(coef)); });
        store_block(buf, gp + i, len);
      }
    });
  });
}

// ---- pass 2: the updates ----
// What an update reads besides its lists: the inverse loss scale, the clip coefficient, and whether the
// gradient is written back (write_grads, and only where the step changes it: a loss scale, value or norm
// clipping). None when found_inf is set: the step is skipped whole.
struct UpdateScalars {
  float inv;
  double coef, clip_value;
  bool write_back;
};
std::optional<UpdateScalars> update_scalars(const char* op, const at::Tensor& clip_coef,
                                            const std::optional<at::Tensor>& grad_scale, const at::Tensor& found_inf,
                                            double clip_value, bool write_grads) {
  check_nonneg(op, "clip_value", clip_value);
  check_scalar(op, "clip_coef", clip_coef, kCpu, at::kDouble);
  check_scalar(op, "found_inf", found_inf, kCpu);
  const float inv = inverse_scale(grad_scale, op);
  if (found_inf.item<float>() != 0.f) return std::nullopt;
  const double coef = clip_coef.item<double>();
  return UpdateScalars{inv, coef, clip_value, write_grads && (inv != 1.f || !std::isinf(clip_value) || coef != 1.0)};
}

// The gradient as the update sees it: clipped() is unscaled, value-clipped and norm-clipped (what write_grads
// stores back into .grad, as torch's recipe unscale_ + clip_grad_value_ + clip_grad_norm_ leaves it); signed_()
// then negates it under maximize.
template <typename T> struct GradTransform {
  GradIn<T> in;
  T coef;
  bool maximize;
  C10_ALWAYS_INLINE Vec<T> clipped(Vec<T> g) const { return in(g) * Vec<T>(coef); }
  C10_ALWAYS_INLINE Vec<T> signed_(Vec<T> g) const { return maximize ? Vec<T>(0) - g : g; }
  // clipped() and signed_() return g unchanged (their factors are exactly 1)
  bool identity() const { return in.inv_scale == T(1) && !in.clip && coef == T(1) && !maximize; }
  static GradTransform of(const UpdateScalars& s, bool maximize) {
    return {{T(s.inv), T(s.clip_value), !std::isinf(s.clip_value)}, T(s.coef), maximize};
  }
};

// body(vector index i, count) over [0, n): full vectors, then the tail (count < size).
template <typename T, typename F> inline void for_vectors(int64_t n, const F& body) {
  int64_t i = 0;
  for (; i + Vec<T>::size() <= n; i += Vec<T>::size()) body(i, Vec<T>::size());
  if (i < n) body(i, n - i);
}
// cnt elements at p in the math type, and back (16-bit: widened and rounded to nearest in registers).
template <typename S> C10_ALWAYS_INLINE Vec<at::opmath_type<S>> ld(const S* p, int64_t cnt) {
  return load_math<at::opmath_type<S>>(p, cnt);
}
template <typename S> C10_ALWAYS_INLINE void st(Vec<at::opmath_type<S>> v, S* p, int64_t cnt) { store_math(v, p, cnt); }
// The cnt gradient elements at g as an update takes them: clipped (and stored back at g when write_back), then signed.
template <typename T, typename G>
C10_ALWAYS_INLINE Vec<T> grad_taken(const GradTransform<T>& tr, G* g, int64_t cnt, bool write_back) {
  const Vec<T> c = tr.clipped(ld(g, cnt));
  if (write_back) st(c, g, cnt);
  return tr.signed_(c);
}

// Stochastic rounding of float to bf16: add 16 random bits below the bf16 mantissa, truncate. Unbiased: a value
// a fraction f of the way from one bf16 neighbour to the next rounds up with probability f. Parameters (and model
// copies): element i of tensor t uses the top 16 bits of Philox4x32-10 word i % 4 of counter i / 4 under key
// rounding_key(seed, t) (optim/rounding_keys.h). bf16 optimizer state takes the 8-bit codes' dither words
// (dither_word, a few integer ops where Philox takes ten rounds of multiplies): element i takes word i / 2 under
// its moment's key, the high half for even i and the low half for odd i. The CUDA and Triton kernels draw the same
// bits.
struct Rounding {
  bool stochastic = false;
  uint64_t key = 0;         // this tensor's key
  bool half_words = false;  // the state's dither words, two elements a word (else the parameters' Philox words)
};

// x rounded to bf16 with the addend r (16 bits below the bf16 mantissa): inf stays inf, NaN becomes the quiet NaN.
inline uint16_t bf16_rounded(float x, uint32_t r) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t((x != x ? 0x7FC00000u : bits + r) >> 16);
}
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
inline __m256i bf16_rounded(__m512 x, __m512i r) {  // 16 lanes
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r),
                                             _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
inline __m128i bf16_rounded(__m256 x, __m256i r) {  // 8 lanes
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i bits = _mm256_srli_epi32(
      _mm256_blendv_epi8(_mm256_add_epi32(_mm256_castps_si256(x), r), _mm256_set1_epi32(0x7FC00000), nan), 16);
  // the high halves (< 2^16, so the unsigned saturation keeps them) as 8 bf16
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}
#endif

// cnt <= FloatVec::size() lanes of x rounded to bf16 stochastically, element l taking half_word(words, e + l) (e
// even; the state's dither words) or with whole words the top half of words[e + l] (the parameters' Philox words),
// as Rounding describes.
template <bool kHalfWords = true>
inline void store_bf16_dithered(FloatVec x, at::BFloat16* dst, int64_t cnt, const uint32_t* words, int64_t e) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  if (cnt == 16) {
    const __m512i r = kHalfWords ? half_word_lanes(words, e) : _mm512_srli_epi32(_mm512_loadu_si512(words + e), 16);
    return _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_rounded(__m512(x), r));
  }
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  if (cnt == 8) {
    const __m256i r = kHalfWords
                          ? half_word_lanes(words, e)
                          : _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + e)), 16);
    return _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bf16_rounded(__m256(x), r));
  }
#endif
  alignas(64) float f[FloatVec::size()];
  x.store(f);
  for (int64_t l = 0; l < cnt; ++l) {
    const uint32_t r = kHalfWords ? half_word(words, e + l) : words[e + l] >> 16;
    dst[l] = c10::BFloat16(bf16_rounded(f[l], r), c10::BFloat16::from_bits());
  }
}

// n floats rounded to bf16 stochastically, vector by vector (store_bf16_dithered), with the words of `key` for
// tensor elements index0.. (index0 a multiple of 8: chunks and blocks start at multiples of 1024).
void store_bf16_stochastic(const float* src, at::BFloat16* dst, int64_t index0, int64_t n, uint64_t key,
                           bool half_words) {
  TORCH_INTERNAL_ASSERT(index0 % 8 == 0);
  const int64_t per_call = half_words ? 512 : 256;  // elements of 256 words
  alignas(64) uint32_t words[256];
  for (int64_t j = 0; j < n; j += per_call) {
    if (half_words) dither_words(key, uint64_t(index0 + j) / 2, words, 256);
    else philox64(uint64_t(index0 + j) / 4, key, words);
    for_vectors<float>(std::min(per_call, n - j), [&](int64_t e, int64_t cnt) {
      const FloatVec x = ld(src + j + e, cnt);
      if (half_words) store_bf16_dithered<true>(x, dst + j + e, cnt, words, e);
      else store_bf16_dithered<false>(x, dst + j + e, cnt, words, e);
    });
  }
}

// One tensor of an update as run_chunk walks it: whether it is written back, how a bf16 copy is rounded, and for
// 8-bit state (int8 / uint8 codes) its per-block scales.
struct Operand {
  const at::Tensor* t = nullptr;
  bool write = false;
  Rounding rnd{};
  const at::Tensor* scales = nullptr;
};

// Converts n elements of o from element `offset` into the math type, and back (bf16 stochastically if asked; 8-bit
// codes block by block, offset a multiple of 256).
template <typename T> void load_any(const Operand& o, int64_t offset, T* dst, int64_t n) {
  const at::Tensor& t = *o.t;
  if constexpr (std::is_same_v<T, float>) {
    if (t.scalar_type() == at::kChar)
      return dequantize(t.const_data_ptr<int8_t>(), o.scales->const_data_ptr<float>(), offset, dst, n);
    if (t.scalar_type() == at::kByte)
      return dequantize(t.const_data_ptr<uint8_t>(), o.scales->const_data_ptr<float>(), offset, dst, n);
  }
  FUSED_DISPATCH_FLOATING(t.scalar_type(), "optim_load",
                          [&] { widen_block(t.const_data_ptr<scalar_t>() + offset, dst, n); });
}
template <typename T> void store_any(const T* src, const Operand& o, int64_t offset, int64_t n) {
  const at::Tensor& t = *o.t;
  if constexpr (std::is_same_v<T, float>) {
    if (o.rnd.stochastic && t.scalar_type() == at::kBFloat16)
      return store_bf16_stochastic(src, t.data_ptr<at::BFloat16>() + offset, offset, n, o.rnd.key, o.rnd.half_words);
    if (t.scalar_type() == at::kChar)
      return quantize(src, t.data_ptr<int8_t>(), o.scales->data_ptr<float>(), offset, n);
    if (t.scalar_type() == at::kByte) {
      DitherWords dither(o.rnd.key);
      return quantize(src, t.data_ptr<uint8_t>(), o.scales->data_ptr<float>(), offset, n,
                      o.rnd.stochastic ? &dither : nullptr);
    }
  }
  FUSED_DISPATCH_FLOATING(t.scalar_type(), "optim_store",
                          [&] { store_block(src, t.data_ptr<scalar_t>() + offset, n); });
}

// One block of an update's operands as its loops take them: the parameter p (k = 0) and the gradient g (k = 1) in
// their storage types P and G, the state s[k] (k >= 2) in the math type T, and with master weights the 16-bit
// model copy (M; M = T: none, or written by run_chunk). Float memory is used in place; 16-bit memory is widened
// and rounded (to nearest) by the loops, vector by vector in registers, so that every operand streams from memory
// in the same loop; other memory goes through L1 buffers.
template <typename T, typename P, typename G, typename M, int K> struct Block {
  using Math = T;
  P* p;
  G* g;
  std::array<T*, K> s;  // s[0], s[1]: unused
  M* model;
  const uint32_t* p_words;  // a bf16 p rounded stochastically: the block's Philox words, one an element (else null)
  // the new parameter of elements i.. i + cnt - 1, and its rounded copy in the model
  C10_ALWAYS_INLINE void put_p(Vec<T> v, int64_t i, int64_t cnt) const {
    if constexpr (std::is_same_v<P, at::BFloat16>) {
      if (p_words) return store_bf16_dithered<false>(v, p + i, cnt, p_words, i);
    }
    st(v, p + i, cnt);
    if constexpr (!std::is_same_v<M, T>) st(v, model + i, cnt);
  }
};

inline bool is_16bit(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Runs body(Block, len, offset) over chunk ch of the K operands (k = 0: the parameter, k = 1: the gradient; null
// tensors stay null), block by block in the math type T (double for double params, else float). Each tensor has
// its own dtype: p and g of one 16-bit dtype, or float p with a 16-bit g, are passed as they are (Block); other
// memory not in T goes through L1 buffers (only operands marked `write` are stored back). A bf16 parameter rounded
// stochastically takes store_bf16_stochastic's bits either way. With master weights, `model` (16-bit) receives the
// rounded parameter and is never read.
template <int K, typename F>
void run_chunk(const std::array<Operand, K>& ops, const at::Tensor* model, const Chunk& ch, const F& body) {
  auto run = [&](auto math_tag, auto p_tag, auto g_tag, auto model_tag) {
    using T = decltype(math_tag);
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    using M = decltype(model_tag);
    T buf[K][kBlock];
    alignas(64) uint32_t p_words[kBlock];
    const bool p_stochastic = std::is_same_v<P, at::BFloat16> && ops[0].rnd.stochastic;
    for (int64_t i = 0; i < ch.len; i += kBlock) {
      const int64_t len = std::min(kBlock, ch.len - i), off = ch.start + i;
      std::array<T*, K> b{};
      for (int k = 0; k < K; ++k) {
        const at::Tensor* t = ops[k].t;
        if (!t || (k == 0 && !std::is_same_v<P, T>) || (k == 1 && !std::is_same_v<G, T>)) continue;
        if (t->scalar_type() == c10::CppTypeToScalarType<T>::value)
          b[k] = (ops[k].write ? t->template data_ptr<T>() : const_cast<T*>(t->template const_data_ptr<T>())) + off;
        else {
          load_any(ops[k], off, buf[k], len);
          b[k] = buf[k];
        }
      }
      auto direct = [&](auto tag, const at::Tensor* t, T* in_math) {
        using S = decltype(tag);
        if constexpr (std::is_same_v<S, T>) return in_math;
        else return t ? t->template data_ptr<S>() + off : nullptr;
      };
      if (p_stochastic)  // store_bf16_stochastic's words: element e of a call takes word e
        for (int64_t j = 0; j < len; j += 256) philox64(uint64_t(off + j) / 4, ops[0].rnd.key, p_words + j);
      body(Block<T, P, G, M, K>{direct(P{}, ops[0].t, b[0]), direct(G{}, ops[1].t, b[1]), b,
                                direct(M{}, model, nullptr), p_stochastic ? p_words : nullptr},
           len, off);
      for (int k = 0; k < K; ++k)
        if (ops[k].t && ops[k].write && b[k] == buf[k]) store_any(buf[k], ops[k], off, len);
      if constexpr (std::is_same_v<P, T> && std::is_same_v<M, T>)
        if (model) store_any(b[0], Operand{model}, off, len);
    }
  };
  const at::ScalarType p_type = ops[0].t->scalar_type();
  const at::ScalarType g_type = ops[1].t ? ops[1].t->scalar_type() : p_type;
  if (p_type == at::kDouble) return run(double{}, double{}, double{}, double{});
  const bool p16 = is_16bit(p_type);  // stochastic rounding: bf16 only (put_p)
  // master weights: a model copy of the gradient's dtype is written in registers
  const bool model_as_g = model && model->scalar_type() == g_type;
  if (p16 && g_type == at::kBFloat16 && p_type == g_type) run(float{}, at::BFloat16{}, at::BFloat16{}, float{});
  else if (p16 && g_type == at::kHalf && p_type == g_type) run(float{}, at::Half{}, at::Half{}, float{});
  else if (!p16 && g_type == at::kBFloat16)
    model_as_g ? run(float{}, float{}, at::BFloat16{}, at::BFloat16{}) : run(float{}, float{}, at::BFloat16{}, float{});
  else if (!p16 && g_type == at::kHalf)
    model_as_g ? run(float{}, float{}, at::Half{}, at::Half{}) : run(float{}, float{}, at::Half{}, float{});
  else run(float{}, float{}, float{}, float{});
}

// The rounding of tensor `tensor`'s parameter (k = 0) or its k-th state tensor: stochastic for bf16 when a seed
// is given, each with its own key.
Rounding rounding_for(const std::optional<uint64_t>& seed, int64_t tensor, int k = 0) {
  if (!seed) return {};
  return {true, rounding_key(*seed, tensor, k), k > 0};
}

// The checks the SGD and Adam kernels share: parameters, gradients (with master weights, alongside the model
// params) and the seed.
std::optional<uint64_t> check_update(const char* op, at::TensorList params, at::TensorList grads,
                                     at::TensorList model_params, const std::optional<at::Tensor>& sr_seed) {
  check_floating_list(op, "params", params, kCpu);
  check_update_lists(op, params, grads, model_params);
  return seed_value(op, sr_seed);
}

void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::TensorList steps, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                  const at::Tensor& clip_coef, const std::optional<at::Tensor>& grad_scale, const at::Tensor& found_inf,
                  double clip_value, at::TensorList model_params, const std::optional<at::Tensor>& sr_seed,
                  const std::optional<at::Tensor>& hyper, bool write_grads) {
  const char* op = "sgd_step_";
  const auto seed = check_update(op, params, grads, model_params, sr_seed);
  const bool use_momentum = momentum != 0;
  // (lr, momentum, dampening, weight_decay) per tensor
  const auto hp = hyper_rows<4>(op, hyper, params.size(), {lr, momentum, dampening, weight_decay});
  for (const auto& h : hp) check_sgd_hyper(op, h, nesterov, use_momentum);
  if (use_momentum) {
    check_list(op, "momentum_buffers", bufs, params);
    check_steps(op, steps, params.size(), kCpu);
  }
  const auto s = update_scalars(op, clip_coef, grad_scale, found_inf, clip_value, write_grads);
  if (!s) return;
  std::vector<char> first(params.size(), 0);
  if (use_momentum)
    for (size_t i = 0; i < params.size(); ++i) first[i] = *steps[i].const_data_ptr<float>() == 0.f;

  parallel_chunks(make_chunks(params), [&](int64_t, const Chunk& ch) {
    const int64_t t = ch.tensor;
    const bool is_first = first[t];
    const double lr = hp[t][0], momentum = hp[t][1], dampening = hp[t][2], weight_decay = hp[t][3];
    run_chunk<3>({Operand{&params[t], true, rounding_for(seed, t)}, Operand{&grads[t], s->write_back},
                  Operand{use_momentum ? &bufs[t] : nullptr, true}},
                 model_params.empty() ? nullptr : &model_params[t], ch, [&](auto b, int64_t len, int64_t) {
                   using T = typename decltype(b)::Math;
                   using V = Vec<T>;
                   const auto tr = GradTransform<T>::of(*s, maximize);
                   for_vectors<T>(len, [&](int64_t i, int64_t cnt) {
                     V p = ld(b.p + i, cnt);
                     V d = grad_taken(tr, b.g + i, cnt, s->write_back);
                     if (weight_decay != 0) d = fma_once(p, V(T(weight_decay)), d);
                     if (use_momentum) {
                       V buf = is_first ? d : fma_once(ld(b.s[2] + i, cnt), V(T(momentum)), d * V(T(1 - dampening)));
                       st(buf, b.s[2] + i, cnt);
                       d = nesterov ? fma_once(buf, V(T(momentum)), d) : buf;
                     }
                     b.put_p(fma_once(d, V(T(-lr)), p), i, cnt);
                   });
                 });
  });
  for (const auto& s : steps) *s.data_ptr<float>() += 1.f;  // CPU scalars: no dispatch per tensor
}

// Adam's arithmetic on one vector of one tensor, shared by the float loops and the 8-bit one (the same ops, so the
// same bits). Scalars, broadcast where used (the loops hoist the broadcasts).
template <typename T> struct AdamMath {
  using V = Vec<T>;
  T b1c, b2, b2c, eps, weight_decay, decay, neg_step, inv_bc2;
  bool decays, decoupled;
  static AdamMath of(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                     double step_size, double bc2_sqrt) {
    return {T(1 - beta1),  T(beta2),        T(1 - beta2),      T(eps),   T(weight_decay), T(1 - lr * weight_decay),
            T(-step_size), T(1 / bc2_sqrt), weight_decay != 0, decoupled};
  }
  // weight decay: p decayed in place (AdamW) or the L2 penalty added to the gradient g
  C10_ALWAYS_INLINE V decay_into(V& p, V g) const {
    if (decays) {
      if (decoupled) p = p * V(decay);
      else g = fma_once(p, V(weight_decay), g);
    }
    return g;
  }
  C10_ALWAYS_INLINE void moments(V g, V& m, V& v) const {
    m = fma_once(g - m, V(b1c), m);
    v = fma_once(g * g, V(b2c), v * V(b2));
  }
  // root: sqrt(v) (of max(v_max, v) with amsgrad: the root keeps the order)
  C10_ALWAYS_INLINE V stepped(V p, V m, V root) const {
    return fma_once(V(neg_step), m / fma_once(root, V(inv_bc2), V(eps)), p);
  }
};

// The gradient of cnt elements at g as the moments take it, the parameter p decayed in place (AdamW) or its L2
// penalty added. kPlain: the gradient as it is (no loss scale, clipping, maximize or write-back: their factors are
// exactly 1), two multiplies a vector fewer; else clipped and signed (grad_taken).
template <bool kPlain, typename G>
C10_ALWAYS_INLINE FloatVec update_grad(const AdamMath<float>& math, const GradTransform<float>& tr, FloatVec& p, G* g,
                                       int64_t cnt, bool write_back) {
  if constexpr (kPlain) return math.decay_into(p, ld(g, cnt));
  return math.decay_into(p, grad_taken(tr, g, cnt, write_back));
}

// The update of elements [offset, offset + len) of 8-bit moments (offset a multiple of 256), b the parameter and
// gradient of those elements (run_chunk's Block), one quantization block at a time. Each vector of a block decodes m
// and sqrt(v), updates them and the parameter, and leaves the new moments in L1 until the block's scales (their
// max) are known; then they are encoded, a full block's two codes in one loop (encode_block_pair). AdamMath's
// arithmetic, as in the float loops.
// v_dither: the stochastic rounding of exp_avg_sq's codes (null: to nearest).
// kPlain: update_grad's (in a loop that the multiply ports bound). Out of line, so that the loop gets registers of
// its own rather than the caller's spills.
template <bool kPlain, typename B>
C10_NOINLINE void adam_codes(const AdamMath<float> math, const GradTransform<float> tr, const bool write_back,
                             const B& b, const at::Tensor& m_codes, const at::Tensor& m_scales,
                             const at::Tensor& v_codes, const at::Tensor& v_scales, int64_t offset, int64_t len,
                             DitherWords* v_dither) {
  using V = FloatVec;
  int8_t* const m_code0 = m_codes.data_ptr<int8_t>() + offset;
  uint8_t* const v_code0 = v_codes.data_ptr<uint8_t>() + offset;
  float* const m_scale0 = m_scales.data_ptr<float>() + offset / kQuantBlock;
  float* const v_scale0 = v_scales.data_ptr<float>() + offset / kQuantBlock;
  for (int64_t q = 0; q < len; q += kQuantBlock) {
    const int64_t n = std::min(kQuantBlock, len - q);
    int8_t* const mq = m_code0 + q;
    uint8_t* const vq = v_code0 + q;
    float* const m_scale = m_scale0 + q / kQuantBlock;
    float* const v_scale = v_scale0 + q / kQuantBlock;
    const V ms = code_step<int8_t>(*m_scale), vs = code_step<uint8_t>(*v_scale);
    alignas(64) float m_new[kQuantBlock], root_new[kQuantBlock];
    V m_max(0.f), root_max(0.f);
    for_vectors<float>(n, [&](int64_t i, int64_t cnt) C10_ALWAYS_INLINE_ATTRIBUTE {
      V pv = ld(b.p + q + i, cnt);
      const V gv = update_grad<kPlain>(math, tr, pv, b.g + q + i, cnt, write_back);
      V m = decode(mq + i, cnt, ms), root = decode(vq + i, cnt, vs);
      V v = root * root;
      math.moments(gv, m, v);
      root = v.sqrt();
      b.put_p(math.stepped(pv, m, root), q + i, cnt);
      if (cnt < V::size()) {  // lanes past the block stay out of its max
        m = V::set(V(0.f), m, cnt);
        root = V::set(V(0.f), root, cnt);
      }
      m.store(m_new + i);
      root.store(root_new + i);
      m_max = max_magnitude(m_max, m);
      root_max = max_magnitude(root_max, root);
    });
    const float am = *m_scale = block_scale(m_max), av = *v_scale = block_scale(root_max);
    const uint32_t* const words = v_dither ? v_dither->block(offset + q) : nullptr;
    if (n == kQuantBlock && usable_pair(am, av)) {
      if (words) encode_block_pair<true>(m_new, mq, am, root_new, vq, av, words);
      else encode_block_pair<false>(m_new, mq, am, root_new, vq, av, nullptr);
    } else {
      encode_block(m_new, mq, am, n);
      encode_block(root_new, vq, av, n, words);
    }
  }
}

// The update of elements [offset, offset + len) of bf16 moments (offset a multiple of 8), b the parameter and
// gradient of those elements (run_chunk's Block): each vector's moments widened, updated and rounded in registers
// (with keys stochastically, store_bf16_stochastic's bits; else to nearest), not through float copies in L1. AdamMath's
// arithmetic, as in the float loops; the step takes the moments before rounding, as there. keys: the moments' (exp_avg,
// exp_avg_sq and with kAmsgrad max_exp_avg_sq, whose v_max is also bf16). kPlain: update_grad's.
template <bool kPlain, bool kAmsgrad, typename B>
C10_NOINLINE void adam_bf16_moments(const AdamMath<float> math, const GradTransform<float> tr, const bool write_back,
                                    const B& b, const std::array<at::BFloat16*, 3> moments, int64_t offset, int64_t len,
                                    const std::optional<std::array<uint64_t, 3>> keys) {
  using V = FloatVec;
  TORCH_INTERNAL_ASSERT(offset % 8 == 0);
  constexpr int64_t kWordsElements = 512;  // the elements of 256 dither words
  alignas(64) uint32_t words[kAmsgrad ? 3 : 2][256];
  at::BFloat16 *const m = moments[0], *const v = moments[1], *const v_max = moments[2];
  for (int64_t j = 0; j < len; j += kWordsElements) {
    if (keys)
      for (int k = 0; k < (kAmsgrad ? 3 : 2); ++k) dither_words((*keys)[k], uint64_t(offset + j) / 2, words[k], 256);
    // moment k of elements i.. rounded to bf16: stochastically (with keys), else to nearest
    auto put = [&](V x, int k, at::BFloat16* dst, int64_t e, int64_t cnt) C10_ALWAYS_INLINE_ATTRIBUTE {
      if (keys) store_bf16_dithered(x, dst, cnt, words[k], e);
      else st(x, dst, cnt);
    };
    for_vectors<float>(std::min(kWordsElements, len - j), [&](int64_t e, int64_t cnt) C10_ALWAYS_INLINE_ATTRIBUTE {
      const int64_t i = j + e;
      V pv = ld(b.p + i, cnt);
      const V gv = update_grad<kPlain>(math, tr, pv, b.g + i, cnt, write_back);
      V mv = ld(m + i, cnt), vv = ld(v + i, cnt);
      math.moments(gv, mv, vv);
      put(mv, 0, m + i, e, cnt);
      put(vv, 1, v + i, e, cnt);
      if constexpr (kAmsgrad) {
        vv = at::vec::maximum(ld(v_max + i, cnt), vv);
        put(vv, 2, v_max + i, e, cnt);
      }
      b.put_p(math.stepped(pv, mv, vv.sqrt()), i, cnt);
    });
  }
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                   at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                   double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                   const at::Tensor& clip_coef, const std::optional<at::Tensor>& grad_scale,
                   const at::Tensor& found_inf, double clip_value, at::TensorList model_params,
                   const std::optional<at::Tensor>& sr_seed, const std::optional<at::Tensor>& hyper, bool write_grads,
                   const OptionalTensorList& exp_avg_scales, const OptionalTensorList& exp_avg_sq_scales,
                   const OptionalTensorList& max_exp_avg_sq_scales, const std::optional<at::Tensor>& state_seed) {
  const char* op = "adam_step_";
  const auto seed = check_update(op, params, grads, model_params, sr_seed);
  const auto state_key = seed_value(op, state_seed, "state_seed");
  const at::TensorList m_scales = or_empty(exp_avg_scales), v_scales = or_empty(exp_avg_sq_scales),
                       max_scales = or_empty(max_exp_avg_sq_scales);
  check_state_list(op, "exp_avgs", exp_avgs, params, at::kChar, m_scales);
  check_state_list(op, "exp_avg_sqs", exp_avg_sqs, params, at::kByte, v_scales);
  if (amsgrad) {
    check_state_list(op, "max_exp_avg_sqs", max_exp_avg_sqs, params, at::kByte, max_scales);
    for (size_t i = 0; i < params.size(); ++i)  // the update keeps both in one domain: v, or sqrt(v) for codes
      TORCH_CHECK((exp_avg_sqs[i].scalar_type() == at::kByte) == (max_exp_avg_sqs[i].scalar_type() == at::kByte),
                  "fused.", op, ": exp_avg_sqs[", i, "] and max_exp_avg_sqs[", i,
                  "] must both be uint8 codes or both not, got ", exp_avg_sqs[i].scalar_type(), " and ",
                  max_exp_avg_sqs[i].scalar_type());
  }
  check_steps(op, steps, params.size(), kCpu);
  // (lr, beta1, beta2, eps, weight_decay) per tensor
  const auto hp = hyper_rows<5>(op, hyper, params.size(), {lr, beta1, beta2, eps, weight_decay});
  for (const auto& h : hp) check_adam_hyper(op, h);
  const auto s = update_scalars(op, clip_coef, grad_scale, found_inf, clip_value, write_grads);
  if (!s) return;
  // Per tensor, from its step count after this step (bias corrections in double, as torch does).
  std::vector<double> step_size(params.size()), bc2_sqrt(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double step = *steps[i].const_data_ptr<float>() + 1.0;
    step_size[i] = hp[i][0] / (1 - std::pow(hp[i][1], step));
    bc2_sqrt[i] = std::sqrt(1 - std::pow(hp[i][2], step));
  }

  parallel_chunks(make_chunks(params), [&](int64_t, const Chunk& ch) {
    const int64_t t = ch.tensor;
    const double lr = hp[t][0], beta1 = hp[t][1], beta2 = hp[t][2], eps = hp[t][3], weight_decay = hp[t][4];
    // 8-bit exp_avg_sq (and max_exp_avg_sq) codes load and store sqrt(v) (quantize_cpu.h)
    const bool v_root = exp_avg_sqs[t].scalar_type() == at::kByte;
    // 8-bit moments without amsgrad: decoded and encoded by the update itself (adam_codes below), not buffered
    const bool codes = exp_avgs[t].scalar_type() == at::kChar && v_root && !amsgrad;
    // stochastic rounding where a seed is given: bf16 state, and exp_avg_sq's codes (not exp_avg's, whose moves of
    // (1 - beta1) of the gradient are not lost to rounding, nor max_exp_avg_sq's, a max rather than an average)
    const bool max_codes = amsgrad && max_exp_avg_sqs[t].scalar_type() == at::kByte;
    // bf16 moments: widened and rounded by the update itself (adam_bf16_moments below), not buffered
    const bool bf16_moments = params[t].scalar_type() != at::kDouble && exp_avgs[t].scalar_type() == at::kBFloat16 &&
                              exp_avg_sqs[t].scalar_type() == at::kBFloat16 &&
                              (!amsgrad || max_exp_avg_sqs[t].scalar_type() == at::kBFloat16);
    auto state = [&](int k, at::TensorList ts, at::TensorList scales) {
      if ((codes && k < 3) || bf16_moments) return Operand{};
      return Operand{&ts[t], true, k == 3 && max_codes ? Rounding{} : rounding_for(state_key, t, k),
                     scales.empty() ? nullptr : &scales[t]};
    };
    run_chunk<5>(
        {Operand{&params[t], true, rounding_for(seed, t)}, Operand{&grads[t], s->write_back},
         state(1, exp_avgs, m_scales), state(2, exp_avg_sqs, v_scales),
         amsgrad ? state(3, max_exp_avg_sqs, max_scales) : Operand{}},
        model_params.empty() ? nullptr : &model_params[t], ch, [&](auto b, int64_t len, int64_t off) {
          using T = typename decltype(b)::Math;
          using V = Vec<T>;
          const auto tr = GradTransform<T>::of(*s, maximize);
          const auto math = AdamMath<T>::of(lr, beta1, beta2, eps, weight_decay, decoupled, step_size[t], bc2_sqrt[t]);
          // the gradient element i.. as the moments take it (written back clipped), p decayed in place
          auto grad_at = [&](V& p, int64_t i, int64_t cnt) {
            return math.decay_into(p, grad_taken(tr, b.g + i, cnt, s->write_back));
          };
          if constexpr (std::is_same_v<T, float>) {
            using B = decltype(b);
            const bool plain_grad = tr.identity() && !s->write_back;
            if (codes) {
              std::optional<DitherWords> v_dither;
              if (state_key) v_dither.emplace(rounding_key(*state_key, t, 2));
              (plain_grad ? adam_codes<true, B> : adam_codes<false, B>)(math, tr, s->write_back, b, exp_avgs[t],
                                                                        m_scales[t], exp_avg_sqs[t], v_scales[t], off,
                                                                        len, v_dither ? &*v_dither : nullptr);
              return;
            }
            if (bf16_moments) {
              auto moment = [&](at::TensorList ts) { return ts[t].data_ptr<at::BFloat16>() + off; };
              const std::array<at::BFloat16*, 3> moments{moment(exp_avgs), moment(exp_avg_sqs),
                                                         amsgrad ? moment(max_exp_avg_sqs) : nullptr};
              std::optional<std::array<uint64_t, 3>> keys;
              if (state_key)
                keys = {rounding_key(*state_key, t, 1), rounding_key(*state_key, t, 2), rounding_key(*state_key, t, 3)};
              auto update = plain_grad
                                ? (amsgrad ? adam_bf16_moments<true, true, B> : adam_bf16_moments<true, false, B>)
                                : (amsgrad ? adam_bf16_moments<false, true, B> : adam_bf16_moments<false, false, B>);
              update(math, tr, s->write_back, b, moments, off, len, keys);
              return;
            }
          }
          // the common step (no loss scale, clipping, maximize, write-back or amsgrad, fp32 state): the
          // gradient as it is, without those branches (their factors are exactly 1), in a loop of its own. The
          // loop bodies are forced inline: in this large caller GCC otherwise calls them once a vector (the fp32
          // step measured 0.75 against 0.49 ns per element).
          const bool plain = tr.identity() && !s->write_back && !amsgrad && !v_root;
          if (plain) {
            for_vectors<T>(len, [&](int64_t i, int64_t cnt) C10_ALWAYS_INLINE_ATTRIBUTE {
              V p = ld(b.p + i, cnt);
              V m = ld(b.s[2] + i, cnt), v = ld(b.s[3] + i, cnt);
              math.moments(math.decay_into(p, ld(b.g + i, cnt)), m, v);
              st(m, b.s[2] + i, cnt);
              st(v, b.s[3] + i, cnt);
              b.put_p(math.stepped(p, m, v.sqrt()), i, cnt);
            });
            return;
          }
          for_vectors<T>(len, [&](int64_t i, int64_t cnt) C10_ALWAYS_INLINE_ATTRIBUTE {
            V p = ld(b.p + i, cnt);
            V m = ld(b.s[2] + i, cnt), v = ld(b.s[3] + i, cnt);
            if (v_root) v = v * v;  // 8-bit codes (with amsgrad) hold the root of v
            math.moments(grad_at(p, i, cnt), m, v);
            st(m, b.s[2] + i, cnt);
            V root;
            if (v_root) {
              root = v.sqrt();
              st(root, b.s[3] + i, cnt);
              if (amsgrad) st(root = at::vec::maximum(ld(b.s[4] + i, cnt), root), b.s[4] + i, cnt);
            } else {
              st(v, b.s[3] + i, cnt);
              if (amsgrad) st(v = at::vec::maximum(ld(b.s[4] + i, cnt), v), b.s[4] + i, cnt);
              root = v.sqrt();
            }
            b.put_p(math.stepped(p, m, root), i, cnt);
          });
        });
  });
  for (const auto& s : steps) *s.data_ptr<float>() += 1.f;  // CPU scalars: no dispatch per tensor
}

// accs += grads (accs = grads when overwrite): the fp32 accumulation of 16-bit micro-batch gradients.
void accumulate_grads_cpu(at::TensorList accs, at::TensorList grads, bool overwrite) {
  check_accumulate("accumulate_grads_", accs, grads, kCpu);
  parallel_chunks(make_chunks(accs), [&](int64_t, const Chunk& ch) {
    run_chunk<2>({Operand{&accs[ch.tensor], true}, Operand{&grads[ch.tensor]}}, nullptr, ch,
                 [&](auto b, int64_t len, int64_t) {
                   for_vectors<typename decltype(b)::Math>(len, [&](int64_t i, int64_t cnt) {
                     st(overwrite ? ld(b.g + i, cnt) : ld(b.p + i, cnt) + ld(b.g + i, cnt), b.p + i, cnt);
                   });
                 });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) { FUSED_OPTIM_OPS(FUSED_IMPL_CPU) }

}  // namespace fused
