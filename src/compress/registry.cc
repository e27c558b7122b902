// The codec registry: one row per codec (name, keys and defaults, factory, all-reduce pattern,
// NaN handling, bucketing), and the spec parsing and make_codec that read it. Adding a codec
// touches its own file, its row here and its tests.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "compress/codecs.h"

namespace gradsync::compress {

namespace {

constexpr double kRequired = std::numeric_limits<double>::quiet_NaN();

// What a key admits: [low, high], whole numbers only or not, and low itself excluded or not.
// Keys mean the same in every codec that takes them, so their ranges are shared.
struct KeyRange {
  const char* key;
  double low, high;
  bool whole;
  bool low_open = false;
};

// clang-format off
constexpr KeyRange kKeyRanges[] = {
    {"ef", 0, 1, true},
    {"block", 1, 1 << 24, true},
    {"levels", 1, 127, true},
    {"seed", 0, 9007199254740992.0, true},
    {"ratio", 0, 1, false, true},
    {"exact", 0, 1, true},
    {"union", 0, 1, true},
    {"rel", 0, 1, false, true},
    {"rank", 1, 1024, true},
    {"momentum", 0, 0.999, false},
    {"warmup", 0, 1e9, true},
};
// clang-format on

const KeyRange& range_of(std::string_view key) {
  for (const KeyRange& r : kKeyRanges) {
    if (key == r.key) return r;
  }
  throw std::logic_error("codec key without a range: " + std::string(key));
}

struct KeyDefault {
  const char* key;
  double fallback;  // kRequired: the spec must give it
};

// One codec. `traits` resolves what the all-reduce needs from the spec and whether error
// feedback wraps the codec.
struct CodecRow {
  const char* name;
  const char* example;           // shown when a spec is refused
  std::vector<KeyDefault> keys;  // besides ef; momentum where DGC's correction applies
  std::unique_ptr<Codec> (*make)(const CodecSpec&);
  CodecTraits (*traits)(const CodecSpec&, bool feedback);
  // Keeps its residuals itself (PowerSGD's all-reduce needs them): never wrapped in feedback.
  bool own_feedback = false;
};

// Encoders that rank magnitudes or take a mean refuse NaN, so every rank checks its input
// first whatever the caller asked: a refusal on one rank alone would leave the others waiting.
constexpr bool kRefusesNonFinite = true;

// fp16 and bf16: a ring of halves, whole buckets at a time. With feedback the residual joins
// the data, so decoded payloads are gathered instead: what each rank's rounding lost is its
// own to keep.
template <DataType kWire>
CodecTraits half_traits(const CodecSpec&, bool feedback) {
  return CodecTraits{feedback ? Pattern::kGather : Pattern::kHalfRing, !kRefusesNonFinite,
                     !feedback, kWire};
}

const std::vector<CodecRow>& rows() {
  static const std::vector<CodecRow> table = {
      {"none",
       "none",
       {},
       make_none,
       [](const CodecSpec&, bool feedback) {
         return CodecTraits{Pattern::kFloat32, !kRefusesNonFinite, !feedback};
       }},
      {"fp16", "fp16", {{"momentum", 0}}, make_fp16, half_traits<DataType::kFloat16>},
      {"bf16", "bf16", {{"momentum", 0}}, make_bf16, half_traits<DataType::kBFloat16>},
      {"int8",
       "int8:block=256",
       {{"block", 256}, {"momentum", 0}},
       make_int8,
       [](const CodecSpec&, bool) {
         return CodecTraits{Pattern::kQuantizedRing, !kRefusesNonFinite, false};
       }},
      {"qsgd",
       "qsgd:levels=15",
       {{"levels", 127}, {"block", 512}, {"seed", 0}, {"momentum", 0}},
       make_qsgd,
       [](const CodecSpec&, bool) {
         return CodecTraits{Pattern::kQuantizedRing, !kRefusesNonFinite, false};
       }},
      {"topk",
       "topk:ratio=0.01",
       {{"ratio", kRequired}, {"exact", 0}, {"warmup", 0}, {"union", 0}, {"momentum", 0}},
       make_topk,
       [](const CodecSpec& s, bool) {
         // Top-k ranks a whole bucket at once, so the tensors with the largest gradients get
         // most of the k.
         return CodecTraits{s.value("union") != 0 ? Pattern::kIndexUnion : Pattern::kGather,
                            kRefusesNonFinite, true};
       }},
      {"randomk",
       "randomk:ratio=0.01",
       {{"ratio", kRequired}, {"seed", 0}, {"momentum", 0}},
       make_randomk,
       [](const CodecSpec&, bool) {
         return CodecTraits{Pattern::kSharedIndices, !kRefusesNonFinite, false};
       }},
      {"threshold",
       "threshold:rel=0.1",
       {{"rel", kRequired}, {"momentum", 0}},
       make_threshold,
       [](const CodecSpec&, bool) {
         return CodecTraits{Pattern::kGather, kRefusesNonFinite, false};
       }},
      {"sign",
       "sign",
       {{"block", 0}, {"momentum", 0}},
       make_sign,
       [](const CodecSpec&, bool) {
         return CodecTraits{Pattern::kGather, kRefusesNonFinite, false};
       }},
      {"powersgd",
       "powersgd:rank=4",
       {{"rank", 4}},
       make_powersgd,
       [](const CodecSpec&, bool) {
         // Its matrices are the tensors': always tensor by tensor.
         return CodecTraits{Pattern::kLowRank, !kRefusesNonFinite, false};
       },
       true},
  };
  return table;
}

const CodecRow* find_row(std::string_view name) {
  for (const CodecRow& row : rows()) {
    if (name == row.name) return &row;
  }
  return nullptr;
}

const KeyDefault* find_key(const CodecRow& row, std::string_view key) {
  for (const KeyDefault& k : row.keys) {
    if (key == k.key) return &k;
  }
  return nullptr;
}

std::string examples() {
  std::string s;
  for (const CodecRow& row : rows()) s += std::string(s.empty() ? "" : ", ") + row.example;
  return s;
}

std::string describe_range(const KeyRange& r) {
  char low[32], high[32];
  *std::to_chars(low, low + 31, r.low).ptr = '\0';
  *std::to_chars(high, high + 31, r.high).ptr = '\0';
  return std::string(r.key) + " is " + (r.whole ? "a whole number " : "a number ") +
         (r.low_open ? "above " + std::string(low) + " up to " : std::string(low) + "..") + high;
}

}  // namespace

[[noreturn]] void bad_spec(std::string_view spec, const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument,
              "codec spec '" + std::string(spec) + "': " + why + " (like " + examples() +
                  ", each with an optional ef=0|1, the lossy ones but powersgd with an optional "
                  "momentum=M)",
              Error::kUnknownRank, Error::kNoPeer, "make_codec");
}

std::vector<std::string> codec_names() {
  std::vector<std::string> names;
  for (const CodecRow& row : rows()) names.emplace_back(row.name);
  return names;
}

std::vector<std::string> codec_examples() {
  std::vector<std::string> specs;
  for (const CodecRow& row : rows()) specs.emplace_back(row.example);
  return specs;
}

CodecSpec CodecSpec::parse(std::string_view spec) {
  CodecSpec s;
  const std::size_t colon = spec.find(':');
  s.name = std::string(spec.substr(0, colon));
  if (s.name.empty()) bad_spec(spec, "no codec name");
  const CodecRow* row = find_row(s.name);
  if (!row) bad_spec(spec, "unknown codec '" + s.name + "'");
  std::string_view rest = colon == std::string_view::npos ? "" : spec.substr(colon + 1);
  if (colon != std::string_view::npos && rest.empty()) bad_spec(spec, "nothing after ':'");
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? "" : rest.substr(comma + 1);
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      bad_spec(spec, "'" + std::string(item) + "' is not key=value");
    }
    const std::string key(item.substr(0, eq));
    const std::string_view value = item.substr(eq + 1);
    if (key != "ef" && !find_key(*row, key)) {
      bad_spec(spec, "codec '" + s.name + "' takes no '" + key + "'");
    }
    double v = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec != std::errc() || end != value.data() + value.size() || !std::isfinite(v)) {
      bad_spec(spec, "'" + std::string(value) + "' is not a number");
    }
    if (s.params.count(key)) bad_spec(spec, "'" + key + "' given twice");
    const KeyRange& r = range_of(key);
    const bool inside = (r.low_open ? v > r.low : v >= r.low) && v <= r.high;
    if (!inside || (r.whole && v != std::floor(v))) bad_spec(spec, describe_range(r));
    s.params[key] = v;
  }
  for (const KeyDefault& k : row->keys) {
    if (std::isnan(k.fallback) && !s.params.count(k.key)) {
      bad_spec(spec, "codec '" + s.name + "' needs " + k.key + "=");
    }
  }
  return s;
}

double CodecSpec::get(const std::string& key, double fallback) const {
  auto it = params.find(key);
  return it == params.end() ? fallback : it->second;
}

double CodecSpec::value(const std::string& key) const {
  if (auto it = params.find(key); it != params.end()) return it->second;
  const CodecRow* row = find_row(name);
  const KeyDefault* k = row ? find_key(*row, key) : nullptr;
  if (!k || std::isnan(k->fallback)) {
    throw Error(ErrorKind::kInvalidArgument,
                "codec '" + name + "' has no default for '" + key + "'", Error::kUnknownRank,
                Error::kNoPeer, "make_codec");
  }
  return k->fallback;
}

std::string CodecSpec::to_string() const {
  std::string s = name;
  char sep = ':';
  for (const auto& [k, v] : params) {
    s += sep + k + "=" + format_number(v);
    sep = ',';
  }
  return s;
}

std::unique_ptr<Codec> make_codec(std::string_view text) {
  const CodecSpec s = CodecSpec::parse(text);
  const CodecRow& row = *find_row(s.name);
  std::unique_ptr<Codec> codec = row.make(s);
  // A codec that loses information in a biased way is wrapped in error feedback unless ef=0.
  const double momentum = s.get("momentum", 0);
  const bool feedback =
      !row.own_feedback && s.get("ef", codec->biased() || momentum > 0 ? 1 : 0) != 0;
  if (momentum > 0 && !feedback) {
    bad_spec(text, "momentum is error feedback's (momentum correction); it needs ef=1");
  }
  if (feedback) codec = std::make_unique<ErrorFeedback>(std::move(codec), momentum);
  codec->traits_ = row.traits(s, feedback);
  return codec;
}

}  // namespace gradsync::compress
