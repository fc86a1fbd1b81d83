// pairwise_topk and radius_neighbors for p = 2 at large D on the CPU: candidates from a blocked GEMM, then an exact
// re-rank.
//
// Per tile of rows of a and columns of b, one at::mm gives x.y for the rows centered at the mean of b, and
// d^2 ~ |x|^2 + |y|^2 - 2 x.y within err = gemm_error(D) * (|x|^2 + |y|^2) of the exact value: the filter. A
// column whose lower bound (d^2 - err) is within the row's `bound` gets its d^2 from the differences
// (squared_distance, within direct_error(D) * d^2: no cancellation) and joins the row's list with those bounds;
// `bound` is the k-th smallest upper bound in the list. Every true k-best column has a lower bound at or below the
// final bound, so it is kept. The kept columns within it (the k best and their near-ties) are then ranked by their
// distance in double from the uncentered inputs (exact differences and squares of float inputs): the same indices
// as a float64 search, ties to the lower index, whatever the GEMM's rounding. Threads take tiles of rows; with few
// rows for the threads, the columns are split among them too, and a row's lists are merged. radius_neighbors is
// the same search with the radius as every row's initial bound (a column whose distance rounds to a value above
// the radius cannot be in), and the re-rank keeps the columns whose rounded value is within it.
//
// Where torch's int8 GEMM is exact (x86: oneDNN) the filter's GEMM runs on int8 codes of the centered rows
// (to_int8; 4x the float32 GEMM's speed with int8 dot products, 2x without, on Zen 4) with its own, wider bound per
// pair: more columns pass it, each at the cost of its direct d^2, and the answer is the same.
#include "distance/knn_gemm_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/cpu_utils.h"
#include "distance/distance_cpu.h"
#include "distance/select_order.h"

namespace fused {
namespace distance {
namespace {

// The GEMM's relative error bound, u = epsilon / 2 the unit roundoff: the centering's rounding (4u), the two norms'
// and the dot's sums (gamma_D each, the dot's twice), the final additions (6u): (2D + 12) u, plus slack for
// the filter's own rounding; the result is a multiple of |x|^2 + |y|^2 (an absolute floor covers subnormals).
template <typename T> T gemm_error(int64_t D) { return T(D + 32) * std::numeric_limits<T>::epsilon(); }

// The int8 filter's operands: each row x as scale * q, q = round(x / scale) in [-levels, levels] and scale =
// max(max |x_i| / levels, 2 FLT_MIN) (at least 2 FLT_MIN, so that a subnormal x_i read as 0 under DAZ is within
// scale / 2 of its code). With h = 1/2 + 2^-12 (a code's rounding, and that of x_i * (1 / scale)),
// |x_i - scale q_i| <= h scale, so |x.y - s_x s_y q_x.q_y| <= s_x s_y (slack_x + slack_y) with
// slack = h sum |q_i| + D h^2 / 2; q_x.q_y is exact in int32. The slack is stored times sign (the search's: +1
// nearest, -1 farthest), the end of that interval the lower bound of the score takes. Non-finite rows get garbage
// codes: they take no part in the filter.
struct Int8Rows {
  at::Tensor q, scale, slack;
};
// codes in [-128, 127] from int32 to int8 (restrict: an int8 store may alias anything, which keeps the loop scalar)
inline void narrow_codes(const int32_t* __restrict codes, int8_t* __restrict q, int64_t n) {
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(codes[i]);
}
inline Int8Rows to_int8(const at::Tensor& x, int levels, float sign) {
  using V = Vec<float>;
  const int64_t rows = x.size(0), D = x.size(1);
  Int8Rows r{empty_output(x.sizes(), x.options().dtype(at::kChar)), at::empty({rows}, x.options()),
             at::empty({rows}, x.options())};
  const float* src = x.data_ptr<float>();
  int8_t* q = r.q.data_ptr<int8_t>();
  float *scale = r.scale.data_ptr<float>(), *slack = r.slack.data_ptr<float>();
  const double h = 0.5 + 0x1p-12;
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> codes(D + V::size());
    for (int64_t row = r0; row < r1; ++row) {
      const float* xr = src + row * D;
      V vmax(0.f);
      for (int64_t d = 0; d < D; d += V::size())
        vmax = at::vec::maximum(vmax, V::loadu(xr + d, std::min<int64_t>(V::size(), D - d)).abs());
      const float top = at::vec::vec_reduce_all<float>([](V p, V t) { return at::vec::maximum(p, t); }, vmax);
      const float s = std::max(top / float(levels), 2 * std::numeric_limits<float>::min()), inv = 1.f / s;
      V sum(0.f);
      for (int64_t d = 0; d < D; d += V::size()) {
        const int64_t cnt = std::min<int64_t>(V::size(), D - d);
        const V c = at::vec::clamp((V::loadu(xr + d, cnt) * V(inv)).round(), V(-float(levels)), V(float(levels)));
        sum = sum + c.abs();
        at::vec::convert_to_int_of_same_size(c).store(codes.data() + d);
      }
      narrow_codes(codes.data(), q + row * D, D);
      scale[row] = s;
      const double n = at::vec::vec_reduce_all<float>([](V p, V t) { return p + t; }, sum);  // exact integers
      slack[row] = sign * std::nextafter(static_cast<float>(h * n + double(D) * h * h / 2), INFINITY);
    }
  });
  return r;
}

// squared_distance's relative error bound, with slack for the list's own rounding of score -+ err.
template <typename T> T direct_error(int64_t D) { return T(D + 8) * std::numeric_limits<T>::epsilon(); }

// One row's kept columns: lower and upper bounds of the selection score (d^2, or -d^2 when largest) and the column.
template <typename T> struct Kept {
  struct Entry {
    T lo, hi;
    int64_t j;
  };
  std::vector<Entry> list;
  T bound = std::numeric_limits<T>::infinity();  // the k-th smallest upper bound seen so far, at most reset's start
  int64_t k = 1, capacity = 64;

  void reset(int64_t k_, T start) {
    list.clear();
    bound = start;
    k = k_;
    capacity = std::max<int64_t>(4 * k, 64);
  }
  void add(T lo, T hi, int64_t j) {
    list.push_back({lo, hi, j});
    if (static_cast<int64_t>(list.size()) >= capacity) prune();
  }
  // Tightens bound to the k-th smallest upper bound and drops the columns whose lower bound is above it. Many
  // columns within the bound (near-ties, duplicates) grow the capacity, so that pruning stays linear overall.
  void prune() {
    if (static_cast<int64_t>(list.size()) >= k) {
      std::nth_element(list.begin(), list.begin() + (k - 1), list.end(),
                       [](const Entry& x, const Entry& y) { return x.hi < y.hi; });
      bound = std::min(bound, list[k - 1].hi);
    }
    const T t = bound;
    list.erase(std::remove_if(list.begin(), list.end(), [t](const Entry& e) { return e.lo > t; }), list.end());
    if (2 * static_cast<int64_t>(list.size()) > capacity) capacity *= 2;
  }
};

// The exact p=2 distance (its square when squared) of two rows in double: exact differences and squares of float
// inputs, summed in vector lanes (within radius_score's slack, as any summation order).
template <typename T> double exact_distance(const T* a, const T* b, int64_t D, bool squared) {
  double acc = 0;
  if constexpr (std::is_same_v<T, double>) {
    acc = squared_distance(a, b, D);
  } else {
    constexpr int64_t C = 256;  // float rows converted a chunk at a time
    double x[C], y[C];
    for (int64_t d0 = 0; d0 < D; d0 += C) {
      const int64_t n = std::min(C, D - d0);
      std::copy(a + d0, a + d0 + n, x);
      std::copy(b + d0, b + d0 + n, y);
      acc += squared_distance(x, y, n);
    }
  }
  return squared ? acc : std::sqrt(acc);
}

// radius_neighbors' initial bound on the score d^2: above the square of every distance (its square when squared)
// below r.next, the value after the radius in the output dtype, whatever the exact_distance's rounding in double
// (a relative (D + 8) epsilon of double), rounded up to T; inf where there is no radius.
template <typename T> T radius_score(const c10::optional<RadiusBound>& r, int64_t D, bool squared) {
  const double inf = std::numeric_limits<double>::infinity();
  if (!r.has_value() || std::isinf(r->next)) return std::numeric_limits<T>::infinity();
  const double s =
      (squared ? r->next : r->next * r->next) * (1 + double(D + 8) * std::numeric_limits<double>::epsilon());
  return std::nextafter(static_cast<T>(s), static_cast<T>(inf));
}

template <typename scalar_t>
void knn_gemm(const Batched& x, const Lengths& la, const Lengths& lb, bool squared, bool largest,
              const c10::optional<double>& radius_in, scalar_t* vp, int64_t* ip, int64_t width) {
  using T = at::opmath_type<scalar_t>;
  using V = Vec<T>;
  constexpr int64_t L = V::size();
  const int64_t N = x.N, M = x.M, D = x.D;
  const int64_t k = std::max<int64_t>(1, std::min(width, M));
  // Tiles of 256 rows x 512 columns (512 KB in float): the GEMM writes one and the filter reads it from L2. Each
  // GEMM call packs its b tile anew, so taller tiles pack b less often (128 rows: k = 16 at D = 64, 4096 x 65536,
  // 2 threads, Zen 4: 330-490 against 265-280 ms at 256, interleaved builds).
  constexpr int64_t kRows = 256, kCols = 512;
  const T g = gemm_error<T>(D), g_direct = direct_error<T>(D), floor = T(D + 32) * std::numeric_limits<T>::min();
  const T sign = largest ? T(-1) : T(1), limit = std::numeric_limits<T>::max() / 8;
  const bool codes = std::is_same_v<T, float> && knn_filter(N, D) == KnnFilter::kInt8;
  // The filter's bound is the float32 GEMM's, g; with int8 codes, on top of their own bound per pair, it covers the
  // norms, the centering and the scan's few roundings, and 5 times the floor the subnormals that the scan's
  // arithmetic may flush (DAZ / FTZ).
  const T floor_filter = codes ? 5 * floor : floor;
  const Order order{largest};
  c10::optional<RadiusBound> radius;
  if (radius_in.has_value()) radius = radius_bound<scalar_t>(*radius_in);
  const T start = radius_score<T>(radius, D, squared);

  // Per batch: the centered operands (and their int8 codes for an int8 filter), and per column of b
  // c_j = nb_j (sign - g), so that the filter's lower bound of the score is c_i + c_j - 2 sign x.y with
  // c_i = na_i (sign - g) - floor_filter. Columns with a non-finite or huge norm (inf, NaN, overflow) take
  // no part in the GEMM filter: every row re-ranks them directly.
  std::vector<MatmulOperands<T>> ops;
  std::vector<at::Tensor> col_terms;
  std::vector<Int8Rows> a8, b8;
  std::vector<std::vector<int64_t>> bad_cols(x.B);
  for (int64_t bi = 0; bi < x.B; ++bi) {
    ops.emplace_back(x.a[bi].narrow(0, 0, la(bi)), x.b[bi].narrow(0, 0, lb(bi)));
    if constexpr (std::is_same_v<T, float>) {
      if (codes) {
        const int levels = int8_gemm_levels();
        a8.push_back(to_int8(ops.back().ac, levels, sign));
        b8.push_back(to_int8(ops.back().bc, levels, sign));
      }
    }
    at::Tensor c = ops.back().nb * (sign - g);
    const T* nb = ops.back().nb.template data_ptr<T>();
    T* cp = c.template data_ptr<T>();
    for (int64_t j = 0; j < lb(bi); ++j)
      if (!(nb[j] <= limit)) {
        bad_cols[bi].push_back(j);
        cp[j] = std::numeric_limits<T>::quiet_NaN();  // never passes the filter below
      }
    col_terms.push_back(c);
  }

  // Work items: a chunk of kRows rows of a against a range of columns of b. The columns are split only where the
  // chunks are few for the threads (few query rows against many columns), each split keeping its own lists.
  const int64_t chunks = (N + kRows - 1) / kRows, threads = at::get_num_threads();
  const int64_t items = std::max<int64_t>(1, x.B * chunks);
  int64_t max_cols = 0;
  for (int64_t bi = 0; bi < x.B; ++bi) max_cols = std::max(max_cols, lb(bi));
  // At least 4 work items a thread where the columns allow, so that a few chunks still balance.
  const int64_t splits =
      threads == 1
          ? 1
          : std::clamp<int64_t>(std::min((4 * threads + items - 1) / items, max_cols / (4 * kCols)), 1, 4 * threads);

  // The GEMM filter of rows [r0, r0 + valid) of batch bi against its columns [c_begin, c_end), into kept[0, valid).
  // `tile` holds the GEMM's output: floats, or int32 from int8 codes.
  auto filter = [&](int64_t bi, int64_t r0, int64_t valid, int64_t c_begin, int64_t c_end, Kept<T>* kept,
                    std::vector<T>& tile) {
    for (int64_t i = 0; i < valid; ++i) kept[i].reset(k, start);
    if (valid == 0) return;
    const MatmulOperands<T>& op = ops[bi];
    const T* na = op.na.template data_ptr<T>() + r0;
    const T* cj = col_terms[bi].template data_ptr<T>();
    const T *a = op.a.template data_ptr<T>() + r0 * D, *b = op.b.template data_ptr<T>();
    // int8 codes: the rows' and columns' scales and slacks (times sign)
    const T *sa = nullptr, *ra = nullptr, *sb = nullptr, *rb = nullptr;
    if (codes) {
      sa = a8[bi].scale.template data_ptr<T>() + r0, ra = a8[bi].slack.template data_ptr<T>() + r0;
      sb = b8[bi].scale.template data_ptr<T>(), rb = b8[bi].slack.template data_ptr<T>();
    }
    // The rows' scan of one tile of dots (Dot: T, or int32_t from int8 codes).
    auto scan = [&](const auto* dots, int64_t c0, int64_t nc) {
      using Dot = std::remove_const_t<std::remove_pointer_t<decltype(dots)>>;
      for (int64_t i = 0; i < valid; ++i) {
        if (!(na[i] <= limit)) continue;  // a non-finite row: re-ranked against every column below
        Kept<T>& row = kept[i];
        const T ci = na[i] * (sign - g) - floor_filter;
        const Dot* dot = dots + i * nc;
        // The filter's lower bound, c_i + c_j - 2 sign x.y, is within bound when c_j - 2 sign x.y <= bound - c_i.
        // From int8 codes, x.y is s_x s_y (q_x.q_y + sign (slack_x + slack_y)) at its bound's end.
        const T ki = codes ? T(-2) * sign * sa[i] : T(0), ri = codes ? ra[i] : T(0);
        constexpr bool kCodes = std::is_same_v<Dot, int32_t>;
        auto lower = [&](int64_t j) -> T {
          if constexpr (kCodes) return cj[c0 + j] + ki * (sb[c0 + j] * (T(dot[j]) + (rb[c0 + j] + ri)));
          return cj[c0 + j] - T(2) * sign * T(dot[j]);
        };
        auto lower_lanes = [&](int64_t j) -> V {
          if constexpr (kCodes) {
            const V p = at::vec::convert_to_fp_of_same_size<T>(at::vec::Vectorized<int32_t>::loadu(dot + j));
            return fma_once(V(ki), V::loadu(sb + c0 + j) * (p + (V::loadu(rb + c0 + j) + V(ri))),
                            V::loadu(cj + c0 + j));
          }
          return fma_once(V(T(-2) * sign), V::loadu(dot + j), V::loadu(cj + c0 + j));
        };
        T thr = row.bound - ci;
        auto take = [&](int64_t j) {  // a column within the filter's bound joins with its direct d^2's bounds
          const T d2 = squared_distance(a + i * D, b + (c0 + j) * D, D), err = g_direct * d2 + floor;
          row.add(sign * d2 - err, sign * d2 + err, c0 + j);
          thr = row.bound - ci;
        };
        int64_t j = 0;
        for (; j + L <= nc; j += L) {
          for (int mask = (lower_lanes(j) <= V(thr)).zero_mask() ^ ((1 << L) - 1); mask; mask &= mask - 1) {
            const int64_t l = j + __builtin_ctz(mask);
            if (lower(l) <= thr) take(l);  // thr may have tightened
          }
        }
        for (; j < nc; ++j)
          if (lower(j) <= thr) take(j);
      }
    };
    for (int64_t c0 = c_begin; c0 < c_end; c0 += kCols) {
      const int64_t nc = std::min(kCols, c_end - c0);
      if constexpr (std::is_same_v<T, float>) {
        if (codes) {
          auto* dots = reinterpret_cast<int32_t*>(tile.data());
          at::Tensor out = at::from_blob(dots, {valid, nc}, op.a.options().dtype(at::kInt));
          at::_int_mm_out(out, a8[bi].q.narrow(0, r0, valid), b8[bi].q.narrow(0, c0, nc).t());
          scan(static_cast<const int32_t*>(dots), c0, nc);
          continue;
        }
      }
      at::Tensor out = at::from_blob(tile.data(), {valid, nc}, op.a.options());
      at::mm_out(out, op.ac.narrow(0, r0, valid), op.bc.narrow(0, c0, nc).t());
      scan(static_cast<const T*>(tile.data()), c0, nc);
    }
  };

  // Exact re-rank of rows [r0, r0 + rows) of batch bi: each valid row's kept columns of every split (kept[s * kRows
  // + i]) within the tightest of their bounds (each split's k-th smallest upper bound is at or above the k-th
  // smallest of all), every column for a non-finite row.
  auto rerank = [&](int64_t bi, int64_t r0, int64_t rows, int64_t valid, std::vector<Kept<T>>& kept,
                    std::vector<Key>& keys) {
    for (int64_t i = valid; i < rows; ++i) {
      const int64_t row = (bi * N + r0 + i) * width;
      write_missing(vp + row, ip + row, width, largest);
    }
    if (valid == 0) return;
    const MatmulOperands<T>& op = ops[bi];
    const T* na = op.na.template data_ptr<T>() + r0;
    const T* a = op.a.template data_ptr<T>() + r0 * D;
    const T* b = op.b.template data_ptr<T>();
    for (int64_t i = 0; i < valid; ++i) {
      keys.clear();
      auto rank = [&](int64_t j) {
        const double v = exact_distance(a + i * D, b + j * D, D, squared);
        if (!radius || radius->template holds<scalar_t>(v)) keys.push_back(order.key(v, j));
      };
      if (na[i] <= limit) {
        T bound = start;
        for (int64_t sp = 0; sp < splits; ++sp) {
          Kept<T>& part = kept[sp * kRows + i];
          part.prune();
          bound = std::min(bound, part.bound);
        }
        for (int64_t sp = 0; sp < splits; ++sp)
          for (const auto& e : kept[sp * kRows + i].list)
            if (e.lo <= bound) rank(e.j);
        for (int64_t j : bad_cols[bi]) rank(j);
      } else {
        for (int64_t j = 0; j < lb(bi); ++j) rank(j);
      }
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(keys.size()), k);
      std::partial_sort(keys.begin(), keys.begin() + n, keys.end());
      const int64_t row = (bi * N + r0 + i) * width;
      for (int64_t s = 0; s < n; ++s) {
        vp[row + s] = static_cast<scalar_t>(order.value(keys[s]));
        ip[row + s] = static_cast<int64_t>(static_cast<uint64_t>(keys[s]));
      }
      write_missing(vp + row + n, ip + row + n, width - n, largest);
    }
  };
  auto rows_of = [&](int64_t t, int64_t& bi, int64_t& r0, int64_t& rows, int64_t& valid) {
    bi = t / chunks, r0 = (t % chunks) * kRows;
    rows = std::min(kRows, N - r0), valid = std::clamp<int64_t>(la(bi) - r0, 0, rows);
  };
  // The columns [begin, end) of split sp: multiples of kCols.
  auto split_range = [&](int64_t bi, int64_t sp, int64_t& begin, int64_t& end) {
    const int64_t span = ((lb(bi) + splits - 1) / splits + kCols - 1) / kCols * kCols;
    begin = std::min(lb(bi), sp * span), end = std::min(lb(bi), begin + span);
  };

  if (splits == 1) {  // a chunk at a time, filter then re-rank, its lists reused
    at::parallel_for(0, x.B * chunks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<T> tile(kRows * kCols);
      std::vector<Kept<T>> kept(kRows);
      std::vector<Key> keys;
      for (int64_t t = t0; t < t1; ++t) {
        int64_t bi, r0, rows, valid;
        rows_of(t, bi, r0, rows, valid);
        filter(bi, r0, valid, 0, lb(bi), kept.data(), tile);
        rerank(bi, r0, rows, valid, kept, keys);
      }
    });
    return;
  }
  // Every (chunk, split) filtered in parallel, then each chunk re-ranked from its splits' lists.
  std::vector<std::vector<Kept<T>>> kept(x.B * chunks, std::vector<Kept<T>>(splits * kRows));
  at::parallel_for(0, x.B * chunks * splits, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> tile(kRows * kCols);
    for (int64_t t = t0; t < t1; ++t) {
      int64_t bi, r0, rows, valid, begin, end;
      rows_of(t / splits, bi, r0, rows, valid);
      split_range(bi, t % splits, begin, end);
      filter(bi, r0, valid, begin, end, kept[t / splits].data() + (t % splits) * kRows, tile);
    }
  });
  at::parallel_for(0, x.B * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<Key> keys;
    for (int64_t t = t0; t < t1; ++t) {
      int64_t bi, r0, rows, valid;
      rows_of(t, bi, r0, rows, valid);
      rerank(bi, r0, rows, valid, kept[t], keys);
    }
  });
}

}  // namespace

// The levels of int8 codes whose products torch's int8 GEMM (at::_int_mm) sums exactly, found once by trying it:
// 127 where it has int8 dot products (AVX512_VNNI, AVX-VNNI, AMX), 63 where it pairs products in saturating int16
// (oneDNN's vpmaddubsw path: 7-bit codes stay below its limit), 0 where neither holds.
int int8_gemm_levels() {
  static const int levels = [] {
    for (int levels : {127, 63}) {
      // rows of +-levels against columns of +-levels: every pair of products at the largest magnitude
      const int64_t R = 64, C = 48, K = 96;
      at::Tensor a = at::empty({R, K}, at::kChar), b = at::empty({C, K}, at::kChar);
      int8_t *pa = a.data_ptr<int8_t>(), *pb = b.data_ptr<int8_t>();
      for (int64_t i = 0; i < R * K; ++i)
        pa[i] = int8_t((i / K) % 3 == 0 ? levels : (i * 7 / 5) % 2 ? levels : -levels);
      for (int64_t i = 0; i < C * K; ++i) pb[i] = int8_t((i / K) % 2 ? -levels : (i * 3 / 2) % 2 ? levels : -levels);
      try {
        const at::Tensor got = at::_int_mm(a, b.t()).to(at::kLong), want = at::mm(a.to(at::kLong), b.to(at::kLong).t());
        if (at::equal(got, want)) return levels;
      } catch (const std::exception&) {
        return 0;
      }
    }
    return 0;
  }();
  return levels;
}

// The filter's GEMM for `rows` rows of a per batch at D columns (the answer is the same with any of them):
// - int8 codes on x86 where torch's int8 GEMM is oneDNN's and exact (int8_gemm_levels), and a has enough rows to
//   repay the codes of b (kCodeMinRows): its GEMM runs at 4x the float32 one's speed on Zen 4 (2x without int8 dot
//   products), and its bound is about 1% of d^2 for Gaussian points (2% with 7-bit codes);
// - else float32.
// FUSED_KNN_FILTER=float32 or int8 decides instead (int8 only where the int8 GEMM is exact; the tests run both).
KnnFilter knn_filter(int64_t rows, int64_t D) {
  const char* env = std::getenv("FUSED_KNN_FILTER");
  const bool int8_ok = D <= kCodeMaxD && int8_gemm_levels() > 0;
  if (env != nullptr && *env != '\0') {
    const std::string e(env);
    if (e == "int8" && int8_ok) return KnnFilter::kInt8;
    return KnnFilter::kFloat32;
  }
  // by default only where torch's int8 GEMM is oneDNN's x86 one, measured fast; elsewhere FUSED_KNN_FILTER=int8
#if defined(__x86_64__) || defined(_M_X64)
  static const bool fast_int8 = at::hasMKLDNN();
#else
  constexpr bool fast_int8 = false;
#endif
  return fast_int8 && int8_ok && rows >= kCodeMinRows ? KnnFilter::kInt8 : KnnFilter::kFloat32;
}

void knn_gemm_cpu(const Batched& x, const Lengths& la, const Lengths& lb, bool squared, bool largest,
                  const c10::optional<double>& radius, at::Tensor& values, at::Tensor& indices) {
  TORCH_INTERNAL_ASSERT(!(largest && radius.has_value()), "knn_gemm_cpu: a radius bounds the nearest only");
  FUSED_DISPATCH_FLOATING(values.scalar_type(), "knn_gemm_cpu", [&] {
    knn_gemm<scalar_t>(x, la, lb, squared, largest, radius, values.data_ptr<scalar_t>(), indices.data_ptr<int64_t>(),
                       values.size(-1));
  });
}

}  // namespace distance
}  // namespace fused
