#include <cstdlib>
#include <string>

#include "common/cpu_utils.h"

namespace fused {

static const char* kActNames[] = {"identity", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"};
static const char* kUnaryNames[] = {"neg",  "abs",     "square", "sqrt", "rsqrt",     "exp",        "log",
                                    "sin",  "cos",     "tanh",   "sigmoid", "relu",   "gelu",       "gelu_tanh",
                                    "silu", "reciprocal", "add", "mul",    "pow",     "clamp_min", "clamp_max"};
constexpr int kFirstScalarOp = static_cast<int>(UnaryOp::add);

Act parse_act(const char* op, c10::string_view act) {
  for (int i = 0; i < 7; ++i)
    if (act == kActNames[i]) return static_cast<Act>(i);
  TORCH_CHECK(false, "fused.", op, ": unknown act '", std::string(act),
              "'; expected one of identity, relu, gelu, gelu_tanh, silu, sigmoid, tanh");
}

std::pair<UnaryOp, double> parse_unary(const char* op, c10::string_view spec) {
  auto colon = spec.find(':');
  c10::string_view name = spec.substr(0, colon);
  for (int i = 0; i < static_cast<int>(sizeof(kUnaryNames) / sizeof(*kUnaryNames)); ++i) {
    if (name != kUnaryNames[i]) continue;
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
  TORCH_CHECK(false, "fused.", op, ": unknown op '", std::string(name),
              "'; expected one of neg abs square sqrt rsqrt exp log sin cos tanh sigmoid relu gelu gelu_tanh silu "
              "reciprocal, or with a scalar: add mul pow clamp_min clamp_max");
}

}  // namespace fused
