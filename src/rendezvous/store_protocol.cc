// TCP store messages: encoding, strict parsing and stream splitting; all pure functions.
#include "rendezvous/store_protocol.h"

#include <cstring>

namespace gradsync::store_protocol {

namespace {

class Writer {
 public:
  // Room reserved up front: most messages are small, and it also keeps GCC 12's
  // -Warray-bounds from misreading push_back on a just-sized vector.
  Writer() {
    out_.reserve(256);
    out_.resize(kLengthPrefixBytes);
  }
  void u8(std::uint8_t v) { out_.push_back(v); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void bytes(const std::uint8_t* p, std::size_t n) {
    u32(static_cast<std::uint32_t>(n));
    out_.insert(out_.end(), p, p + n);
  }
  void str(const std::string& s) {
    bytes(reinterpret_cast<const std::uint8_t*>(s.data()), s.size());
  }
  Bytes finish() {
    auto n = static_cast<std::uint32_t>(out_.size() - kLengthPrefixBytes);
    for (int i = 0; i < 4; ++i)
      out_[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
    return std::move(out_);
  }

 private:
  Bytes out_;
};

// Bounds-checked reader; the first failure sticks and names what was being read.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> in) : in_(in) {}
  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  bool at_end() const { return pos_ == in_.size(); }

  std::uint8_t u8(const char* what) {
    if (!need(1, what)) return 0;
    return in_[pos_++];
  }
  std::uint32_t u32(const char* what) {
    if (!need(4, what)) return 0;
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | in_[pos_ + static_cast<std::size_t>(i)];
    pos_ += 4;
    return v;
  }
  std::uint64_t u64(const char* what) {
    if (!need(8, what)) return 0;
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | in_[pos_ + static_cast<std::size_t>(i)];
    pos_ += 8;
    return v;
  }
  // A length-prefixed byte string of at most `max` bytes.
  std::span<const std::uint8_t> blob(std::size_t max, const char* what) {
    std::uint32_t n = u32(what);
    if (!ok()) return {};
    if (n > max) {
      fail(std::string(what) + " longer than the limit of " + std::to_string(max) + " bytes");
      return {};
    }
    if (!need(n, what)) return {};
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::string str(std::size_t max, const char* what) {
    auto s = blob(max, what);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  void fail(std::string why) {
    if (why_.empty()) why_ = std::move(why);
  }

 private:
  bool need(std::size_t n, const char* what) {
    if (!ok()) return false;
    if (in_.size() - pos_ < n) {
      fail(std::string("message ends inside ") + what);
      return false;
    }
    return true;
  }
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
  std::string why_;
};

template <typename T>
std::optional<T> finish(Reader& r, T value, std::string* why) {
  if (r.ok() && !r.at_end()) r.fail("trailing bytes after the message");
  if (!r.ok()) {
    if (why) *why = r.why();
    return std::nullopt;
  }
  return value;
}

}  // namespace

const char* to_string(RequestType t) {
  switch (t) {
    case RequestType::kProof:
      return "proof";
    case RequestType::kSet:
      return "set";
    case RequestType::kGet:
      return "get";
    case RequestType::kWait:
      return "wait";
    case RequestType::kAdd:
      return "add";
    case RequestType::kCheck:
      return "check";
    case RequestType::kHello:
      return "hello";
  }
  return "?";
}

Bytes encode_request(const Request& r) {
  Writer w;
  w.u8(static_cast<std::uint8_t>(r.type));
  switch (r.type) {
    case RequestType::kProof:
    case RequestType::kCheck:
      w.str(r.key);
      break;
    case RequestType::kSet:
      w.str(r.key);
      w.bytes(r.value.data(), r.value.size());
      break;
    case RequestType::kGet:
      w.str(r.key);
      w.u64(r.timeout_ms);
      break;
    case RequestType::kWait:
      w.u32(static_cast<std::uint32_t>(r.keys.size()));
      for (const auto& k : r.keys) w.str(k);
      w.u64(r.timeout_ms);
      break;
    case RequestType::kAdd:
      w.str(r.key);
      w.u64(static_cast<std::uint64_t>(r.delta));
      break;
    case RequestType::kHello:
      w.str(r.key);
      w.u32(static_cast<std::uint32_t>(r.hello.rank));
      w.u32(static_cast<std::uint32_t>(r.hello.world_size));
      w.u32(r.hello.pid);
      w.str(r.hello.host);
      w.u64(r.hello.client_id);
      break;
  }
  return w.finish();
}

std::optional<Request> parse_request(std::span<const std::uint8_t> body, std::string* why) {
  Reader in(body);
  Request r;
  std::uint8_t type = in.u8("request type");
  if (!in.ok()) return finish(in, r, why);
  r.type = static_cast<RequestType>(type);
  switch (r.type) {
    case RequestType::kProof:
    case RequestType::kCheck:
      r.key = in.str(kMaxKeyBytes, "key");
      break;
    case RequestType::kSet: {
      r.key = in.str(kMaxKeyBytes, "key");
      auto v = in.blob(kMaxValueBytes, "value");
      r.value.assign(v.begin(), v.end());
      break;
    }
    case RequestType::kGet:
      r.key = in.str(kMaxKeyBytes, "key");
      r.timeout_ms = in.u64("timeout");
      break;
    case RequestType::kWait: {
      std::uint32_t n = in.u32("key count");
      if (n > kMaxWaitKeys) in.fail("wait for more than " + std::to_string(kMaxWaitKeys) + " keys");
      // Each key costs at least its 4-byte length, so `n` cannot make us loop far past
      // the end of a short message: the reader fails at the first missing length.
      for (std::uint32_t i = 0; i < n && in.ok(); ++i)
        r.keys.push_back(in.str(kMaxKeyBytes, "key"));
      r.timeout_ms = in.u64("timeout");
      break;
    }
    case RequestType::kAdd:
      r.key = in.str(kMaxKeyBytes, "key");
      r.delta = static_cast<std::int64_t>(in.u64("delta"));
      break;
    case RequestType::kHello:
      r.key = in.str(kMaxKeyBytes, "nonce");
      r.hello.rank = static_cast<std::int32_t>(in.u32("rank"));
      r.hello.world_size = static_cast<std::int32_t>(in.u32("world size"));
      r.hello.pid = in.u32("pid");
      r.hello.host = in.str(kMaxHostBytes, "host");
      r.hello.client_id = in.u64("client id");
      break;
    default:
      in.fail("unknown request type " + std::to_string(type));
      break;
  }
  return finish(in, std::move(r), why);
}

Bytes encode_response(RequestType answered, const Response& r) {
  Writer w;
  w.u8(static_cast<std::uint8_t>(r.status));
  switch (r.status) {
    case Status::kTimeout:
      w.u32(static_cast<std::uint32_t>(r.missing.size()));
      for (const auto& k : r.missing) w.str(k);
      w.str(r.message);
      break;
    case Status::kError:
    case Status::kJobFailed:
    case Status::kBusy:
      w.str(r.message);
      break;
    case Status::kOk:
      switch (answered) {
        case RequestType::kGet:
        case RequestType::kHello:  // the server's challenge: its nonce and proof
          w.bytes(r.value.data(), r.value.size());
          break;
        case RequestType::kAdd:
          w.u64(static_cast<std::uint64_t>(r.number));
          break;
        case RequestType::kCheck:
          w.u8(r.exists ? 1 : 0);
          break;
        case RequestType::kProof:
        case RequestType::kSet:
        case RequestType::kWait:
          break;
      }
      break;
  }
  return w.finish();
}

std::optional<Response> parse_response(RequestType answered, std::span<const std::uint8_t> body,
                                       std::string* why) {
  Reader in(body);
  Response r;
  std::uint8_t status = in.u8("status");
  if (!in.ok()) return finish(in, r, why);
  switch (status) {
    case static_cast<std::uint8_t>(Status::kOk):
      r.status = Status::kOk;
      switch (answered) {
        case RequestType::kGet: {
          auto v = in.blob(kMaxValueBytes, "value");
          r.value.assign(v.begin(), v.end());
          break;
        }
        case RequestType::kHello: {
          auto v = in.blob(kMaxKeyBytes, "challenge");
          r.value.assign(v.begin(), v.end());
          break;
        }
        case RequestType::kAdd:
          r.number = static_cast<std::int64_t>(in.u64("number"));
          break;
        case RequestType::kCheck: {
          std::uint8_t b = in.u8("flag");
          if (b > 1) in.fail("check flag is neither 0 nor 1");
          r.exists = b == 1;
          break;
        }
        case RequestType::kProof:
        case RequestType::kSet:
        case RequestType::kWait:
          break;
        default:
          in.fail("response to an unknown request type");
          break;
      }
      break;
    case static_cast<std::uint8_t>(Status::kTimeout): {
      r.status = Status::kTimeout;
      std::uint32_t n = in.u32("key count");
      if (n > kMaxWaitKeys) in.fail("timeout names too many keys");
      for (std::uint32_t i = 0; i < n && in.ok(); ++i)
        r.missing.push_back(in.str(kMaxKeyBytes, "key"));
      r.message = in.str(kMaxKeyBytes, "timeout note");
      break;
    }
    case static_cast<std::uint8_t>(Status::kError):
    case static_cast<std::uint8_t>(Status::kJobFailed):
    case static_cast<std::uint8_t>(Status::kBusy):
      r.status = static_cast<Status>(status);
      r.message = in.str(kMaxKeyBytes, "error message");
      break;
    default:
      in.fail("unknown response status " + std::to_string(status));
      break;
  }
  return finish(in, std::move(r), why);
}

void MessageReader::append(const std::uint8_t* data, std::size_t len) {
  // Compact before growing so a long-lived connection does not accumulate consumed bytes.
  if (pos_ > 0 && (pos_ == buf_.size() || pos_ >= buf_.size() / 2)) {
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(pos_));
    pos_ = 0;
  }
  buf_.insert(buf_.end(), data, data + len);
}

MessageReader::Result MessageReader::next(std::span<const std::uint8_t>& body) {
  std::size_t avail = buf_.size() - pos_;
  if (avail < kLengthPrefixBytes) return Result::kNeedMore;
  const std::uint8_t* p = buf_.data() + pos_;
  std::uint32_t n = static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
                    (static_cast<std::uint32_t>(p[2]) << 16) |
                    (static_cast<std::uint32_t>(p[3]) << 24);
  if (n > max_body_) return Result::kTooLong;
  if (avail - kLengthPrefixBytes < n) return Result::kNeedMore;
  body = std::span<const std::uint8_t>(p + kLengthPrefixBytes, n);
  pos_ += kLengthPrefixBytes + n;
  return Result::kMessage;
}

}  // namespace gradsync::store_protocol
