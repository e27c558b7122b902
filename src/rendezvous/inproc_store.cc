// Store shared by the threads of one process.
#include <condition_variable>
#include <map>
#include <mutex>

#include "gradsync/error.h"
#include "gradsync/store.h"
#include "rendezvous/store_util.h"

namespace gradsync {

namespace {
class InprocStore final : public Store {
 public:
  void set(const std::string& key, const Bytes& value) override {
    std::lock_guard lock(mu_);
    data_[key] = value;
    cv_.notify_all();
  }
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    wait_locked(lock, {key}, timeout);
    return data_.at(key);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    wait_locked(lock, keys, timeout);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::lock_guard lock(mu_);
    Bytes& v = data_[key];
    std::int64_t n = decode_int(v) + delta;
    v = encode_int(n);
    cv_.notify_all();
    return n;
  }
  bool check(const std::string& key) override {
    std::lock_guard lock(mu_);
    return data_.count(key) != 0;
  }

 private:
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    auto all_present = [&] {
      for (const auto& k : keys) {
        if (!data_.count(k)) return false;
      }
      return true;
    };
    if (!cv_.wait_until(lock, deadline, all_present)) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!data_.count(k)) missing.push_back(k);
      }
      throw_store_timeout("inproc store", missing, timeout);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Bytes> data_;
};
}  // namespace

std::shared_ptr<Store> make_inproc_store() {
  return std::make_shared<InprocStore>();
}

}  // namespace gradsync
