// PowerSGD: rank-R approximation of each matrix gradient by one step of subspace iteration,
// warm-started from the previous step's Q (Vogels, Karimireddy and Jaggi, NeurIPS 2019).
#include <algorithm>
#include <cmath>

#include "compress/codecs.h"

namespace gradsync::compress {

namespace {

constexpr char kMagic[4] = {'G', 'S', 'P', 'W'};
constexpr std::size_t kHeader = 12;  // u32 rows, u32 cols, u32 rank (0 = float32 values)

// Q is kept transposed (r x cols), so that every loop below runs along a row of M with unit
// stride: the dot products in independent lanes (no reassociation needed to vectorise, and
// the same bits on every machine), the other two as axpy.
constexpr std::size_t kLanes = 16;

// p (rows x r) = m (rows x cols) qt^T, qt being r x cols.
void multiply(const float* m, const float* qt, float* p, std::size_t rows, std::size_t cols,
              std::size_t r) {
  const std::size_t whole = cols / kLanes * kLanes;
  for (std::size_t i = 0; i < rows; ++i) {
    const float* row = m + i * cols;
    for (std::size_t j = 0; j < r; ++j) {
      const float* q = qt + j * cols;
      float lanes[kLanes] = {};
      for (std::size_t c = 0; c < whole; c += kLanes) {
        for (std::size_t l = 0; l < kLanes; ++l) lanes[l] += row[c + l] * q[c + l];
      }
      float sum = 0;
      for (std::size_t c = whole; c < cols; ++c) sum += row[c] * q[c];
      for (std::size_t l = 0; l < kLanes; ++l) sum += lanes[l];
      p[i * r + j] = sum;
    }
  }
}

// qt (r x cols) = (m^T p)^T: row j of qt accumulates p[i][j] times row i of m.
void multiply_transposed(const float* m, const float* p, float* qt, std::size_t rows,
                         std::size_t cols, std::size_t r) {
  std::fill(qt, qt + cols * r, 0.0f);
  for (std::size_t i = 0; i < rows; ++i) {
    const float* row = m + i * cols;
    for (std::size_t j = 0; j < r; ++j) {
      const float pij = p[i * r + j];
      float* q = qt + j * cols;
      for (std::size_t c = 0; c < cols; ++c) q[c] += pij * row[c];
    }
  }
}

// Gram-Schmidt on the r columns of p (rows x r), accumulating in double: the columns become
// orthonormal, or zero where a column depends on the earlier ones (a gradient of lower rank).
void orthonormalize(float* p, std::size_t rows, std::size_t r) {
  for (std::size_t j = 0; j < r; ++j) {
    for (std::size_t k = 0; k < j; ++k) {
      double dot = 0;
      for (std::size_t i = 0; i < rows; ++i) dot += double(p[i * r + j]) * p[i * r + k];
      for (std::size_t i = 0; i < rows; ++i) p[i * r + j] -= static_cast<float>(dot) * p[i * r + k];
    }
    double norm = 0;
    for (std::size_t i = 0; i < rows; ++i) norm += double(p[i * r + j]) * p[i * r + j];
    norm = std::sqrt(norm);
    const float inverse = norm > 1e-30 ? static_cast<float>(1.0 / norm) : 0.0f;
    for (std::size_t i = 0; i < rows; ++i) p[i * r + j] *= inverse;
  }
}

// out (rows x cols) = p (rows x r) qt (r x cols), divided by `divisor`.
void reconstruct(const float* p, const float* qt, float* out, std::size_t rows, std::size_t cols,
                 std::size_t r, int divisor) {
  const float d = static_cast<float>(divisor);
  for (std::size_t i = 0; i < rows; ++i) {
    float* o = out + i * cols;
    std::fill(o, o + cols, 0.0f);
    for (std::size_t j = 0; j < r; ++j) {
      const float pij = p[i * r + j];
      const float* q = qt + j * cols;
      for (std::size_t c = 0; c < cols; ++c) o[c] += pij * q[c];
    }
    if (divisor != 1) {
      for (std::size_t c = 0; c < cols; ++c) o[c] /= d;
    }
  }
}

}  // namespace

std::string PowerSgd::spec() const {
  return "powersgd:rank=" + std::to_string(rank_) + (feedback_ ? ",ef=1" : ",ef=0");
}

std::size_t PowerSgd::effective_rank(std::size_t rows, std::size_t cols) const {
  return std::min({rank_, rows, cols});
}

bool PowerSgd::compresses(const Tensor& tensor, std::size_t count) const {
  if (tensor.rows == 0 || count == 0 || count % tensor.rows != 0) return false;
  const std::size_t rows = tensor.rows, cols = count / rows;
  return effective_rank(rows, cols) * (rows + cols) < count;
}

std::span<const float> PowerSgd::owed(const Tensor& tensor, std::span<const float> data) {
  if (!feedback_) return data;
  std::vector<float>& r = state_["r:" + tensor.name];
  if (r.empty()) r.assign(data.size(), 0.0f);
  if (r.size() != data.size()) {
    throw Error(ErrorKind::kInvalidArgument,
                "tensor '" + tensor.name + "' has " + std::to_string(data.size()) +
                    " elements, its PowerSGD residual " + std::to_string(r.size()) +
                    ": one name per tensor",
                Error::kUnknownRank, Error::kNoPeer, "encode");
  }
  m_.resize(data.size());
  for (std::size_t i = 0; i < data.size(); ++i) m_[i] = r[i] + data[i];
  return m_;
}

std::vector<float>& PowerSgd::factorize(const Tensor& tensor, std::span<const float> m,
                                        const Sum& sum) {
  const std::size_t rows = tensor.rows, cols = m.size() / rows, r = effective_rank(rows, cols);
  std::vector<float>& q = state_["q:" + tensor.name];
  if (q.size() != cols * r) {
    // The first step's Q: a draw every rank makes alike (seeded by the tensor's name).
    q.resize(cols * r);
    std::uint64_t rng = name_hash(tensor.name);
    for (float& x : q) x = 2.0f * uniform01(rng) - 1.0f;
  }
  p_.resize(rows * r);
  multiply(m.data(), q.data(), p_.data(), rows, cols, r);
  sum(p_);
  orthonormalize(p_.data(), rows, r);
  multiply_transposed(m.data(), p_.data(), q.data(), rows, cols, r);
  sum(q);
  return q;
}

void PowerSgd::reduce(const Tensor& tensor, std::span<float> data, const Sum& sum, int ranks,
                      int divisor) {
  const std::span<const float> m = owed(tensor, data);
  const std::size_t rows = tensor.rows, cols = data.size() / rows, r = effective_rank(rows, cols);
  const std::vector<float>& q = factorize(tensor, m, sum);
  if (feedback_) {
    // What this rank is owed beyond its share of the result stays for the next step; over all
    // ranks, residuals + the sum = the sum of what was owed.
    std::vector<float>& residual = state_["r:" + tensor.name];
    reconstruct(p_.data(), q.data(), data.data(), rows, cols, r, 1);
    const float n = static_cast<float>(ranks);
    for (std::size_t i = 0; i < data.size(); ++i) residual[i] = m[i] - data[i] / n;
    if (divisor != 1) {
      const float d = static_cast<float>(divisor);
      for (float& x : data) x /= d;
    }
  } else {
    reconstruct(p_.data(), q.data(), data.data(), rows, cols, r, divisor);
  }
}

void PowerSgd::encode(const Tensor& tensor, std::span<const float> in,
                      std::vector<std::uint8_t>& out) {
  check_encodable("powersgd", tensor, in.size());
  if (!compresses(tensor, in.size())) {
    out.resize(kHeader + 4 * in.size());
    put_u32(out, 0, 1);
    put_u32(out, 4, static_cast<std::uint32_t>(in.size()));
    put_u32(out, 8, 0);
    if (!in.empty()) std::memcpy(out.data() + kHeader, in.data(), 4 * in.size());
    return;
  }
  const std::size_t rows = tensor.rows, cols = in.size() / rows, r = effective_rank(rows, cols);
  const std::span<const float> m = owed(tensor, in);
  const std::vector<float>& q = factorize(tensor, m, [](std::span<float>) {});
  out.resize(kHeader + 4 * (rows + cols) * r);
  put_u32(out, 0, static_cast<std::uint32_t>(rows));
  put_u32(out, 4, static_cast<std::uint32_t>(cols));
  put_u32(out, 8, static_cast<std::uint32_t>(r));
  std::memcpy(out.data() + kHeader, p_.data(), 4 * rows * r);
  std::memcpy(out.data() + kHeader + 4 * rows * r, q.data(), 4 * cols * r);
  if (feedback_) {
    std::vector<float>& residual = state_["r:" + tensor.name];
    reconstruct(p_.data(), q.data(), residual.data(), rows, cols, r, 1);
    for (std::size_t i = 0; i < in.size(); ++i) residual[i] = m[i] - residual[i];
  }
}

void PowerSgd::decode(std::span<const std::uint8_t> payload, std::span<float> out) const {
  if (payload.size() < kHeader) bad_payload("powersgd", "shorter than its 12-byte header");
  const std::size_t rows = get_u32(payload, 0), cols = get_u32(payload, 4), r = get_u32(payload, 8);
  if (rows * cols != out.size()) {
    bad_payload("powersgd", std::to_string(rows) + " x " + std::to_string(cols) + ", expected " +
                                std::to_string(out.size()) + " elements");
  }
  if (r == 0) {
    expect_bytes("powersgd", payload, kHeader + 4 * out.size(), out.size());
    if (!out.empty()) std::memcpy(out.data(), payload.data() + kHeader, 4 * out.size());
    return;
  }
  if (r > std::min(rows, cols)) {
    bad_payload("powersgd", "rank " + std::to_string(r) + " above min(" + std::to_string(rows) +
                                ", " + std::to_string(cols) + ")");
  }
  expect_bytes("powersgd", payload, kHeader + 4 * (rows + cols) * r, out.size());
  std::vector<float> p(rows * r), q(cols * r);
  std::memcpy(p.data(), payload.data() + kHeader, 4 * p.size());
  std::memcpy(q.data(), payload.data() + kHeader + 4 * p.size(), 4 * q.size());
  for (float x : p) {
    if (!std::isfinite(x)) bad_payload("powersgd", "P holds " + std::to_string(x));
  }
  for (float x : q) {
    if (!std::isfinite(x)) bad_payload("powersgd", "Q holds " + std::to_string(x));
  }
  reconstruct(p.data(), q.data(), out.data(), rows, cols, r, 1);
}

std::span<const float> PowerSgd::held_back(const std::string& tensor) const {
  const auto residual = state_.find("r:" + tensor);
  return residual == state_.end() ? std::span<const float>()
                                  : std::span<const float>(residual->second);
}

std::vector<std::uint8_t> PowerSgd::save_state() const {
  return save_tensor_state(kMagic, state_);
}

void PowerSgd::load_state(std::span<const std::uint8_t> state) {
  state_ = load_tensor_state(kMagic, state);
}

std::unique_ptr<Codec> make_powersgd(const CodecSpec& s) {
  return std::make_unique<PowerSgd>(static_cast<std::size_t>(s.value("rank")), s.get("ef", 1) != 0);
}

}  // namespace gradsync::compress
