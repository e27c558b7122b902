// The bytes of one rank's shared-memory segment (its "inbox"), which every process of the
// group maps: these types and sizes are the shm transport's wire format.
//
// A segment is a header (doorbell, sleeping flag, pid, closed flag; in the segment of the
// group's first rank also the group's abort state) followed by one ring per peer that sends to
// its owner. A ring is a control block (producer head and consumer tail counters on separate
// cache lines, one descriptor per slot) and the slots. A message of B bytes occupies
// max(1, ceil(B / slot_bytes)) consecutive slots; every slot's descriptor repeats the message's
// tag and length and gives the piece's offset, so the receiver checks tag and length on the
// first piece and a zero-length message is one empty slot. After the rings comes the owner's
// shared-arena region (see SharedArena): raw memory for collectives that reduce straight out of
// each other's buffers, guarded by a progress counter in the header.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "gradsync/shm_segments.h"
#include "transport/transport.h"

// Hidden, as all shm internals are (see shm_group.h).
#pragma GCC visibility push(hidden)
namespace gradsync::transport::shm {

// ---- Geometry ----------------------------------------------------------------------------
//
// Ring geometry for small groups: 16 slots of 128 KiB. Between two processes streaming large
// messages, 8 x 256 KiB, 16 x 128 KiB and 32 x 64 KiB all reach the memory-bandwidth limit,
// copying out and consuming in place alike (docs/performance-notes.md), so the choice rests on
// two other effects. Smaller slots fill the pipeline sooner (the consumer starts after one
// slot), which adds up over the 2(N-1) steps of a ring all-reduce; and a slot takes less than
// kSpinBeforeSleep (shm_group.h) to copy, so a consumer waiting for the next slot catches it
// while spinning instead of paying a futex wake-up per slot. Many slots let the producer run
// ahead through scheduling jitter. The whole ring (2 MiB) stays cache-resident (1 MiB L2 per
// core, 32 MiB L3), so the consumer reads what the producer just wrote from cache, not DRAM.
constexpr std::uint32_t kSlotCount = 16;
constexpr std::size_t kMaxSlotBytes = 128 * 1024;
// Large groups get smaller slots so one rank's inbox stays within kInboxBudgetBytes (shared
// memory grows with ranks^2 otherwise). The floor keeps bookkeeping cheap, and because slot
// sizes are powers of two >= 16 KiB, pieces handed to a consumer never split an element.
constexpr std::size_t kMinSlotBytes = 16 * 1024;
constexpr std::size_t kInboxBudgetBytes = std::size_t{32} << 20;
// Each member's arena region. The shared-memory all-reduce stages a few chunks of a few hundred
// KiB per member there (collectives/shared_memory.cc); 4 MiB leaves it room to try larger
// chunks without making /dev/shm use grow much next to the inbox rings (up to 32 MiB a rank).
constexpr std::size_t kArenaRegionBytes = std::size_t{4} << 20;

constexpr std::size_t kCacheLine = 64;
constexpr std::size_t kPageBytes = 4096;
constexpr std::uint64_t kSegmentMagic = 0x31636e7973647267;  // "grdsync1" little-endian
constexpr std::uint32_t kLayoutVersion = 2;                  // 2: arena region and counter
constexpr std::int32_t kNoMember = -1;
constexpr std::size_t kAbortReasonBytes = 1024;

// ---- Shared structures -------------------------------------------------------------------

// Futex words must be plain 32-bit integers in memory.
using FutexWord = std::atomic<std::uint32_t>;
static_assert(sizeof(FutexWord) == 4 && FutexWord::is_always_lock_free);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "ring counters are shared between processes and must not use a lock");

// Describes the piece of a message held by one slot. Written by the producer before it
// publishes the slot, read by the consumer after it sees the publication.
struct alignas(kCacheLine) SlotDescriptor {
  Tag tag;                      // tag of the whole message
  std::uint64_t message_bytes;  // length of the whole message
  std::uint64_t offset;         // where this piece starts in the message
  std::uint64_t length;         // bytes of payload in this slot
};

struct RingControl {
  // Slots ever published by the producer / released by the consumer (64 bits never wrap).
  // Accessed seq_cst, not just release/acquire, for the sleep/wake handshake (wake_if_sleeping).
  alignas(kCacheLine) std::atomic<std::uint64_t> head{0};
  alignas(kCacheLine) std::atomic<std::uint64_t> tail{0};
  SlotDescriptor slots[kSlotCount];
};

enum AbortState : std::uint32_t { kNotAborted = 0, kAbortBeingWritten = 1, kAbortPublished = 2 };

struct GroupControl {
  alignas(kCacheLine) FutexWord abort_state{kNotAborted};
  std::int32_t abort_rank = -1;
  char abort_reason[kAbortReasonBytes] = {};
};

struct SegmentHeader {
  // Written once by the owner before the segment's name is published.
  std::uint64_t magic = 0;
  std::uint32_t layout_version = 0;
  std::uint32_t group_size = 0;
  std::uint64_t slot_bytes = 0;
  std::uint64_t arena_bytes = 0;
  std::uint64_t segment_bytes = 0;
  std::int32_t owner_rank = -1;
  std::int32_t owner_pid = 0;
  std::uint64_t owner_pid_namespace = 0;
  // Bumped by whoever wants the owner to re-check its rings (new data, freed space, abort).
  alignas(kCacheLine) FutexWord doorbell{0};
  // Non-zero while the owner is (about to be) asleep on the doorbell: only then do others
  // pay for a FUTEX_WAKE system call.
  alignas(kCacheLine) FutexWord owner_sleeping{0};
  // While the owner sleeps in SharedArena::wait_for: the member whose progress it waits for,
  // so only that member's publishes ring the doorbell (kNoMember for message waits). Read by
  // publishers after they see owner_sleeping set (same cache line: one miss for both).
  std::atomic<std::int32_t> sleeping_for_member{kNoMember};
  // The owner's arena progress counter (SharedArena::publish). seq_cst like the ring
  // counters, for the same sleep/wake handshake (wake_if_sleeping).
  alignas(kCacheLine) std::atomic<std::uint64_t> arena_progress{0};
  // The call the owner last waited in (SharedArena::wait_for's `call`): written before the
  // owner publishes in that call, so whoever sees the progress can name the call.
  std::atomic<std::uint64_t> arena_call[4] = {};
  // Set when the owner destroys its transport: what it published is still delivered, but
  // nothing more will come.
  alignas(kCacheLine) FutexWord owner_closed{0};
  GroupControl group;  // used only in the segment of the group's first rank
};

// remove_stale_shm_segments (shm_segments.h) reads it there, without this layout.
static_assert(offsetof(SegmentHeader, owner_pid_namespace) == kShmCreatorNamespaceOffset);

constexpr std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

// Sizes and offsets of one segment; identical for every rank of a group.
struct Layout {
  explicit Layout(int members) {
    std::size_t senders = static_cast<std::size_t>(std::max(members - 1, 1));
    slot_bytes = kMaxSlotBytes;
    while (slot_bytes > kMinSlotBytes && senders * kSlotCount * slot_bytes > kInboxBudgetBytes) {
      slot_bytes /= 2;
    }
    header_bytes = round_up(sizeof(SegmentHeader), kPageBytes);
    control_bytes = round_up(sizeof(RingControl), kPageBytes);
    ring_bytes = control_bytes + kSlotCount * slot_bytes;
    arena_offset = header_bytes + static_cast<std::size_t>(members - 1) * ring_bytes;
    arena_bytes = kArenaRegionBytes;
    segment_bytes = arena_offset + arena_bytes;
  }
  // The ring in the segment of group member `receiver` that carries messages from `sender`.
  std::size_t ring_offset(int sender, int receiver) const {
    int index = sender < receiver ? sender : sender - 1;
    return header_bytes + static_cast<std::size_t>(index) * ring_bytes;
  }

  std::size_t slot_bytes;
  std::size_t header_bytes;
  std::size_t control_bytes;
  std::size_t ring_bytes;
  std::size_t arena_offset;  // page aligned: every part before it is a whole number of pages
  std::size_t arena_bytes;
  std::size_t segment_bytes;
};

}  // namespace gradsync::transport::shm
#pragma GCC visibility pop
