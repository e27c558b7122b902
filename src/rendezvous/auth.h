// Challenge-response over the job token (GRADSYNC_TOKEN), for the store's and the tcp
// transport's connections: each side sends a fresh random nonce, and each proves it knows the
// token with HMAC-SHA256 over both nonces, its role and the identities the connection binds.
// The token itself never crosses the network, a captured exchange proves nothing on a new
// connection (the other side's nonce is new), and one side's proof cannot stand in for the
// other's (the role is part of what is signed).
#pragma once

#include <string>
#include <string_view>

namespace gradsync::net {

constexpr std::size_t kNonceBytes = 32;
constexpr std::size_t kProofBytes = 32;  // HMAC-SHA256

// kNonceBytes from the kernel's random source (getrandom); throws kSystem if it fails.
std::string fresh_nonce();

// HMAC-SHA256 keyed by `token` over `role`, both nonces and `binding` (each length-prefixed,
// so no two different inputs sign the same bytes). kProofBytes bytes.
std::string prove(const std::string& token, std::string_view role, std::string_view dialer_nonce,
                  std::string_view acceptor_nonce, std::string_view binding);

// Runs OpenSSL's one-time set-up of HMAC-SHA256 (its library context and method caches, which
// it fills under write locks) on the calling thread, once per process. A store server calls it
// before its thread serves anyone: a process that forks while that thread signs its first
// proof would leave the child those locks held, and the child's first proof would wait
// forever.
void prepare_proofs();

// Whether `proof` is the one prove() gives for these inputs, compared in constant time.
bool proof_holds(std::string_view proof, const std::string& token, std::string_view role,
                 std::string_view dialer_nonce, std::string_view acceptor_nonce,
                 std::string_view binding);

}  // namespace gradsync::net
