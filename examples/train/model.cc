// The trainer's models: a sequence of layers over row-major batches, every dense product an
// OpenBLAS sgemm (one thread per rank: the ranks are the parallelism), activation buffers
// grown once and reused so a training step allocates nothing.
#include "train/model.h"

#include <cblas.h>
#include <gradsync/sharded.h>
#include <gradsync/timeline.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "train/random.h"

namespace train {
namespace {

constexpr std::size_t kImageSide = 28;
constexpr std::size_t kImagePixels = kImageSide * kImageSide;
constexpr std::size_t kClasses = 10;

// Grows, never shrinks: a smaller batch (the epoch's last) reuses the memory of a larger one.
template <typename T>
T* ensure(std::vector<T>& buffer, std::size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

int blas_int(std::size_t n) {
  return static_cast<int>(n);
}

// One layer over a batch of `batch` samples, each in_size() floats in, out_size() floats out.
// forward's input must stay valid until backward (it is the previous layer's output, or the
// model's copy of the images).
class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::size_t in_size() const = 0;
  virtual std::size_t out_size() const = 0;
  virtual const float* forward(const float* in, std::size_t batch) = 0;
  // Gradient of the input from the gradient of the output; nullptr when !need_input_grad (the
  // first layer: nobody wants the images' gradient, and skipping it saves a whole product).
  virtual const float* backward(const float* dout, bool need_input_grad, bool accumulate,
                                const GradReady& ready) = 0;
  // Layers with weights: their (weight, bias) shapes, then where those live once allocated.
  virtual bool has_parameters() const { return false; }
  virtual std::size_t weight_rows() const { return 0; }
  virtual std::size_t fan_in() const { return 0; }
  virtual void bind(Parameter&, Parameter&, std::size_t, std::size_t) {}
  // Points the layer at a unit's values (its weight then its bias) and, for backward, at where
  // its gradients go (empty in forward).
  virtual void bind_unit(std::span<const float>, std::span<float>) {}
};

class ParameterLayer : public Layer {
 public:
  bool has_parameters() const override { return true; }
  void bind(Parameter& weight, Parameter& bias, std::size_t weight_index,
            std::size_t bias_index) override {
    w_ = weight.value.data();
    dw_ = weight.grad.data();
    b_ = bias.value.data();
    db_ = bias.grad.data();
    weight_index_ = weight_index;
    bias_index_ = bias_index;
    weights_ = weight.count;
  }
  void bind_unit(std::span<const float> values, std::span<float> grads) override {
    w_ = values.data();
    b_ = values.data() + weights_;
    dw_ = grads.empty() ? nullptr : grads.data();
    db_ = grads.empty() ? nullptr : grads.data() + weights_;
  }

 protected:
  void announce(const GradReady& ready, std::size_t index) const {
    if (ready) ready(index);
  }
  const float* w_ = nullptr;
  float* dw_ = nullptr;
  const float* b_ = nullptr;
  float* db_ = nullptr;
  std::size_t weight_index_ = 0, bias_index_ = 0, weights_ = 0;
};

// y = x W^T + b with W out x in (PyTorch's layout, so a weight's rows are its out features).
class Linear final : public ParameterLayer {
 public:
  Linear(std::size_t in, std::size_t out) : in_(in), out_(out) {}
  std::size_t in_size() const override { return in_; }
  std::size_t out_size() const override { return out_; }
  std::size_t weight_rows() const override { return out_; }
  std::size_t fan_in() const override { return in_; }

  const float* forward(const float* in, std::size_t batch) override {
    x_ = in;
    batch_ = batch;
    float* y = ensure(y_, batch * out_);
    // The bias first, then the product adds onto it (beta = 1): no second pass over y.
    for (std::size_t r = 0; r < batch; ++r) std::memcpy(y + r * out_, b_, out_ * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(batch), blas_int(out_),
                blas_int(in_), 1.0f, x_, blas_int(in_), w_, blas_int(in_), 1.0f, y, blas_int(out_));
    return y;
  }

  const float* backward(const float* dy, bool need_input_grad, bool accumulate,
                        const GradReady& ready) override {
    // dW (out x in) = dY^T X, summed over the batch by the product itself.
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, blas_int(out_), blas_int(in_),
                blas_int(batch_), 1.0f, dy, blas_int(out_), x_, blas_int(in_),
                accumulate ? 1.0f : 0.0f, dw_, blas_int(in_));
    announce(ready, weight_index_);
    if (!accumulate) std::fill(db_, db_ + out_, 0.0f);
    for (std::size_t r = 0; r < batch_; ++r) {
      const float* row = dy + r * out_;
      for (std::size_t o = 0; o < out_; ++o) db_[o] += row[o];
    }
    announce(ready, bias_index_);
    if (!need_input_grad) return nullptr;
    // dX (batch x in) = dY W.
    float* dx = ensure(dx_, batch_ * in_);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_int(batch_), blas_int(in_),
                blas_int(out_), 1.0f, dy, blas_int(out_), w_, blas_int(in_), 0.0f, dx,
                blas_int(in_));
    return dx;
  }

 private:
  std::size_t in_, out_;
  const float* x_ = nullptr;
  std::size_t batch_ = 0;
  std::vector<float> y_, dx_;
};

class ReLU final : public Layer {
 public:
  explicit ReLU(std::size_t size) : size_(size) {}
  std::size_t in_size() const override { return size_; }
  std::size_t out_size() const override { return size_; }

  const float* forward(const float* in, std::size_t batch) override {
    n_ = batch * size_;
    float* y = ensure(y_, n_);
    for (std::size_t i = 0; i < n_; ++i) y[i] = in[i] > 0.0f ? in[i] : 0.0f;
    return y;
  }

  // The mask comes from the output (y > 0 exactly where x > 0), so the input need not be kept.
  const float* backward(const float* dy, bool need_input_grad, bool, const GradReady&) override {
    if (!need_input_grad) return nullptr;
    float* dx = ensure(dx_, n_);
    for (std::size_t i = 0; i < n_; ++i) dx[i] = y_[i] > 0.0f ? dy[i] : 0.0f;
    return dx;
  }

 private:
  std::size_t size_;
  std::size_t n_ = 0;
  std::vector<float> y_, dx_;
};

// 5x5, stride 1, padding 2 (the side is kept), NCHW. Each image is unfolded (im2col) into a
// (channels*25) x (side*side) matrix, so the convolution is one sgemm with the
// out_channels x (channels*25) weight; the columns are kept for the weight gradient.
class Conv2d final : public ParameterLayer {
 public:
  static constexpr std::size_t kKernel = 5, kPad = 2;

  Conv2d(std::size_t in_channels, std::size_t out_channels, std::size_t side)
      : c_(in_channels),
        oc_(out_channels),
        side_(side),
        hw_(side * side),
        k_(in_channels * kKernel * kKernel) {}
  std::size_t in_size() const override { return c_ * hw_; }
  std::size_t out_size() const override { return oc_ * hw_; }
  std::size_t weight_rows() const override { return oc_; }
  std::size_t fan_in() const override { return k_; }

  const float* forward(const float* in, std::size_t batch) override {
    batch_ = batch;
    float* cols = ensure(cols_, batch * k_ * hw_);
    float* y = ensure(y_, batch * oc_ * hw_);
    for (std::size_t n = 0; n < batch; ++n) {
      float* col = cols + n * k_ * hw_;
      im2col(in + n * c_ * hw_, col);
      float* out = y + n * oc_ * hw_;
      for (std::size_t o = 0; o < oc_; ++o) std::fill(out + o * hw_, out + (o + 1) * hw_, b_[o]);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_int(oc_), blas_int(hw_),
                  blas_int(k_), 1.0f, w_, blas_int(k_), col, blas_int(hw_), 1.0f, out,
                  blas_int(hw_));
    }
    return y;
  }

  const float* backward(const float* dy, bool need_input_grad, bool accumulate,
                        const GradReady& ready) override {
    // dW (oc x k) = sum over images of dY_n (oc x hw) col_n^T; the first image overwrites
    // unless accumulating.
    for (std::size_t n = 0; n < batch_; ++n) {
      const float beta = (n == 0 && !accumulate) ? 0.0f : 1.0f;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(oc_), blas_int(k_),
                  blas_int(hw_), 1.0f, dy + n * oc_ * hw_, blas_int(hw_),
                  cols_.data() + n * k_ * hw_, blas_int(hw_), beta, dw_, blas_int(k_));
    }
    announce(ready, weight_index_);
    if (!accumulate) std::fill(db_, db_ + oc_, 0.0f);
    for (std::size_t n = 0; n < batch_; ++n) {
      for (std::size_t o = 0; o < oc_; ++o) {
        const float* plane = dy + (n * oc_ + o) * hw_;
        float sum = 0.0f;
        for (std::size_t i = 0; i < hw_; ++i) sum += plane[i];
        db_[o] += sum;
      }
    }
    announce(ready, bias_index_);
    if (!need_input_grad) return nullptr;
    // dX_n = col2im(W^T dY_n), one image's columns at a time (the buffer is reused).
    float* dcol = ensure(dcol_, k_ * hw_);
    float* dx = ensure(dx_, batch_ * c_ * hw_);
    for (std::size_t n = 0; n < batch_; ++n) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, blas_int(k_), blas_int(hw_),
                  blas_int(oc_), 1.0f, w_, blas_int(k_), dy + n * oc_ * hw_, blas_int(hw_), 0.0f,
                  dcol, blas_int(hw_));
      col2im(dcol, dx + n * c_ * hw_);
    }
    return dx;
  }

 private:
  // Row (c, ky, kx) of the columns holds, at (y, x), the input at (y + ky - 2, x + kx - 2),
  // zero outside the image; the valid x run of each row is worked out once, not per pixel.
  void im2col(const float* in, float* col) const {
    const auto side = static_cast<std::ptrdiff_t>(side_);
    for (std::size_t c = 0; c < c_; ++c) {
      const float* plane = in + c * hw_;
      for (std::size_t ky = 0; ky < kKernel; ++ky) {
        for (std::size_t kx = 0; kx < kKernel; ++kx) {
          float* row = col + ((c * kKernel + ky) * kKernel + kx) * hw_;
          const std::ptrdiff_t dy = static_cast<std::ptrdiff_t>(ky) - kPad;
          const std::ptrdiff_t dx = static_cast<std::ptrdiff_t>(kx) - kPad;
          const std::ptrdiff_t x0 = std::max<std::ptrdiff_t>(0, -dx);
          const std::ptrdiff_t x1 = std::min<std::ptrdiff_t>(side, side - dx);
          for (std::ptrdiff_t y = 0; y < side; ++y) {
            float* out = row + y * side;
            const std::ptrdiff_t sy = y + dy;
            if (sy < 0 || sy >= side) {
              std::fill(out, out + side, 0.0f);
              continue;
            }
            std::fill(out, out + x0, 0.0f);
            std::memcpy(out + x0, plane + sy * side + x0 + dx,
                        static_cast<std::size_t>(x1 - x0) * sizeof(float));
            std::fill(out + x1, out + side, 0.0f);
          }
        }
      }
    }
  }

  // The adjoint of im2col: every column entry adds back onto the pixel it was copied from.
  void col2im(const float* col, float* in) const {
    const auto side = static_cast<std::ptrdiff_t>(side_);
    std::fill(in, in + c_ * hw_, 0.0f);
    for (std::size_t c = 0; c < c_; ++c) {
      float* plane = in + c * hw_;
      for (std::size_t ky = 0; ky < kKernel; ++ky) {
        for (std::size_t kx = 0; kx < kKernel; ++kx) {
          const float* row = col + ((c * kKernel + ky) * kKernel + kx) * hw_;
          const std::ptrdiff_t dy = static_cast<std::ptrdiff_t>(ky) - kPad;
          const std::ptrdiff_t dx = static_cast<std::ptrdiff_t>(kx) - kPad;
          const std::ptrdiff_t x0 = std::max<std::ptrdiff_t>(0, -dx);
          const std::ptrdiff_t x1 = std::min<std::ptrdiff_t>(side, side - dx);
          const std::ptrdiff_t y0 = std::max<std::ptrdiff_t>(0, -dy);
          const std::ptrdiff_t y1 = std::min<std::ptrdiff_t>(side, side - dy);
          for (std::ptrdiff_t y = y0; y < y1; ++y) {
            const float* src = row + y * side;
            float* dst = plane + (y + dy) * side + dx;
            for (std::ptrdiff_t x = x0; x < x1; ++x) dst[x] += src[x];
          }
        }
      }
    }
  }

  std::size_t c_, oc_, side_, hw_, k_;
  std::size_t batch_ = 0;
  std::vector<float> cols_, y_, dcol_, dx_;
};

// 2x2, stride 2, NCHW; the winner of each window is remembered for backward.
class MaxPool2 final : public Layer {
 public:
  MaxPool2(std::size_t channels, std::size_t side)
      : c_(channels), side_(side), out_side_(side / 2) {}
  std::size_t in_size() const override { return c_ * side_ * side_; }
  std::size_t out_size() const override { return c_ * out_side_ * out_side_; }

  const float* forward(const float* in, std::size_t batch) override {
    batch_ = batch;
    const std::size_t planes = batch * c_;
    float* y = ensure(y_, planes * out_side_ * out_side_);
    std::uint32_t* arg = ensure(argmax_, planes * out_side_ * out_side_);
    for (std::size_t p = 0; p < planes; ++p) {
      const float* plane = in + p * side_ * side_;
      for (std::size_t oy = 0; oy < out_side_; ++oy) {
        for (std::size_t ox = 0; ox < out_side_; ++ox) {
          std::size_t best = (2 * oy) * side_ + 2 * ox;
          for (std::size_t i : {best + 1, best + side_, best + side_ + 1}) {
            if (plane[i] > plane[best]) best = i;
          }
          const std::size_t o = (p * out_side_ + oy) * out_side_ + ox;
          y[o] = plane[best];
          arg[o] = static_cast<std::uint32_t>(best);
        }
      }
    }
    return y;
  }

  const float* backward(const float* dy, bool need_input_grad, bool, const GradReady&) override {
    if (!need_input_grad) return nullptr;
    const std::size_t planes = batch_ * c_;
    const std::size_t in_plane = side_ * side_, out_plane = out_side_ * out_side_;
    float* dx = ensure(dx_, planes * in_plane);
    std::fill(dx, dx + planes * in_plane, 0.0f);
    for (std::size_t p = 0; p < planes; ++p) {
      for (std::size_t i = 0; i < out_plane; ++i) {
        dx[p * in_plane + argmax_[p * out_plane + i]] = dy[p * out_plane + i];
      }
    }
    return dx;
  }

 private:
  std::size_t c_, side_, out_side_;
  std::size_t batch_ = 0;
  std::vector<float> y_, dx_;
  std::vector<std::uint32_t> argmax_;
};

std::string with_millions(std::size_t count) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f M parameters (%zu)", count < 1000000 ? 2 : 1,
                static_cast<double>(count) / 1e6, count);
  return text;
}

class Sequential final : public Model {
 public:
  // `names` gives each parameter layer's name, in order ("fc1", "conv1", ...).
  Sequential(std::vector<std::unique_ptr<Layer>> layers, const std::vector<std::string>& names,
             std::uint64_t seed, std::string shape)
      : layers_(std::move(layers)) {
    std::size_t total = 0, named = 0;
    for (auto& layer : layers_) {
      // The timeline's span names: a parameter layer by its name, the others by position.
      layer_names_.push_back(layer->has_parameters() ? names.at(named)
                                                     : "act" + std::to_string(layer_names_.size()));
      first_parameter_.push_back(params_.size());
      if (!layer->has_parameters()) continue;
      const std::size_t rows = layer->weight_rows();
      const std::size_t weights = rows * layer->fan_in();
      params_.push_back({names.at(named) + ".weight", weights, rows, {}, {}});
      params_.push_back({names.at(named) + ".bias", rows, 0, {}, {}});
      total += weights + rows;
      ++named;
    }
    values_.assign(total, 0.0f);
    grads_.assign(total, 0.0f);
    std::size_t offset = 0;
    for (auto& p : params_) {
      p.value = std::span<float>(values_).subspan(offset, p.count);
      p.grad = std::span<float>(grads_).subspan(offset, p.count);
      offset += p.count;
    }
    // PyTorch's defaults for Linear and Conv2d: kaiming_uniform(a = sqrt(5)) on the weight is
    // uniform(+-1/sqrt(fan_in)), and so is the bias; drawn in parameters() order.
    SplitMix64 rng(seed);
    std::size_t index = 0;
    for (auto& layer : layers_) {
      if (!layer->has_parameters()) continue;
      Parameter& weight = params_[index];
      Parameter& bias = params_[index + 1];
      const float bound = 1.0f / std::sqrt(static_cast<float>(layer->fan_in()));
      for (float& v : weight.value) v = rng.uniform(bound);
      for (float& v : bias.value) v = rng.uniform(bound);
      layer->bind(weight, bias, index, index + 1);
      index += 2;
    }
    describe_ = shape + ", " + with_millions(total);
  }

  std::vector<Parameter>& parameters() override { return params_; }
  std::span<float> values() override { return values_; }
  std::span<float> grads() override { return grads_; }
  std::string describe() const override { return describe_; }

  void shard(gradsync::ShardedDataParallel& sharded) override {
    if (sharded_) throw std::logic_error("shard: the model is already sharded");
    std::size_t named = 0;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      if (!layers_[i]->has_parameters()) {
        unit_of_layer_.push_back(-1);
        continue;
      }
      const Parameter& weight = params_[2 * named];
      const std::size_t count = weight.count + params_[2 * named + 1].count;
      unit_of_layer_.push_back(sharded.add_unit(layer_names_[i], {weight.value.data(), count}));
      ++named;
    }
    sharded_ = &sharded;
    for (Parameter& p : params_) p.value = p.grad = {};
    values_ = std::vector<float>();
    grads_ = std::vector<float>();
  }

  void set_precision(const Precision& precision) override {
    if (precision.compute != gradsync::DataType::kFloat32 &&
        precision.compute != gradsync::DataType::kBFloat16 &&
        precision.compute != gradsync::DataType::kFloat16) {
      throw std::invalid_argument("set_precision: float32, bfloat16 or float16");
    }
    precision_ = precision;
  }

  void forward(std::span<const float> images, std::size_t batch) override {
    if (batch == 0 || images.size() != batch * kImagePixels) {
      throw std::invalid_argument("forward: " + std::to_string(images.size()) +
                                  " floats for a batch of " + std::to_string(batch) +
                                  " images of 784");
    }
    // A copy, so backward does not depend on the caller keeping its batch alive.
    float* x = ensure(input_, images.size());
    std::copy(images.begin(), images.end(), x);
    round_to_compute({x, images.size()});
    const float* a = x;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const int unit = sharded_ ? unit_of_layer_[i] : -1;
      if (layers_[i]->has_parameters()) {
        const std::span<const float> values =
            unit >= 0 ? sharded_->acquire(unit, gradsync::Pass::kForward) : own_values(i);
        layers_[i]->bind_unit(compute_weights(values),
                              unit >= 0 ? std::span<float>() : own_grads(i));
      }
      {
        gradsync::timeline::Span span("forward " + layer_names_[i], "compute");
        a = layers_[i]->forward(a, batch);
      }
      // The layer's own buffer, which it hands on read-only.
      if (layers_[i]->has_parameters()) {
        round_to_compute({const_cast<float*>(a), batch * layers_[i]->out_size()});
      }
      if (unit >= 0) sharded_->release(unit, gradsync::Pass::kForward);
    }
    logits_ = a;
    batch_ = batch;
  }

  float loss(std::span<const std::uint8_t> labels, std::size_t* correct) override {
    check_labels(labels, "loss");
    double sum = 0.0;
    std::size_t right = 0;
    for (std::size_t r = 0; r < batch_; ++r) {
      const float* z = logits_ + r * kClasses;
      const std::size_t best = static_cast<std::size_t>(std::max_element(z, z + kClasses) - z);
      if (best == labels[r]) ++right;
      // log-sum-exp shifted by the maximum: no overflow, and at least one term is exp(0).
      const float max = z[best];
      double total = 0.0;
      for (std::size_t c = 0; c < kClasses; ++c) total += std::exp(static_cast<double>(z[c] - max));
      sum += std::log(total) - static_cast<double>(z[labels[r]] - max);
    }
    if (correct) *correct = right;
    return static_cast<float>(sum / static_cast<double>(batch_));
  }

  void backward(std::span<const std::uint8_t> labels, bool accumulate,
                const GradReady& ready) override {
    check_labels(labels, "backward");
    // d(mean loss)/d(logits) = (softmax - one_hot) / batch.
    float* d = ensure(dlogits_, batch_ * kClasses);
    const float scale = 1.0f / static_cast<float>(batch_);
    for (std::size_t r = 0; r < batch_; ++r) {
      const float* z = logits_ + r * kClasses;
      float* g = d + r * kClasses;
      const float max = *std::max_element(z, z + kClasses);
      float total = 0.0f;
      for (std::size_t c = 0; c < kClasses; ++c) total += (g[c] = std::exp(z[c] - max));
      const float norm = scale / total;
      for (std::size_t c = 0; c < kClasses; ++c) g[c] *= norm;
      g[labels[r]] -= scale;
    }
    if (precision_.loss_scale != 1) {
      for (std::size_t i = 0; i < batch_ * kClasses; ++i) d[i] *= precision_.loss_scale;
    }
    round_to_compute({d, batch_ * kClasses});
    // In reduced precision each weight gradient is rounded before anyone hears it is final.
    const GradReady round_then_ready = [&](std::size_t p) {
      round_to_compute(params_[p].grad);
      if (ready) ready(p);
    };
    const float* grad = d;
    for (std::size_t i = layers_.size(); i-- > 0;) {
      const bool has_parameters = layers_[i]->has_parameters();
      const int unit = sharded_ ? unit_of_layer_[i] : -1;
      if (unit < 0) {
        if (has_parameters) layers_[i]->bind_unit(compute_weights(own_values(i)), own_grads(i));
        {
          gradsync::timeline::Span span("backward " + layer_names_[i], "compute");
          grad =
              layers_[i]->backward(grad, i > 0, accumulate, reduced() ? round_then_ready : ready);
        }
      } else {
        // A unit's gradient buffer is fresh each pass: the engine accumulates its shards.
        const std::span<float> gradient = sharded_->gradient(unit);
        layers_[i]->bind_unit(compute_weights(sharded_->acquire(unit, gradsync::Pass::kBackward)),
                              gradient);
        {
          gradsync::timeline::Span span("backward " + layer_names_[i], "compute");
          grad = layers_[i]->backward(grad, i > 0, false, {});
        }
        round_to_compute(gradient);
        sharded_->mark_ready(unit);
        sharded_->release(unit, gradsync::Pass::kBackward);
      }
      if (grad) round_to_compute({const_cast<float*>(grad), batch_ * layers_[i]->in_size()});
    }
  }

 private:
  void check_labels(std::span<const std::uint8_t> labels, const char* what) const {
    if (!logits_) throw std::logic_error(std::string(what) + " before any forward");
    if (labels.size() != batch_) {
      throw std::invalid_argument(std::string(what) + ": " + std::to_string(labels.size()) +
                                  " labels for a batch of " + std::to_string(batch_));
    }
    for (std::uint8_t label : labels) {
      if (label >= kClasses) {
        throw std::invalid_argument(std::string(what) + ": label " + std::to_string(label) +
                                    " is not a class 0..9");
      }
    }
  }

  bool reduced() const { return precision_.compute != gradsync::DataType::kFloat32; }
  void round_to_compute(std::span<float> values) const {
    if (reduced()) gradsync::round_through(precision_.compute, values);
  }
  // The weights a layer computes with: its values, or in reduced precision their rounded copy
  // (one buffer, as layers run one at a time and are bound again before backward).
  std::span<const float> compute_weights(std::span<const float> values) {
    if (!reduced()) return values;
    float* copy = ensure(rounded_weights_, values.size());
    std::copy(values.begin(), values.end(), copy);
    round_to_compute({copy, values.size()});
    return {copy, values.size()};
  }
  // Layer i's weight and bias, back to back in values() and grads().
  std::span<float> own_values(std::size_t i) {
    const Parameter& weight = params_[first_parameter_[i]];
    return {weight.value.data(), weight.count + params_[first_parameter_[i] + 1].count};
  }
  std::span<float> own_grads(std::size_t i) {
    const Parameter& weight = params_[first_parameter_[i]];
    return {weight.grad.data(), weight.count + params_[first_parameter_[i] + 1].count};
  }

  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<std::size_t> first_parameter_;  // per layer: its weight's index in params_
  Precision precision_;
  std::vector<float> rounded_weights_;
  std::vector<std::string> layer_names_;  // per layer, for the timeline
  std::vector<Parameter> params_;
  std::vector<float> values_, grads_;
  gradsync::ShardedDataParallel* sharded_ = nullptr;  // once shard() is called
  std::vector<int> unit_of_layer_;                    // its unit, or -1 without parameters
  std::string describe_;
  std::vector<float> input_, dlogits_;
  const float* logits_ = nullptr;
  std::size_t batch_ = 0;
};

std::unique_ptr<Model> make_mlp(std::uint64_t seed, std::vector<std::size_t> hidden) {
  if (hidden.empty()) hidden = {2048, 2048, 2048, 2048};
  std::vector<std::unique_ptr<Layer>> layers;
  std::vector<std::string> names;
  std::string shape = "mlp " + std::to_string(kImagePixels);
  std::size_t in = kImagePixels;
  for (std::size_t width : hidden) {
    if (width == 0) throw std::invalid_argument("mlp: a hidden layer of width 0");
    layers.push_back(std::make_unique<Linear>(in, width));
    layers.push_back(std::make_unique<ReLU>(width));
    names.push_back("fc" + std::to_string(names.size() + 1));
    shape += "-" + std::to_string(width);
    in = width;
  }
  layers.push_back(std::make_unique<Linear>(in, kClasses));
  names.push_back("fc" + std::to_string(names.size() + 1));
  shape += "-" + std::to_string(kClasses);
  return std::make_unique<Sequential>(std::move(layers), names, seed, shape);
}

std::unique_ptr<Model> make_cnn(std::uint64_t seed) {
  constexpr std::size_t c1 = 16, c2 = 32, fc = 128;
  constexpr std::size_t half = kImageSide / 2, quarter = kImageSide / 4;
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(std::make_unique<Conv2d>(1, c1, kImageSide));
  layers.push_back(std::make_unique<ReLU>(c1 * kImagePixels));
  layers.push_back(std::make_unique<MaxPool2>(c1, kImageSide));
  layers.push_back(std::make_unique<Conv2d>(c1, c2, half));
  layers.push_back(std::make_unique<ReLU>(c2 * half * half));
  layers.push_back(std::make_unique<MaxPool2>(c2, half));
  // Flatten is free: each image's NCHW output is already one row of c2 * 7 * 7.
  layers.push_back(std::make_unique<Linear>(c2 * quarter * quarter, fc));
  layers.push_back(std::make_unique<ReLU>(fc));
  layers.push_back(std::make_unique<Linear>(fc, kClasses));
  return std::make_unique<Sequential>(
      std::move(layers), std::vector<std::string>{"conv1", "conv2", "fc1", "fc2"}, seed,
      "cnn conv5x5 1-16-32 (max-pool 2 each), fc 1568-128-10");
}

}  // namespace

std::unique_ptr<Model> make_model(const std::string& kind, std::uint64_t seed,
                                  const std::vector<std::size_t>& hidden) {
  // One BLAS thread per rank: the ranks already fill the cores, and OpenBLAS's own threads
  // would only contend with them (and with the reducer's thread).
  static std::once_flag blas_threads;
  std::call_once(blas_threads, [] { openblas_set_num_threads(1); });
  if (kind == "mlp") return make_mlp(seed, hidden);
  if (kind == "cnn") {
    if (!hidden.empty()) throw std::invalid_argument("cnn: takes no hidden sizes");
    return make_cnn(seed);
  }
  throw std::invalid_argument("unknown model kind '" + kind + "' (mlp or cnn)");
}

}  // namespace train
