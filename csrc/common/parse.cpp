#include <cstdlib>
#include <string>

#include "common/cpu_utils.h"

namespace fused {
namespace {

// The names from first to last, joined by sep.
std::string join(const char* const* names, int first, int last, const char* sep) {
  std::string out;
  for (int i = first; i < last; ++i) out += (i > first ? sep : "") + std::string(names[i]);
  return out;
}

}  // namespace

Act parse_act(const char* op, c10::string_view act) {
  for (int i = 0; i < kActCount; ++i)
    if (act == kActNames[i]) return static_cast<Act>(i);
  TORCH_CHECK(false, "fused.", op, ": unknown act '", std::string(act), "'; expected one of ",
              join(kActNames, 0, kActCount, ", "));
}

std::pair<UnaryOp, double> parse_unary(const char* op, c10::string_view spec) {
  auto colon = spec.find(':');
  c10::string_view name = spec.substr(0, colon);
  for (int i = 0; i < kUnaryOpCount; ++i) {
    if (name != kUnaryOpNames[i]) continue;
    bool wants_scalar = i >= kFirstScalarOp;
    TORCH_CHECK(wants_scalar == (colon != c10::string_view::npos), "fused.", op, ": op '", std::string(name),
                wants_scalar ? "' needs a scalar, as (name, value)" : "' takes no scalar");
    double s = 0.0;
    if (wants_scalar) {
      std::string text(spec.substr(colon + 1));
      char* end = nullptr;
      s = std::strtod(text.c_str(), &end);
      TORCH_CHECK(!text.empty() && end == text.c_str() + text.size(), "fused.", op, ": bad scalar in op '",
                  std::string(spec), "'");
    }
    return {static_cast<UnaryOp>(i), s};
  }
  TORCH_CHECK(false, "fused.", op, ": unknown op '", std::string(name), "'; expected one of ",
              join(kUnaryOpNames, 0, kFirstScalarOp, " "),
              ", or with a scalar: ", join(kUnaryOpNames, kFirstScalarOp, kUnaryOpCount, " "));
}

}  // namespace fused
