// Memory that every rank of a group has mapped, plus one progress counter per member: what a
// same-host transport can offer collectives beyond messages. Knows nothing of dtypes,
// reductions or how a collective lays out its bytes; the algorithm gives the bytes meaning.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/transport.h"

namespace gradsync::transport {

// Members are numbered 0..members()-1 in ascending global rank. Each member owns one region
// and one counter; every member may read and write every region, and the counters are how
// they agree on who may touch which bytes when.
//
// What a collective built on the arena must do, so that the transport can tell a mismatched
// call from a slow one (see wait_for's kMismatch): every member runs it to the same final
// counter value; no member sends messages during it; and a member leaves it only after it has
// waited for every value any member waits for in it (then a message it sends afterwards
// cannot overtake a value someone still waits for).
//
// Threading contract: like the transport that offers it (one thread at a time publishes and
// waits; the same thread that drives the transport's requests).
class SharedArena {
 public:
  virtual ~SharedArena() = default;

  virtual int members() const = 0;
  virtual int member_index() const = 0;           // this rank's member number
  virtual int member_rank(int member) const = 0;  // global rank of a member (for messages)

  // region_bytes() bytes, page aligned, mapped at (possibly) different addresses in each
  // process. Zero-filled when the group is set up; afterwards it holds whatever members wrote.
  virtual unsigned char* region(int member) = 0;
  virtual std::size_t region_bytes() const = 0;

  // The member's counter as last published (acquire: what the member wrote to any region
  // before publishing it is visible once the value is seen).
  virtual std::uint64_t progress(int member) const = 0;

  // Sets this member's counter to `value` (release) and wakes members sleeping on it. The
  // counter only grows: `value` must be >= the current one. 64 bits: it never wraps.
  virtual void publish(std::uint64_t value) = 0;

  // Returns once `member`'s counter is >= value: spins briefly, then sleeps until the member
  // publishes. `call` names the collective on whose behalf this rank waits: error messages
  // here and on peers name it (a member's first wait in a collective should precede its
  // first publish in it, so peers that see the progress can name the call).
  // Throws gradsync::Error like the transport's requests: kPeerLost naming the member if it
  // died or closed its transport first, kAborted if the group was aborted, kTimeout at the
  // deadline, and kMismatch if a member sent this rank a message meanwhile (it is in a
  // message-based collective while this rank is in a shared-memory one).
  virtual void wait_for(int member, std::uint64_t value, const Tag& call,
                        Clock::time_point deadline) = 0;
};

// memcpy (no overlap) into memory other processes read: arena regions and the shm transport's
// rings. glibc's copy (rep movsb at these sizes) runs at half speed or worse there where `dst`
// lies 1 to 63 bytes past `src` modulo 4 KiB, 2x slower where the memory's lines are cached
// by the core that reads them next; such pairs are copied through a private buffer instead.
void copy_to_shared(void* dst, const void* src, std::size_t bytes);

}  // namespace gradsync::transport
