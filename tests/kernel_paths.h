// Both paths of the kernels for tests: the scalar one, which a test can force, and the vector
// one where this CPU has it.
#pragma once

#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace gradsync::kernels {

// Forces the scalar path for one scope.
class ScopedScalar {
 public:
  explicit ScopedScalar(bool on) { force_scalar(on); }
  ~ScopedScalar() { force_scalar(false); }
  ScopedScalar(const ScopedScalar&) = delete;
  ScopedScalar& operator=(const ScopedScalar&) = delete;
};

inline bool have_vector_path() {
  force_scalar(false);
  return std::string(isa_name()) != "scalar";
}

// "Force scalar" values to run a check under: scalar always; the vector path too when this
// CPU has it.
inline std::vector<bool> paths() {
  std::vector<bool> p{true};
  if (have_vector_path()) p.push_back(false);
  return p;
}

}  // namespace gradsync::kernels
