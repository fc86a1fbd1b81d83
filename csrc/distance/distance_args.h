// Argument handling shared by the CPU kernels and the CUDA binding of the distance family: checks that name the
// op and the argument, batch broadcasting and flattening, and the reduction of gradients to the input shapes.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"
#include "common/registration.h"

// The family's ops, each registered from <family>_cpu.cpp and <family>_cuda.cpp (common/registration.h).
#define FUSED_DISTANCE_OPS(X)                                   \
  X("pairwise_distances", pairwise_distances)                   \
  X("pairwise_distances_backward", pairwise_distances_backward) \
  X("pairwise_topk", pairwise_topk)                             \
  X("pairwise_topk_backward", pairwise_topk_backward)           \
  X("radius_neighbors", radius_neighbors)

namespace fused {
namespace distance {

inline void check_p(const char* op, double p, bool squared) {
  TORCH_CHECK(p >= 0, "fused.", op, ": p must be in [0, inf], got ", p);
  TORCH_CHECK(!squared || p == 2, "fused.", op, ": squared=True needs p=2, got p=", p);
}

// a [*Ba, N, D] and b [*Bb, M, D] broadcast over the batch dims, flattened to [B, N, D], [B, M, D] (contiguous,
// in the math type when to_math), with the broadcast batch shape kept for the outputs.
struct Batched {
  at::Tensor a, b;
  std::vector<int64_t> batch;
  int64_t B, N, M, D;
};

inline Batched batched(const char* op, const at::Tensor& a, const at::Tensor& b, bool to_math = true) {
  check_floating(op, "a", a);
  check_like(op, "b", b, "a", a);
  TORCH_CHECK(a.dim() >= 2, "fused.", op, ": a must have at least 2 dims [*B, N, D], got shape ", a.sizes());
  TORCH_CHECK(b.dim() >= 2, "fused.", op, ": b must have at least 2 dims [*B, M, D], got shape ", b.sizes());
  TORCH_CHECK(a.size(-1) == b.size(-1), "fused.", op, ": a and b must have the same last dim D, got ", a.size(-1),
              " and ", b.size(-1));
  const int64_t nd = std::max(a.dim(), b.dim()) - 2;
  std::vector<int64_t> batch(nd);
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t ia = a.dim() - 3 - i, ib = b.dim() - 3 - i;
    const int64_t sa = ia >= 0 ? a.size(ia) : 1, sb = ib >= 0 ? b.size(ib) : 1;
    TORCH_CHECK(sa == sb || sa == 1 || sb == 1, "fused.", op, ": the batch dims of a ", a.sizes(), " and b ", b.sizes(),
                " do not broadcast");
    batch[nd - 1 - i] = sa == 1 ? sb : sa;
  }
  Batched r;
  r.batch = batch;
  r.N = a.size(-2), r.M = b.size(-2), r.D = a.size(-1);
  r.B = 1;
  for (int64_t s : batch) r.B *= s;
  const auto math = at::toOpMathType(a.scalar_type());
  auto flat = [&](const at::Tensor& t, int64_t rows) {
    std::vector<int64_t> shape(batch);
    shape.push_back(rows);
    shape.push_back(r.D);
    at::Tensor flat = t.expand(shape).reshape({r.B, rows, r.D});
    return (to_math ? flat.to(math) : flat).contiguous();
  };
  r.a = flat(a, r.N);
  r.b = flat(b, r.M);
  return r;
}

// A padded batch's valid row counts: `lengths` (int64, the shape of t's batch dims, on t's device) broadcast to the
// batch and flattened to [B]; every count in [0, rows]. Undefined when not given (every row valid). Reading the
// counts syncs a CUDA device.
inline at::Tensor batch_lengths(const char* op, const char* name, const c10::optional<at::Tensor>& lengths,
                                const char* t_name, const at::Tensor& t, const Batched& x, int64_t rows) {
  if (!lengths.has_value()) return at::Tensor();
  const at::Tensor& l = *lengths;
  TORCH_CHECK(l.scalar_type() == at::kLong, "fused.", op, ": ", name, " must be an int64 tensor, got ",
              dtype_name(l.scalar_type()));
  TORCH_CHECK(l.device() == t.device(), "fused.", op, ": ", name, " is on ", l.device(), " but ", t_name, " is on ",
              t.device());
  const auto batch_dims = t.sizes().slice(0, t.dim() - 2);
  TORCH_CHECK(l.sizes() == batch_dims, "fused.", op, ": ", name, " must have the batch shape of ", t_name, " ",
              batch_dims, ", got ", l.sizes());
  at::Tensor flat = l.expand(x.batch).reshape({x.B}).contiguous();
  if (flat.numel()) {
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    TORCH_CHECK(lo >= 0, "fused.", op, ": ", name, " must not be negative, got ", lo);
    TORCH_CHECK(hi <= rows, "fused.", op, ": ", name, " has a length ", hi, " larger than the padded size ", rows,
                " of ", t_name);
  }
  return flat;
}

// batch_lengths of a (lengths_a) and b (lengths_b).
struct BothLengths {
  at::Tensor a, b;
};
inline BothLengths both_lengths(const char* op, const c10::optional<at::Tensor>& lengths_a,
                                const c10::optional<at::Tensor>& lengths_b, const at::Tensor& a, const at::Tensor& b,
                                const Batched& x) {
  return {batch_lengths(op, "lengths_a", lengths_a, "a", a, x, x.N),
          batch_lengths(op, "lengths_b", lengths_b, "b", b, x, x.M)};
}

// The valid rows of batch bi: lengths[bi], or all `rows` without lengths (CPU lengths from batch_lengths).
struct Lengths {
  const int64_t* counts;
  int64_t rows;
  Lengths(const at::Tensor& flat, int64_t rows_)
      : counts(flat.defined() ? flat.data_ptr<int64_t>() : nullptr), rows(rows_) {}
  int64_t operator()(int64_t bi) const { return counts ? counts[bi] : rows; }
};

inline std::vector<int64_t> out_shape(const Batched& x, int64_t last) {
  std::vector<int64_t> s(x.batch);
  s.push_back(x.N);
  s.push_back(last);
  return s;
}

// Each op's whole check sequence, run by its CPU kernel and its CUDA binding alike: the inputs batched (in the math
// type when to_math, as the CPU kernels compute).
inline Batched check_pairwise_distances(const char* op, const at::Tensor& a, const at::Tensor& b, double p,
                                        bool squared, bool to_math) {
  check_p(op, p, squared);
  return batched(op, a, b, to_math);
}

// grad and dist: a's dtype and device, the distances' shape.
inline Batched check_pairwise_distances_backward(const char* op, const at::Tensor& grad, const at::Tensor& a,
                                                 const at::Tensor& b, const at::Tensor& dist, double p, bool squared,
                                                 bool to_math) {
  Batched x = check_pairwise_distances(op, a, b, p, squared, to_math);
  check_like(op, "grad", grad, "a", a);
  check_like(op, "dist", dist, "a", a);
  const auto expected = out_shape(x, x.M);
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(expected), "fused.", op, ": grad shape ", grad.sizes(),
              " does not match the distances' shape ", at::IntArrayRef(expected));
  TORCH_CHECK(dist.sizes() == grad.sizes(), "fused.", op, ": dist shape ", dist.sizes(), " does not match grad shape ",
              grad.sizes());
  return x;
}

inline Batched check_pairwise_topk(const char* op, const at::Tensor& a, const at::Tensor& b, int64_t k, double p,
                                   bool squared, bool to_math) {
  Batched x = check_pairwise_distances(op, a, b, p, squared, to_math);
  TORCH_CHECK(k >= 0, "fused.", op, ": k must be >= 0, got ", k);
  TORCH_CHECK(k <= x.M, "fused.", op, ": k (", k, ") is larger than the number of points in b (", x.M, ")");
  return x;
}

inline Batched check_radius_neighbors(const char* op, const at::Tensor& a, const at::Tensor& b, double radius,
                                      int64_t max_neighbors, double p, bool to_math) {
  check_p(op, p, false);
  TORCH_CHECK(radius >= 0, "fused.", op, ": radius must be in [0, inf], got ", radius);
  TORCH_CHECK(max_neighbors >= 1, "fused.", op, ": max_neighbors must be >= 1, got ", max_neighbors);
  return batched(op, a, b, to_math);
}

// grad, values (a's dtype and device) and int64 indices, all [*B, N, k].
inline Batched check_pairwise_topk_backward(const char* op, const at::Tensor& grad, const at::Tensor& a,
                                            const at::Tensor& b, const at::Tensor& values, const at::Tensor& indices,
                                            double p, bool squared, bool to_math) {
  Batched x = check_pairwise_distances(op, a, b, p, squared, to_math);
  check_like(op, "grad", grad, "a", a);
  check_like(op, "values", values, "a", a);
  TORCH_CHECK(indices.scalar_type() == at::kLong, "fused.", op, ": indices must be int64, got ", indices.scalar_type());
  TORCH_CHECK(grad.sizes() == values.sizes() && indices.sizes() == values.sizes() && values.dim() >= 2 &&
                  values.size(-2) == x.N,
              "fused.", op, ": grad ", grad.sizes(), ", values ", values.sizes(), " and indices ", indices.sizes(),
              " must share the shape [*B, N, k]");
  return x;
}

// Sums a gradient over the broadcast batch dims back to the input's shape, in the input's dtype.
inline at::Tensor reduce_to(const at::Tensor& g, const Batched& x, int64_t rows, const at::Tensor& like) {
  std::vector<int64_t> shape(x.batch);
  shape.push_back(rows);
  shape.push_back(x.D);
  return g.reshape(shape).sum_to_size(like.sizes()).to(like.scalar_type());
}

}  // namespace distance
}  // namespace fused
