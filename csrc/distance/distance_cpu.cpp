// CPU kernels of the distance family: pairwise_distances (forward, backward), pairwise_topk and radius_neighbors
// (one running k-best; backward on the selected pairs; their p=2 path at large D is knn_gemm_cpu.cpp). Math in float
// (double for double); the path follows (p, D) only. Padded batches: rows past lengths_a / lengths_b take no
// part (distances 0, no neighbour, no gradient).
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "distance/distance_args.h"
#include "distance/distance_cpu.h"
#include "distance/knn_gemm_cpu.h"
#include "distance/select_order.h"

namespace fused {
namespace distance {
namespace {

// b of every batch packed in panels: [B, P * D * W].
template <typename T> at::Tensor pack_batches(const at::Tensor& b) {
  const int64_t B = b.size(0), M = b.size(1), D = b.size(2), len = num_panels<T>(M) * D * kPanel<T>;
  at::Tensor panels = at::empty({B, len}, b.options());
  for (int64_t i = 0; i < B; ++i) pack_panels(b.data_ptr<T>() + i * M * D, M, D, panels.data_ptr<T>() + i * len);
  return panels;
}

// Runs body(batch, row0, row1) over every (batch, row range) piece of [0, B * N), in parallel. The threads take
// pieces (at least `grain` rows, about 16 per thread) one at a time from a shared counter: on a shared machine a
// thread slowed by another process on its core then holds the others up for one piece, not for half the work as a
// static split would. Rows are independent, so the result does not depend on which thread runs which piece.
template <typename F> void parallel_batch_rows(int64_t B, int64_t N, int64_t grain, const F& body) {
  const int64_t total = B * N, threads = at::get_num_threads();
  const int64_t piece = std::max(grain, (total + 16 * threads - 1) / (16 * threads));
  const int64_t pieces = (total + piece - 1) / piece;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(pieces, threads), 1, [&](int64_t, int64_t) {
    for (int64_t p = next++; p < pieces; p = next++) {
      for (int64_t begin = p * piece, end = std::min(total, begin + piece); begin < end;) {
        const int64_t bi = begin / N, r0 = begin % N, r1 = std::min(N, r0 + end - begin);
        body(bi, r0, r1);
        begin += r1 - r0;
      }
    }
  });
}

// Rows per parallel task: enough work (~2^17 element steps) that small problems stay on one thread.
int64_t row_grain(int64_t M, int64_t D) {
  return std::max<int64_t>(4, (1 << 17) / (std::max<int64_t>(M, 1) * (D + 4)));
}

// The direct path (differences, b packed in panels), shared by the distances and topk: body(bi, r0, r1, rows) per
// parallel block of rows [r0, r1) of batch bi, where rows(s, nr, emit) runs direct_rows over rows [s, s + nr)
// against the lb(bi) valid rows of b.
template <typename T, typename F>
void for_direct_rows(const Batched& x, const Lengths& lb, Metric metric, double p, bool squared, const F& body) {
  at::Tensor panels = pack_batches<T>(x.b);
  const int64_t plen = panels.size(1);
  const T *ap = x.a.data_ptr<T>(), *pp = panels.data_ptr<T>();
  const auto prm = metric_params<T>(p, squared);
  visit_metric(metric, [&](auto tag) {
    constexpr Metric Mt = decltype(tag)::value;
    parallel_batch_rows(x.B, x.N, row_grain(x.M, x.D), [&](int64_t bi, int64_t r0, int64_t r1) {
      auto rows = [&](int64_t s, int64_t nr, const auto& emit) {
        direct_rows<Mt>(ap + (bi * x.N + s) * x.D, nr, x.D, pp + bi * plen, lb(bi), prm, emit);
      };
      body(bi, r0, r1, rows);
    });
  });
}

// The p=2 matmul path's operands, per batch: its valid rows.
template <typename T>
std::vector<MatmulOperands<T>> matmul_operands(const Batched& x, const Lengths& la, const Lengths& lb) {
  std::vector<MatmulOperands<T>> ops;
  ops.reserve(x.B);
  for (int64_t bi = 0; bi < x.B; ++bi) ops.emplace_back(x.a[bi].narrow(0, 0, la(bi)), x.b[bi].narrow(0, 0, lb(bi)));
  return ops;
}

// ---- pairwise_distances ----
using OptTensor = c10::optional<at::Tensor>;

at::Tensor pairwise_distances_cpu(const at::Tensor& a_in, const at::Tensor& b_in, double p, bool squared,
                                  const OptTensor& lengths_a, const OptTensor& lengths_b) {
  const char* op = "pairwise_distances";
  Batched x = check_pairwise_distances(op, a_in, b_in, p, squared, /*to_math=*/true);
  const BothLengths lengths = both_lengths(op, lengths_a, lengths_b, a_in, b_in, x);
  const Lengths la(lengths.a, x.N), lb(lengths.b, x.M);
  // Padded pairs are 0: only the valid block of each batch is computed.
  at::Tensor out = empty_output(out_shape(x, x.M), a_in.options());
  if (lengths.a.defined() || lengths.b.defined()) out.zero_();  // padding rows and columns read 0
  if (out.numel() == 0) return out;
  const Metric metric = metric_of(p);
  FUSED_DISPATCH_FLOATING(out.scalar_type(), "pairwise_distances", [&] {
    using T = at::opmath_type<scalar_t>;
    scalar_t* outp = out.data_ptr<scalar_t>();
    const int64_t N = x.N, M = x.M, D = x.D;
    if (use_matmul(metric, D)) {
      const auto operands = matmul_operands<T>(x, la, lb);
      // Tiles of about 2^17 outputs (512 KB in float): each is written by BLAS and finished while in L2.
      const int64_t cols = std::min<int64_t>(M, 1024),
                    rows = std::min<int64_t>(N, std::max<int64_t>(8, (1 << 17) / cols));
      const int64_t row_tiles = (N + rows - 1) / rows, col_tiles = (M + cols - 1) / cols;
      at::parallel_for(0, x.B * row_tiles * col_tiles, 1, [&](int64_t t0, int64_t t1) {
        std::vector<T> buf(std::is_same_v<T, scalar_t> ? 0 : rows * cols);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t bi = t / (row_tiles * col_tiles), r0 = (t / col_tiles % row_tiles) * rows,
                        c0 = t % col_tiles * cols, nr = std::min(rows, la(bi) - r0), nc = std::min(cols, lb(bi) - c0);
          if (nr <= 0 || nc <= 0) continue;
          scalar_t* dst = outp + (bi * N + r0) * M + c0;
          if constexpr (std::is_same_v<T, scalar_t>) {
            matmul_tile(operands[bi], r0, nr, c0, nc, squared, reinterpret_cast<T*>(dst), M);
          } else {
            matmul_tile(operands[bi], r0, nr, c0, nc, squared, buf.data(), nc);
            for (int64_t i = 0; i < nr; ++i) store_block(buf.data() + i * nc, dst + i * M, nc);
          }
        }
      });
      return;
    }
    for_direct_rows<T>(x, lb, metric, p, squared, [&](int64_t bi, int64_t r0, int64_t r1, const auto& rows) {
      scalar_t* dst = outp + (bi * N + r0) * M;
      rows(r0, std::clamp(la(bi), r0, r1) - r0,
           [&](int64_t r, int64_t j0, int64_t len, const T* v) { store_block(v, dst + r * M + j0, len); });
    });
  });
  return out;
}

// One pass over grad and dist (row stride ld) for rows [0, rows) of a against the first M rows of b (packed in
// panels): grad_a of those rows, and their contribution to grad_b added into gb_part (panel layout [P][D][W]).
// Every pair's term phi is computed once, vectorised along the columns: it adds to grad_a[r] (reduced across lanes
// at the end of the row block) and, negated, to grad_b[j] in place. Fixed order everywhere: deterministic.
template <Metric Mt, typename T>
void grad_rows(const T* a, int64_t rows, int64_t D, const T* panels, int64_t M, const T* g, const T* dist, int64_t ld,
               const MetricParams<Vec<T>>& prm, T* ga, T* gb_part) {
  using V = Vec<T>;
  constexpr int64_t L = V::size(), W = kPanel<T>;
  constexpr int R = 4;
  std::vector<V> acc(R * D * 2);
  const int64_t P = num_panels<T>(M);
  const V lane0 = V::arange(T(0), T(1)), lane1 = V::arange(T(L), T(1));
  auto load = [](const T* src, int64_t n) { return n >= L ? V::loadu(src) : n > 0 ? V::loadu(src, n) : V(0); };
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int nr = static_cast<int>(std::min<int64_t>(R, rows - r0));
    std::fill(acc.begin(), acc.end(), V(0));
    for (int64_t pj = 0; pj < P; ++pj) {
      const int64_t j0 = pj * W, len = std::min(W, M - j0);
      const bool tail = len < W;
      const V m0 = lane0 < V(T(len)), m1 = lane1 < V(T(len));
      V wv[R][2], dv[R][2];
      for (int r = 0; r < nr; ++r) {
        const int64_t off = (r0 + r) * ld + j0;
        dv[r][0] = load(dist + off, len);
        dv[r][1] = load(dist + off + L, len - L);
        wv[r][0] = pair_weight<Mt>(load(g + off, len), dv[r][0], prm);
        wv[r][1] = pair_weight<Mt>(load(g + off + L, len - L), dv[r][1], prm);
      }
      const T* panel = panels + pj * D * W;
      T* gbp = gb_part + pj * D * W;
      for (int64_t d = 0; d < D; ++d) {
        const V b0 = V::loadu(panel + d * W), b1 = V::loadu(panel + d * W + L);
        V s0 = V::loadu(gbp + d * W), s1 = V::loadu(gbp + d * W + L);
        for (int r = 0; r < nr; ++r) {
          const V av(a[(r0 + r) * D + d]);
          V t0 = grad_term<Mt>(av - b0, wv[r][0], dv[r][0], prm);
          V t1 = grad_term<Mt>(av - b1, wv[r][1], dv[r][1], prm);
          if (tail) {  // padded columns contribute exactly 0, even against inf in a
            t0 = V::blendv(V(0), t0, m0);
            t1 = V::blendv(V(0), t1, m1);
          }
          V* ac = acc.data() + (r * D + d) * 2;
          ac[0] = ac[0] + t0;
          ac[1] = ac[1] + t1;
          s0 = s0 - t0;
          s1 = s1 - t1;
        }
        s0.store(gbp + d * W);
        s1.store(gbp + d * W + L);
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int64_t d = 0; d < D; ++d) {
        T lanes[L];
        const V* ac = acc.data() + (r * D + d) * 2;
        (ac[0] + ac[1]).store(lanes);
        T s = 0;
        for (int64_t l = 0; l < L; ++l) s += lanes[l];
        ga[(r0 + r) * D + d] = s;
      }
  }
}

// Both gradients for a [B, N, D], b [B, M, D], grad and dist [B, N, M] (math type, contiguous), over the valid
// pairs (rows of a below la, of b below lb; the other rows' gradients are 0). Rows are cut into chunks fixed by N
// alone; each chunk adds into its own grad_b partial, summed in chunk order: the result does not depend on the
// thread count.
template <Metric Mt, typename T>
std::pair<at::Tensor, at::Tensor> grad_both(const at::Tensor& a, const at::Tensor& b, const at::Tensor& g,
                                            const at::Tensor& dist, const Lengths& la, const Lengths& lb,
                                            const MetricParams<Vec<T>>& prm) {
  const int64_t B = a.size(0), N = a.size(1), D = a.size(2), M = b.size(1);
  constexpr int64_t W = kPanel<T>;
  at::Tensor ga = at::zeros_like(a), gb = at::zeros_like(b);
  at::Tensor panels = pack_batches<T>(b);
  const int64_t plen = panels.size(1);
  const int64_t rows_per_chunk = std::max<int64_t>(64, (N + 15) / 16),
                chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  at::Tensor parts = at::zeros({B, chunks, plen}, a.options());
  const T *ap = a.data_ptr<T>(), *pp = panels.data_ptr<T>(), *gp = g.data_ptr<T>(), *dp = dist.data_ptr<T>();
  T *gap = ga.data_ptr<T>(), *partp = parts.data_ptr<T>();
  const int64_t grain = B * N * M * (D + 4) < (1 << 18) ? B * chunks : 1;
  at::parallel_for(0, B * chunks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / chunks, r0 = (t % chunks) * rows_per_chunk;
      const int64_t nr = std::min(rows_per_chunk, la(bi) - r0), row = bi * N + r0;
      if (nr > 0)
        grad_rows<Mt>(ap + row * D, nr, D, pp + bi * plen, lb(bi), gp + row * M, dp + row * M, M, prm, gap + row * D,
                      partp + t * plen);
    }
  });
  T* gbp = gb.data_ptr<T>();
  at::parallel_for(0, B * num_panels<T>(M), 16, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t bi = q / num_panels<T>(M), pj = q % num_panels<T>(M);
      for (int64_t d = 0; d < D; ++d)
        for (int64_t l = 0; l < W && pj * W + l < lb(bi); ++l) {
          T s = 0;
          for (int64_t c = 0; c < chunks; ++c) s += partp[(bi * chunks + c) * plen + (pj * D + d) * W + l];
          gbp[(bi * M + pj * W + l) * D + d] = s;
        }
    }
  });
  return {ga, gb};
}

std::tuple<at::Tensor, at::Tensor> pairwise_distances_backward_cpu(const at::Tensor& grad_in, const at::Tensor& a_in,
                                                                   const at::Tensor& b_in, const at::Tensor& dist_in,
                                                                   double p, bool squared, const OptTensor& lengths_a,
                                                                   const OptTensor& lengths_b) {
  const char* op = "pairwise_distances_backward";
  Batched x = check_pairwise_distances_backward(op, grad_in, a_in, b_in, dist_in, p, squared, /*to_math=*/true);
  const BothLengths lengths = both_lengths(op, lengths_a, lengths_b, a_in, b_in, x);
  const Metric metric = metric_of(p);
  if (x.B * x.N * x.M * x.D == 0 || metric == Metric::P0)
    return {at::zeros_like(a_in, at::MemoryFormat::Contiguous), at::zeros_like(b_in, at::MemoryFormat::Contiguous)};
  at::Tensor ga, gb;
  FUSED_DISPATCH_FLOATING(a_in.scalar_type(), "pairwise_distances_backward", [&] {
    using T = at::opmath_type<scalar_t>;
    const auto math = x.a.scalar_type();
    at::Tensor g = grad_in.reshape({x.B, x.N, x.M}).to(math).contiguous();
    at::Tensor dist = dist_in.reshape({x.B, x.N, x.M}).to(math).contiguous();
    const auto prm = metric_params<T>(p, squared);
    visit_metric(metric, [&](auto tag) {
      std::tie(ga, gb) =
          grad_both<decltype(tag)::value, T>(x.a, x.b, g, dist, Lengths(lengths.a, x.N), Lengths(lengths.b, x.M), prm);
    });
  });
  return {reduce_to(ga, x, x.N, a_in), reduce_to(gb, x, x.M, b_in)};
}

// ---- pairwise_topk and radius_neighbors: distances and a running k-best per row, never the N x M matrix ----

// The k best candidates of one row, by filtering against a threshold: a candidate goes into a buffer only if it
// ranks before `worst`, a key that at least k candidates seen so far match or beat (columns arrive in increasing
// order, so a newcomer with an equal value loses the tie), or, until k candidates are in, the radius bound when
// there is one (a key that every value <= floor beats, NaN not). When the buffer fills up, it is cut back to its k
// best (nth_element), which tightens the threshold. Most candidates cost one vector compare.
template <typename T> struct KBest {
  std::vector<Key> cand;
  Key worst = 0, limit = 0;
  T worst_value = 0, limit_value = 0;
  bool bounded = false, limited = false;  // worst is set; there is a radius bound (limit, limit_value)
  int64_t k = 0, capacity = 0;
  Order order{false};

  KBest(int64_t k_, const Order& o, const c10::optional<RadiusBound>& radius)
      : k(k_), capacity(std::max<int64_t>(4 * k_, 64)), order(o) {
    cand.reserve(capacity);
    if (radius.has_value()) {
      limit = Key(order.rank(radius->floor)) << 64 | Key(~uint64_t(0));
      limit_value = static_cast<T>(radius->next);
      limited = true;
    }
    reset();
  }
  void reset() {
    cand.clear();
    worst = limit;
    worst_value = limit_value;
    bounded = limited;
  }
  void set_worst(Key w) {
    worst = w;
    worst_value = static_cast<T>(order.value(w));
    bounded = true;
  }
  void add(T v, int64_t j) {
    const Key key = order.key(v, j);
    if (bounded && !(key < worst)) return;
    cand.push_back(key);
    const int64_t n = static_cast<int64_t>(cand.size());
    if (n == capacity) {
      std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end());
      cand.resize(k);
      set_worst(cand[k - 1]);
    } else if (n == k) {  // the first k: the worst of them is a valid threshold
      set_worst(*std::max_element(cand.begin(), cand.end()));
    }
  }
  // Lanes of x that may rank before worst (a superset: x is not yet rounded to the output dtype, and rounding
  // is monotone; an equal value is left to add's exact compare; the radius bound's worst_value is the value after
  // its floor).
  int may_beat(const Vec<T>& x) const {
    using V = Vec<T>;
    constexpr int all = (1 << V::size()) - 1;
    if (std::isnan(worst_value)) return order.largest ? 0 : (x != x).zero_mask() & all;  // smallest: any number
    const V w(worst_value), m = order.largest ? (x >= w) | (x != x) : x <= w;
    return all & ~m.zero_mask();
  }
  // The best candidates, sorted, into `width` slots (width >= k), the rest missing; then ready for the next row.
  template <typename scalar_t> void write(scalar_t* values, int64_t* indices, int64_t width) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(cand.size()), k);
    if (static_cast<int64_t>(cand.size()) > k) std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end());
    std::sort(cand.begin(), cand.begin() + n);
    for (int64_t t = 0; t < n; ++t) {
      values[t] = static_cast<scalar_t>(order.value(cand[t]));
      indices[t] = static_cast<int64_t>(static_cast<uint64_t>(cand[t]));
    }
    write_missing(values + n, indices + n, width - n, order.largest);
    reset();
  }
};

// Offers `len` distances from column j0 on, rounded to the output dtype first (the selection sees the values
// it returns, so ties are the output's ties).
template <typename scalar_t, typename T> inline void offer_all(KBest<T>& best, const T* v, int64_t j0, int64_t len) {
  using V = Vec<T>;
  constexpr int64_t L = V::size();
  auto add = [&](int64_t l) { best.add(static_cast<T>(static_cast<scalar_t>(v[l])), j0 + l); };
  int64_t l = 0;
  for (; l < len && !best.bounded; ++l) add(l);
  for (; l + L <= len; l += L)
    for (int mask = best.may_beat(V::loadu(v + l)); mask; mask &= mask - 1) add(l + __builtin_ctz(mask));
  for (; l < len; ++l) add(l);
}

// The nearest column of one row (pairwise_topk with k = 1, as chamfer_distance runs it) by a running minimum per
// lane over the direct tiles' rows of two vectors (kPanel), branch-free where KBest's prefilter branches on every
// vector: a strict < keeps the lower column of a lane's ties, and the lanes' minimum takes the lowest column among
// equal values. Columns are tracked in T (exact below 2^24 in float). Only finite values are taken: a row without
// one (inf, NaN) is left to KBest.
template <typename T> struct Nearest {
  using V = Vec<T>;
  static constexpr int64_t L = V::size();
  V best[2], col[2];
  void reset() {
    best[0] = best[1] = V(std::numeric_limits<T>::infinity());
    col[0] = col[1] = V(T(-1));
  }
  void offer(const T* v, int64_t j0, int64_t len) {
    for (int h = 0; h < 2; ++h) {
      V x = V::loadu(v + h * L);
      if (len < 2 * L)  // lanes past the row's end never win
        x = V::blendv(x, V(std::numeric_limits<T>::infinity()), V::arange(T(h * L), T(1)) >= V(T(len)));
      const V better = x < best[h];
      best[h] = V::blendv(best[h], x, better);
      col[h] = V::blendv(col[h], V::arange(T(j0 + h * L), T(1)), better);
    }
  }
  // The row's nearest (value, column); false when it has no finite value.
  bool result(T& value, int64_t& index) const {
    T v[2 * L], c[2 * L];
    best[0].store(v), best[1].store(v + L), col[0].store(c), col[1].store(c + L);
    T bv = std::numeric_limits<T>::infinity(), bc = -1;
    for (int64_t l = 0; l < 2 * L; ++l)
      if (v[l] < bv || (v[l] == bv && c[l] < bc)) bv = v[l], bc = c[l];
    value = bv, index = static_cast<int64_t>(bc);
    return bc >= 0;
  }
};

// The running k-best of pairwise_topk and radius_neighbors: for each valid row of a, the best (nearest, or farthest
// when largest) valid rows of b, within the radius when given (nearest only), sorted, in `width` slots; missing
// neighbours and padded rows of a get index -1 (write_missing).
std::tuple<at::Tensor, at::Tensor> select_cpu(const char* op, const at::Tensor& a_in, const at::Tensor& b_in,
                                              const Batched& x, int64_t width, double p, bool squared, bool largest,
                                              const c10::optional<double>& radius_in, const OptTensor& lengths_a,
                                              const OptTensor& lengths_b) {
  const BothLengths lengths = both_lengths(op, lengths_a, lengths_b, a_in, b_in, x);
  const Lengths la(lengths.a, x.N), lb(lengths.b, x.M);
  at::Tensor values = at::empty(out_shape(x, width), a_in.options());
  at::Tensor indices = at::empty(out_shape(x, width), a_in.options().dtype(at::kLong));
  if (values.numel() == 0) return {values, indices};
  const int64_t k = std::max<int64_t>(1, std::min(width, x.M));  // candidates kept per row
  const Metric metric = metric_of(p);
  if (use_matmul(metric, x.D)) {  // GEMM candidates (within the radius for radius_neighbors), exact re-rank
    knn_gemm_cpu(x, la, lb, squared, largest, radius_in, values, indices);
    return {values, indices};
  }
  FUSED_DISPATCH_FLOATING(values.scalar_type(), "select_cpu", [&] {
    using T = at::opmath_type<scalar_t>;
    const Order order{largest};
    c10::optional<RadiusBound> radius;
    if (radius_in.has_value()) radius = radius_bound<scalar_t>(*radius_in);
    scalar_t* vp = values.data_ptr<scalar_t>();
    int64_t* ip = indices.data_ptr<int64_t>();
    const int64_t N = x.N, M = x.M;
    // The nearest only, in float32 / float64 (no rounding to a 16-bit output first): Nearest, else KBest.
    const bool nearest = width == 1 && !largest && !radius && std::is_same_v<T, scalar_t> && M <= (int64_t(1) << 24);
    for_direct_rows<T>(x, lb, metric, p, squared, [&](int64_t bi, int64_t r0, int64_t r1, const auto& rows) {
      constexpr int64_t R = 4;  // rows per direct_rows call: R heaps live at once
      std::vector<KBest<T>> best(R, KBest<T>(k, order, radius));
      Nearest<T> near[R];
      const int64_t valid = std::clamp(la(bi), r0, r1);
      for (int64_t s = r0; s < valid; s += R) {
        const int64_t nr = std::min(R, valid - s);
        auto offer = [&](int64_t r, int64_t j0, int64_t len, const T* v) { offer_all<scalar_t>(best[r], v, j0, len); };
        if (nearest) {
          for (int64_t r = 0; r < nr; ++r) near[r].reset();
          rows(s, nr, [&](int64_t r, int64_t j0, int64_t len, const T* v) { near[r].offer(v, j0, len); });
        } else {
          rows(s, nr, offer);
        }
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t row = (bi * N + s + r) * width;
          T value;
          if (nearest && near[r].result(value, ip[row])) {
            vp[row] = static_cast<scalar_t>(value);
            continue;
          }
          if (nearest)  // no finite distance in the row: KBest ranks inf and NaN
            rows(s + r, 1, [&](int64_t, int64_t j0, int64_t len, const T* v) { offer(r, j0, len, v); });
          best[r].write(vp + row, ip + row, width);
        }
      }
      for (int64_t i = valid; i < r1; ++i)
        write_missing(vp + (bi * N + i) * width, ip + (bi * N + i) * width, width, largest);
    });
  });
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> pairwise_topk_cpu(const at::Tensor& a_in, const at::Tensor& b_in, int64_t k,
                                                     double p, bool squared, bool largest, const OptTensor& lengths_a,
                                                     const OptTensor& lengths_b) {
  const char* op = "pairwise_topk";
  Batched x = check_pairwise_topk(op, a_in, b_in, k, p, squared, /*to_math=*/true);
  return select_cpu(op, a_in, b_in, x, k, p, squared, largest, c10::nullopt, lengths_a, lengths_b);
}

std::tuple<at::Tensor, at::Tensor> radius_neighbors_cpu(const at::Tensor& a_in, const at::Tensor& b_in, double radius,
                                                        int64_t max_neighbors, const OptTensor& lengths_a,
                                                        const OptTensor& lengths_b, double p) {
  const char* op = "radius_neighbors";
  Batched x = check_radius_neighbors(op, a_in, b_in, radius, max_neighbors, p, /*to_math=*/true);
  return select_cpu(op, a_in, b_in, x, max_neighbors, p, false, false, radius, lengths_a, lengths_b);
}

// Gradient through the selected pairs only (index -1: no pair): O(N k D) work, no N x M buffer. grad_b is
// accumulated per batch in row order (deterministic).
std::tuple<at::Tensor, at::Tensor> pairwise_topk_backward_cpu(const at::Tensor& grad_in, const at::Tensor& a_in,
                                                              const at::Tensor& b_in, const at::Tensor& values_in,
                                                              const at::Tensor& indices_in, double p, bool squared) {
  const char* op = "pairwise_topk_backward";
  Batched x =
      check_pairwise_topk_backward(op, grad_in, a_in, b_in, values_in, indices_in, p, squared, /*to_math=*/true);
  const int64_t k = values_in.size(-1);
  const Metric metric = metric_of(p);
  if (x.B * x.N * k * x.D == 0 || metric == Metric::P0)
    return {at::zeros_like(a_in, at::MemoryFormat::Contiguous), at::zeros_like(b_in, at::MemoryFormat::Contiguous)};
  at::Tensor ga = at::empty_like(x.a), gb = at::zeros_like(x.b);
  FUSED_DISPATCH_FLOATING(a_in.scalar_type(), "pairwise_topk_backward", [&] {
    using T = at::opmath_type<scalar_t>;
    const auto math = x.a.scalar_type();
    at::Tensor g = grad_in.reshape({x.B, x.N, k}).to(math).contiguous();
    at::Tensor v = values_in.reshape({x.B, x.N, k}).to(math).contiguous();
    at::Tensor idx = indices_in.reshape({x.B, x.N, k}).contiguous();
    const T *ap = x.a.data_ptr<T>(), *bp = x.b.data_ptr<T>(), *gp = g.data_ptr<T>(), *vp = v.data_ptr<T>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    T *gap = ga.data_ptr<T>(), *gbp = gb.data_ptr<T>();
    const int64_t N = x.N, M = x.M, D = x.D;
    const auto prm = metric_params<T, T>(p, squared);
    visit_metric(metric, [&](auto tag) {
      constexpr Metric Mt = decltype(tag)::value;
      // One selected pair: add its gradient into the row of a (or, negated, into the row of b it selected).
      auto pair = [&](int64_t bi, int64_t i, int64_t t, bool into_b) {
        const int64_t e = (bi * N + i) * k + t, j = ip[e];
        if (j == -1) return;  // a missing neighbour
        TORCH_CHECK(0 <= j && j < M, "fused.", op, ": index ", j, " out of range for b with ", M, " points");
        const T w = pair_weight<Mt>(gp[e], vp[e], prm);
        const T *ar = ap + (bi * N + i) * D, *br = bp + (bi * M + j) * D;
        T* dst = into_b ? gbp + (bi * M + j) * D : gap + (bi * N + i) * D;
        const T sign = into_b ? T(-1) : T(1);
        for (int64_t d = 0; d < D; ++d) dst[d] += sign * grad_term<Mt>(ar[d] - br[d], w, vp[e], prm);
      };
      parallel_batch_rows(x.B, N, 64, [&](int64_t bi, int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) {
          std::fill(gap + (bi * N + i) * D, gap + (bi * N + i + 1) * D, T(0));
          for (int64_t t = 0; t < k; ++t) pair(bi, i, t, false);
        }
      });
      at::parallel_for(0, x.B, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t bi = b0; bi < b1; ++bi)
          for (int64_t i = 0; i < N; ++i)
            for (int64_t t = 0; t < k; ++t) pair(bi, i, t, true);
      });
    });
  });
  return {reduce_to(ga, x, x.N, a_in), reduce_to(gb, x, x.M, b_in)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused, CPU, m) { FUSED_DISTANCE_OPS(FUSED_IMPL_CPU) }

}  // namespace distance
}  // namespace fused
