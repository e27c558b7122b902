// Alpha-beta-gamma formulas of each all-reduce algorithm (Thakur, Rabenseifner & Gropp,
// "Optimization of Collective Communication Operations in MPICH", 2005).
#include "model/cost_model.h"

#include <charconv>
#include <cmath>
#include <sstream>
#include <string>

namespace gradsync::model {

namespace {
int floor_pow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}
int log2_int(int p) {
  int k = 0;
  while ((1 << k) < p) ++k;
  return k;
}
}  // namespace

double CostModel::allreduce_us(Algorithm a, int n, std::size_t bytes) const {
  if (n <= 1) return 0.0;
  const double S = static_cast<double>(bytes);
  const double alpha = p_.alpha_us, beta = p_.beta_us_per_byte(), gamma = p_.gamma_us_per_byte();
  const int p = floor_pow2(n);
  const int steps = log2_int(p);
  // Non-power-of-two: fold the extra ranks in (one full message + reduction) and the
  // result back out (one full message).
  const double fold = (n != p) ? 2 * (alpha + S * beta) + S * gamma : 0.0;
  // Recursive doubling and halving-doubling receive each step whole into a scratch buffer
  // and only then reduce it: one more pass over the received bytes, at transfer speed,
  // that the ring avoids by reducing each piece straight out of the transport's buffer
  // while the next one is in flight.
  const double staged = beta;
  switch (a) {
    case Algorithm::kRing: {
      const double frac = static_cast<double>(n - 1) / n;
      return 2 * (n - 1) * alpha + 2 * frac * S * beta + frac * S * gamma;
    }
    case Algorithm::kRecursiveDoubling:
      return steps * (alpha + S * (beta + staged) + S * gamma) + fold;
    case Algorithm::kHalvingDoubling: {
      const double frac = static_cast<double>(p - 1) / p;
      return 2 * steps * alpha + 2 * frac * S * beta + frac * S * (gamma + staged) + fold;
    }
    case Algorithm::kParameterServer:
      // The server receives and then sends N-1 full copies, one after another.
      return 2 * (n - 1) * (alpha + S * beta) + (n - 1) * S * gamma;
    case Algorithm::kAuto:
      return allreduce_us(choose_allreduce(n, bytes), n, bytes);
  }
  return 0.0;
}

Algorithm CostModel::choose_allreduce(int n, std::size_t bytes) const {
  Algorithm best = Algorithm::kRing;
  double best_us = allreduce_us(best, n, bytes);
  for (Algorithm a : {Algorithm::kRecursiveDoubling, Algorithm::kHalvingDoubling}) {
    double t = allreduce_us(a, n, bytes);
    if (t < best_us) {
      best = a;
      best_us = t;
    }
  }
  return best;
}

std::optional<LinkParams> CostModel::parse(std::string_view spec, LinkParams base) {
  LinkParams p = base;
  while (!spec.empty()) {
    std::size_t comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
    std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) return std::nullopt;
    std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    double v = 0;
    auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec != std::errc() || ptr != value.data() + value.size() || !(v > 0) || !std::isfinite(v)) {
      return std::nullopt;
    }
    if (key == "alpha_us") {
      p.alpha_us = v;
    } else if (key == "bandwidth_gbps") {
      p.bandwidth_gbps = v;
    } else if (key == "reduce_gbps") {
      p.reduce_gbps = v;
    } else {
      return std::nullopt;
    }
  }
  return p;
}

std::string CostModel::to_string() const {
  std::ostringstream o;
  o << "alpha_us=" << p_.alpha_us << ",bandwidth_gbps=" << p_.bandwidth_gbps
    << ",reduce_gbps=" << p_.reduce_gbps;
  return o.str();
}

}  // namespace gradsync::model
