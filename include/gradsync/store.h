// Rendezvous key-value stores: how ranks find each other before any transport exists.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gradsync {

using Bytes = std::vector<std::uint8_t>;

// Thread-safe key-value store. Every blocking call takes a timeout and throws
// gradsync::Error(kTimeout) naming the missing keys when it passes.
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Blocks until `key` exists, then returns its value.
  virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Blocks until every key exists.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Atomically adds `delta` to the integer stored at `key` (0 if absent) and returns the result.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  // Non-blocking existence check.
  virtual bool check(const std::string& key) = 0;
};

// Store shared by threads of one process (tests, in-process groups).
std::shared_ptr<Store> make_inproc_store();

// Store in a directory on a file system every rank can see (one file per key,
// written atomically). Useful when no TCP port can be opened.
std::shared_ptr<Store> make_file_store(const std::string& directory);

// A TCP store server: serves the store protocol on `port` (0 = pick a free one) until
// destroyed. Rank 0 or the launcher hosts it. Clients must present `token` in their first
// message, a bounded hello; nothing more is read from a connection before that, and waiting
// unauthenticated connections are bounded (the oldest is dropped first). `bind_addr`
// "0.0.0.0" listens on every interface; init() binds where MASTER_ADDR points when local.
class TcpStoreServer {
 public:
  virtual ~TcpStoreServer() = default;
  virtual int port() const = 0;
};
std::unique_ptr<TcpStoreServer> make_tcp_store_server(const std::string& bind_addr, int port,
                                                      const std::string& token);

// A client of a TcpStoreServer. Retries connecting until `connect_timeout` passes, then
// throws an Error naming host and port.
std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, const std::string& token,
                                      std::chrono::milliseconds connect_timeout);

}  // namespace gradsync
