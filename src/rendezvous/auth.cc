// HMAC-SHA256 from OpenSSL's libcrypto: the one primitive the handshakes need, from the
// library every Linux distribution keeps patched, rather than a hand-written hash.
#include "rendezvous/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "gradsync/error.h"

namespace gradsync::net {
namespace {

void put(std::string& out, std::string_view part) {
  const auto n = static_cast<std::uint32_t>(part.size());
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<char>((n >> shift) & 0xff));
  out.append(part);
}

}  // namespace

std::string fresh_nonce() {
  std::string nonce(kNonceBytes, '\0');
  std::size_t got = 0;
  while (got < nonce.size()) {
    const ssize_t n = ::getrandom(nonce.data() + got, nonce.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw Error(ErrorKind::kSystem, std::string("getrandom: ") + std::strerror(errno));
    }
    got += static_cast<std::size_t>(n);
  }
  return nonce;
}

std::string prove(const std::string& token, std::string_view role, std::string_view dialer_nonce,
                  std::string_view acceptor_nonce, std::string_view binding) {
  std::string message;
  put(message, role);
  put(message, dialer_nonce);
  put(message, acceptor_nonce);
  put(message, binding);
  std::string proof(kProofBytes, '\0');
  unsigned int length = 0;
  // An empty token is a valid key: a job without a token still runs the same handshake.
  static const unsigned char kEmptyKey = 0;
  const void* key = token.empty() ? static_cast<const void*>(&kEmptyKey) : token.data();
  if (!HMAC(EVP_sha256(), key, static_cast<int>(token.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(),
            reinterpret_cast<unsigned char*>(proof.data()), &length) ||
      length != kProofBytes) {
    throw Error(ErrorKind::kSystem, "HMAC-SHA256 failed");
  }
  return proof;
}

void prepare_proofs() {
  static std::once_flag once;
  std::call_once(once, [] { prove("", "", "", "", ""); });
}

bool proof_holds(std::string_view proof, const std::string& token, std::string_view role,
                 std::string_view dialer_nonce, std::string_view acceptor_nonce,
                 std::string_view binding) {
  if (proof.size() != kProofBytes) return false;
  const std::string expected = prove(token, role, dialer_nonce, acceptor_nonce, binding);
  return CRYPTO_memcmp(proof.data(), expected.data(), kProofBytes) == 0;
}

}  // namespace gradsync::net
