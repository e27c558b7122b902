// What the usage examples of the public headers and of README.md's "Using it" section may use
// without declaring it. tests/extract_examples.cmake makes each example the body of a test of
// this fixture (its top comment says how an example is marked), so an example compiles against
// the public headers alone and runs.
//
// The world is one rank: every example runs there, which checks more than that it compiles
// (a Reducer step whose gradients were never marked ready throws), and none may need a peer.
#pragma once

#include <gtest/gtest.h>

// Beside the public headers, an example may take for granted the standard headers below (the
// README's std::printf, the Reducer example's std::views::reverse).
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"

class HeaderExample : public ::testing::Test {
 protected:
  // A model parameter as a training loop keeps it: its name (codecs keep their state under it),
  // its gradient, its rows for PowerSGD (0: a vector) and the id a Reducer gave it.
  struct Parameter {
    std::string name;
    std::vector<float> grad;
    std::size_t rows = 0;
    int id = -1;
  };

  // Rank 0 of a world of one, whatever RANK and WORLD_SIZE say. Field by field: designated
  // initializers would leave the strings of Options to -Wmissing-field-initializers.
  static std::unique_ptr<gradsync::Context> world_of_one() {
    gradsync::Options options;
    options.rank = 0;
    options.size = 1;
    return gradsync::init(options);
  }

  // Stand-ins for the model's passes: the examples show where they go, not what they compute.
  void forward() {}
  void backward(Parameter& p) { std::fill(p.grad.begin(), p.grad.end(), 0.5f); }

  // This rank's context.
  std::unique_ptr<gradsync::Context> ctx = world_of_one();
  // This rank's gradient of "fc1.weight", a 784 x 16 matrix.
  std::vector<float> grad = std::vector<float>(784 * 16, 0.25f);
  // Flat float32 parameters, one per element of `grad`.
  std::vector<float> weights = std::vector<float>(grad.size(), 1.0f);
  // A two-layer model's parameters, in the order forward uses them.
  std::vector<Parameter> parameters = {
      {.name = "fc1.weight", .grad = std::vector<float>(784 * 16), .rows = 784},
      {.name = "fc1.bias", .grad = std::vector<float>(16)},
      {.name = "fc2.weight", .grad = std::vector<float>(16 * 10), .rows = 16},
      {.name = "fc2.bias", .grad = std::vector<float>(10)},
  };
  // A layer as a sharded model keeps it: its initial weights and bias, back to back, and the
  // unit a ShardedDataParallel gave it; forward and backward stand in for its computation.
  struct Layer {
    std::string name;
    std::vector<float> initial_values;
    int unit = -1;
    void forward(std::span<const float>) {}
    void backward(std::span<const float>, std::span<float> grad) {
      std::fill(grad.begin(), grad.end(), 0.5f);
    }
  };
  std::vector<Layer> layers = {{.name = "fc1", .initial_values = std::vector<float>(784 * 16 + 16)},
                               {.name = "fc2", .initial_values = std::vector<float>(16 * 10 + 10)}};
  // Training steps a loop runs.
  int steps = 2;
};
