// The selection order of pairwise_topk and radius_neighbors on the CPU (the direct path's running k-best and the
// GEMM path's exact re-rank), radius_neighbors' bound, and the slots of missing neighbours.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace fused {
namespace distance {

// The selection order as one integer per candidate: the value's rank key in the high 64 bits (smallest first,
// or largest first; NaN last, or first, as torch.topk ranks it; -0 == +0) and the column in the low 64 bits, so
// ties go to the lower index and every comparison is a plain integer compare.
using Key = unsigned __int128;
struct Order {
  bool largest;
  static uint64_t monotone(double v) {  // bits of v, mapped so that unsigned order is numeric order
    uint64_t u;
    v += 0.0;  // -0 -> +0
    std::memcpy(&u, &v, sizeof u);
    return u >> 63 ? ~u : u | (uint64_t(1) << 63);
  }
  uint64_t rank(double v) const {
    if (std::isnan(v)) return largest ? 0 : ~uint64_t(0);
    return largest ? ~monotone(v) : monotone(v);
  }
  double value(Key key) const {
    uint64_t r = static_cast<uint64_t>(key >> 64);
    if (r == (largest ? 0 : ~uint64_t(0))) return std::numeric_limits<double>::quiet_NaN();
    if (largest) r = ~r;
    const uint64_t u = r >> 63 ? r & ~(uint64_t(1) << 63) : ~r;
    double v;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
  Key key(double v, int64_t j) const { return Key(rank(v)) << 64 | Key(static_cast<uint64_t>(j)); }
};

// radius_neighbors' bound in the output dtype S, whose values the selection compares: `floor`, the largest S
// value not above the radius (a candidate is in when its rounded value is <= floor), and `next`, the S value
// after it (a candidate not yet rounded can only be in when it is below next: the direct path's prefilter
// KBest::may_beat, the GEMM path's initial bound).
struct RadiusBound {
  double floor, next;
  // Whether a distance v (not yet rounded) is in: its value rounded to S, as it would be returned, is <= floor.
  template <typename S> bool holds(double v) const { return static_cast<double>(static_cast<S>(v)) <= floor; }
};
template <typename S> S step(S v, bool up) {  // the neighbouring S value of a positive v
  if constexpr (std::is_floating_point_v<S>) {
    return std::nextafter(v, up ? std::numeric_limits<S>::infinity() : -std::numeric_limits<S>::infinity());
  } else {  // at::Half, at::BFloat16: positive values are ordered as their bits
    S r = v;
    r.x = static_cast<uint16_t>(up ? v.x + 1 : v.x - 1);
    return r;
  }
}
template <typename S> RadiusBound radius_bound(double radius) {
  S floor = static_cast<S>(radius);  // the nearest value, or (16-bit: rounded via float) its neighbour
  if (static_cast<double>(floor) > radius) floor = step(floor, false);
  const double f = static_cast<double>(floor);
  return {f, std::isinf(f) ? f : static_cast<double>(step(floor, true))};
}

// Slots without a neighbour: index -1, value inf (-inf when largest, so that the values stay sorted).
template <typename scalar_t> void write_missing(scalar_t* values, int64_t* indices, int64_t n, bool largest) {
  const double inf = std::numeric_limits<double>::infinity();
  std::fill(values, values + n, static_cast<scalar_t>(largest ? -inf : inf));
  std::fill(indices, indices + n, int64_t(-1));
}

}  // namespace distance
}  // namespace fused
