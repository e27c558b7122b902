// The trainer's models (examples/train/model.h) as the advisor's layers: parameters and the
// multiply-adds of each layer, two FLOPs each. Backward costs twice the forward (the
// gradients of the weights and of the inputs), but for the first layer, whose input needs none.
#include <charconv>

#include "gradsync/advise.h"
#include "gradsync/error.h"

namespace gradsync::advise {

namespace {

constexpr std::size_t kPixels = 28 * 28, kClasses = 10;

Layer linear(const std::string& name, std::size_t in, std::size_t out, bool first) {
  const double macs = static_cast<double>(in * out);
  return {name, {{in * out, out}, {out, 0}}, 2 * macs, (first ? 2 : 4) * macs};
}

// 5x5 convolution, padding 2, over a side x side image.
Layer conv(const std::string& name, std::size_t in, std::size_t out, std::size_t side, bool first) {
  const double macs = 25.0 * in * out * side * side;
  return {name, {{25 * in * out, out}, {out, 0}}, 2 * macs, (first ? 2 : 4) * macs};
}

[[noreturn]] void refuse(const std::string& model) {
  throw Error(ErrorKind::kInvalidArgument,
              "model '" + model + "': known are mlp, mlp:H1,H2,... (hidden sizes) and cnn",
              Error::kUnknownRank, Error::kNoPeer, "advise");
}

std::vector<std::size_t> hidden_sizes(const std::string& model, std::string_view text) {
  std::vector<std::size_t> sizes;
  while (!text.empty()) {
    const auto comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    std::size_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || end != item.data() + item.size() || v == 0) refuse(model);
    sizes.push_back(v);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  if (sizes.empty()) refuse(model);
  return sizes;
}

}  // namespace

Workload model_workload(const std::string& model, std::size_t batch, std::string optimizer) {
  Workload w;
  w.name = model;
  w.batch = batch;
  w.optimizer = std::move(optimizer);
  if (model == "cnn") {
    w.layers = {conv("conv1", 1, 16, 28, true), conv("conv2", 16, 32, 14, false),
                linear("fc1", 32 * 7 * 7, 128, false), linear("fc2", 128, kClasses, false)};
    return w;
  }
  std::vector<std::size_t> hidden{2048, 2048, 2048, 2048};
  if (model.rfind("mlp:", 0) == 0) {
    hidden = hidden_sizes(model, std::string_view(model).substr(4));
  } else if (model != "mlp") {
    refuse(model);
  }
  std::size_t in = kPixels;
  for (std::size_t i = 0; i <= hidden.size(); ++i) {
    const std::size_t out = i < hidden.size() ? hidden[i] : kClasses;
    w.layers.push_back(linear("fc" + std::to_string(i + 1), in, out, i == 0));
    in = out;
  }
  return w;
}

}  // namespace gradsync::advise
