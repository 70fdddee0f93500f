#include "runtime/nonfinite.h"

#include <cmath>

#include "runtime/error.h"
#include "runtime/shape_str.h"

namespace sluice {
namespace {

bool can_hold_nonfinite(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

std::string value_str(double v) {
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

}  // namespace

bool all_finite(const at::Tensor& t) {
  if (!can_hold_nonfinite(t)) return true;
  return at::isfinite(t).all().item<bool>();
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flags;
  for (const auto& t : tensors)
    if (can_hold_nonfinite(t)) flags.push_back(at::isfinite(t).all().reshape({1}));
  if (flags.empty()) return true;
  for (const auto& f : flags)
    if (f.device() != flags.front().device()) {
      for (const auto& g : flags)
        if (!g.item<bool>()) return false;
      return true;
    }
  return flags.size() == 1 ? flags.front().item<bool>() : at::cat(flags).all().item<bool>();
}

std::optional<NonFiniteValues> find_nonfinite(const at::Tensor& t) {
  if (all_finite(t)) return std::nullopt;
  const at::Tensor bad = at::logical_not(at::isfinite(t)).reshape({-1});
  NonFiniteValues v;
  v.count = bad.sum().item<int64_t>();
  v.numel = t.numel();
  int64_t flat = bad.to(at::kByte).argmax().item<int64_t>();  // the first maximum: the first non-finite
  const at::Tensor value = t.reshape({-1})[flat];
  v.first_value = at::isComplexType(t.scalar_type()) ? at::real(value).item<double>() : value.item<double>();
  if (std::isfinite(v.first_value)) v.first_value = at::imag(value).item<double>();  // complex: the imaginary part
  v.first_index.assign(static_cast<size_t>(t.dim()), 0);
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    v.first_index[static_cast<size_t>(d)] = flat % t.size(d);
    flat /= t.size(d);
  }
  return v;
}

std::string describe(const NonFiniteValues& v) {
  return std::to_string(v.count) + " non-finite value" + (v.count == 1 ? "" : "s") + " (first at " +
         shape_str(v.first_index) + ": " + value_str(v.first_value) + ")";
}

void require_finite(const at::Tensor& t, const std::string& what) {
  if (const auto v = find_nonfinite(t)) throw InvalidArgument(what + " has " + describe(*v));
}

}  // namespace sluice
