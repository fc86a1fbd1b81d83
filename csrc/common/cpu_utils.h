// Helpers shared by the CPU kernels: the dtype dispatch, argument checks with the op's name, blocked parallel loops
// over flat elements (converted to the op's math type in an L1-sized buffer), and a deterministic column reduction.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "common/huge_pages.h"
#include "common/vec_math.h"

// The kernels' dtypes: body instantiated for scalar_t = float, double, at::Half, at::BFloat16 (math in
// at::opmath_type<scalar_t>).
#define FUSED_DISPATCH_FLOATING(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)

namespace fused {

constexpr int64_t kBlock = 1024;  // elements per buffer: 4-8 KB, stays in L1

// ---- conversion between storage and math types ----
template <typename scalar_t, typename T> inline void load_block(const scalar_t* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, T>) std::copy(src, src + n, dst);
  else at::vec::convert(src, dst, n);
}
template <typename T, typename scalar_t> inline void store_block(const T* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, T>) {
    if (src != dst) std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}
// m <= Vec<T>::size() elements of src as a Vec<T> in the math type (lanes past m: 0), converted in registers.
template <typename T, typename scalar_t> C10_ALWAYS_INLINE Vec<T> load_math(const scalar_t* src, int64_t m) {
  using V = Vec<T>;
  if constexpr (std::is_same_v<scalar_t, T>) {
    return m == V::size() ? V::loadu(src) : V::loadu(src, m);
  } else {
    static_assert(std::is_same_v<T, float>, "16-bit storage computes in float");
    V v;
    if (m == V::size()) {
      at::vec::load_to_float(src, v);
    } else {
      scalar_t tail[V::size()] = {};
      std::copy(src, src + m, tail);
      at::vec::load_to_float(tail, v);
    }
    return v;
  }
}
// m <= Vec<T>::size() lanes of x into dst in the storage type, in registers: 16-bit rounded to nearest even, as
// at::vec::convert rounds (a NaN stays a NaN).
template <typename T, typename scalar_t> C10_ALWAYS_INLINE void store_math(Vec<T> x, scalar_t* dst, int64_t m) {
  using V = Vec<T>;
  if constexpr (std::is_same_v<scalar_t, T>) {
    if (m == V::size()) x.store(dst);
    else x.store(dst, m);
  } else {
    static_assert(std::is_same_v<T, float>, "16-bit storage computes in float");
#if (defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)) || (defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__))
    if (m == V::size()) {
      const auto bits = std::is_same_v<scalar_t, at::BFloat16> ? at::vec::cvtfp32_bf16(x) : at::vec::cvtfp32_fp16(x);
      std::memcpy(dst, &bits, sizeof(bits));
      return;
    }
#endif
    alignas(64) T lanes[V::size()];
    x.store(lanes);
    for (int64_t l = 0; l < m; ++l) dst[l] = c10::convert<scalar_t>(lanes[l]);
  }
}

// The block buffer to compute in: the output itself when it holds the math type (one pass less through L1),
// else `local`.
template <typename T, typename scalar_t> inline T* work_buffer(scalar_t* out, T* local) {
  if constexpr (std::is_same_v<scalar_t, T>) return out;
  else return local;
}

// An input block in the math type: the input itself when it already is one (no copy), else converted into
// `local`.
template <typename T, typename scalar_t> inline const T* math_view(const scalar_t* src, T* local, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, T>) {
    return src;
  } else {
    at::vec::convert(src, local, n);
    return local;
  }
}

// dst[k] = f(a[k]) with f taking and returning Vectorized<T>; dst may be a.
template <typename T, typename F> inline void vec_map_to(T* dst, const T* a, int64_t n, const F& f) {
  using V = Vec<T>;
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) f(V::loadu(a + i)).store(dst + i);
  if (i < n) f(V::loadu(a + i, n - i)).store(dst + i, n - i);
}
// dst[k] = f(a[k], b[k]); dst may be a or b.
template <typename T, typename F> inline void vec_map2_to(T* dst, const T* a, const T* b, int64_t n, const F& f) {
  using V = Vec<T>;
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) f(V::loadu(a + i), V::loadu(b + i)).store(dst + i);
  if (i < n) f(V::loadu(a + i, n - i), V::loadu(b + i, n - i)).store(dst + i, n - i);
}
// dst[k] = f(a[k], b[k], c[k]).
template <typename T, typename F>
inline void vec_map3_to(T* dst, const T* a, const T* b, const T* c, int64_t n, const F& f) {
  using V = Vec<T>;
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) f(V::loadu(a + i), V::loadu(b + i), V::loadu(c + i)).store(dst + i);
  if (i < n) f(V::loadu(a + i, n - i), V::loadu(b + i, n - i), V::loadu(c + i, n - i)).store(dst + i, n - i);
}
template <typename T, typename F> inline void vec_map(T* buf, int64_t n, const F& f) { vec_map_to(buf, buf, n, f); }
template <typename T, typename F> inline void vec_map2(T* a, const T* b, int64_t n, const F& f) {
  vec_map2_to(a, a, b, n, f);
}

// Applies f(dst + k, row_vec + j, len) over a flat block that starts at column col0 of rows of width C,
// one contiguous segment per row piece, so vector code runs along the columns.
template <typename F> inline void for_row_segments(int64_t len, int64_t C, int64_t col0, const F& f) {
  int64_t k = 0, j = col0;
  while (k < len) {
    int64_t seg = std::min(len - k, C - j);
    f(k, j, seg);
    k += seg;
    j = 0;
  }
}

// Parallel loop over [0, n) in blocks of at most kBlock elements: body(start, len).
template <typename F> inline void parallel_blocks(int64_t n, const F& body) {
  at::parallel_for(0, n, 16 * kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += kBlock) body(i, std::min(kBlock, end - i));
  });
}

// Column sums of many rows whose rounding error grows with the log of the row count, not with it (a long run of
// float additions is several times less exact than torch's cascade sums). The caller adds rows into group(), a
// zeroed C-vector, and push() files the group in a binary counter of partial sums (two partials of 2^k groups merge
// into one of 2^(k+1)); total(out) writes the sum of everything pushed and starts over. The order of the additions
// depends only on the sequence of pushes (deterministic).
// Rows per group of PairwiseColumnSum's callers: a group's rows are added in sequence, and a push (about two adds
// of a row) then costs a few percent of the group's own work.
constexpr int64_t kRowsPerGroup = 32;

template <typename T> class PairwiseColumnSum {
 public:
  explicit PairwiseColumnSum(int64_t C) : C_(C), group_(C, T(0)) {}
  T* group() { return group_.data(); }
  void push() {
    size_t k = 0;
    for (; k < levels_.size() && full_[k]; ++k) {
      add(group_.data(), levels_[k].data());
      full_[k] = false;
    }
    if (k == levels_.size()) {
      levels_.emplace_back(C_);
      full_.push_back(false);
    }
    std::swap(levels_[k], group_);
    full_[k] = true;
    std::fill(group_.begin(), group_.end(), T(0));
  }
  void total(T* out) {
    std::fill(out, out + C_, T(0));
    for (size_t k = 0; k < levels_.size(); ++k) {
      if (full_[k]) add(out, levels_[k].data());
      full_[k] = false;
    }
  }

 private:
  void add(T* dst, const T* src) const {
    vec_map2(dst, src, C_, [](auto a, auto b) { return a + b; });
  }
  int64_t C_;
  std::vector<T> group_;
  std::vector<std::vector<T>> levels_;
  std::vector<bool> full_;
};

// out[j] = the sum over chunks of partial[chunk * C + j], in chunk order, accumulated in double: each chunk's
// partial sum is rounded once more, in the result.
template <typename T> void sum_chunks(const T* partial, int64_t chunks, int64_t C, T* out) {
  at::parallel_for(0, C, kBlock, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j += kBlock) {
      const int64_t len = std::min(kBlock, j1 - j);
      double acc[kBlock] = {};
      for (int64_t c = 0; c < chunks; ++c) {
        const T* p = partial + c * C + j;
        for (int64_t k = 0; k < len; ++k) acc[k] += static_cast<double>(p[k]);
      }
      for (int64_t k = 0; k < len; ++k) out[j + k] = static_cast<T>(acc[k]);
    }
  });
}

// Runs body(start, len, scratch) over [0, n) in blocks like parallel_blocks. body returns the block's values
// in the math type (in `scratch` or in the output); when `out` is given they are also summed over rows of width
// C into out[C]. Rows are cut into chunks fixed by (n, C) alone; within a chunk the sums are pairwise over groups
// of kRowsPerGroup rows (or the rows of a block), and the chunks' sums are added in double in a fixed order: the
// result does not depend on the thread count (deterministic, no atomics).
template <typename T, typename F> inline void parallel_blocks_column_sum(int64_t n, int64_t C, T* out, const F& body) {
  if (out == nullptr) {
    parallel_blocks(n, [&](int64_t i, int64_t len) {
      T scratch[kBlock];
      body(i, len, scratch);
    });
    return;
  }
  const int64_t rows = n / C;
  const int64_t rows_per_chunk = std::max<int64_t>(1, (32 * kBlock) / C);
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t group_elements = kRowsPerGroup * C;
  std::vector<T> partial(chunks * C, T(0));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    T scratch[kBlock];
    PairwiseColumnSum<T> sums(C);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t end = std::min(rows, (c + 1) * rows_per_chunk) * C;
      int64_t grouped = 0;  // elements in the group so far
      for (int64_t i = c * rows_per_chunk * C; i < end; i += kBlock) {
        const int64_t len = std::min(kBlock, end - i);
        const T* values = body(i, len, scratch);
        for_row_segments(len, C, i % C, [&](int64_t k, int64_t j, int64_t seg) {
          vec_map2(sums.group() + j, values + k, seg, [](auto a, auto b) { return a + b; });
        });
        grouped += len;
        if (grouped >= group_elements && (i + len) % C == 0) {  // a group ends with a whole row
          sums.push();
          grouped = 0;
        }
      }
      if (grouped > 0) sums.push();
      sums.total(partial.data() + c * C);
    }
  });
  sum_chunks(partial.data(), chunks, C, out);
}

}  // namespace fused
