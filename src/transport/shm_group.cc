// Setting up a shared-memory group (segments, links, wait tuning) and its abort state; see
// shm_group.h.
#include "transport/shm_group.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <thread>
#include <utility>

#include "gradsync/shm_segments.h"
#include "rendezvous/store_util.h"

namespace gradsync::transport::shm {

using namespace std::chrono_literals;

ShmGroup::ShmGroup(int this_rank, int world_ranks, std::vector<int> group_ranks,
                   TransportOptions transport_options)
    : rank(this_rank),
      world_size(world_ranks),
      ranks(std::move(group_ranks)),
      options(std::move(transport_options)),
      layout(static_cast<int>(ranks.size())),
      link_by_rank(static_cast<std::size_t>(world_size), nullptr) {}

ShmGroup::~ShmGroup() {
  if (!own) return;  // setup failed before our segment existed
  own->owner_closed.store(1, std::memory_order_release);
  for (auto& link : links) ring_doorbell(*link->segment);
}

void ShmGroup::abort(const std::string& reason) {
  GroupControl& group = *group_control;
  std::uint32_t expected = kNotAborted;
  if (group.abort_state.compare_exchange_strong(expected, kAbortBeingWritten,
                                                std::memory_order_acq_rel)) {
    group.abort_rank = rank;
    std::size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
    std::memcpy(group.abort_reason, reason.data(), n);
    group.abort_reason[n] = '\0';
    group.abort_state.store(kAbortPublished, std::memory_order_release);
  }
  ring_doorbell(*own);
  for (auto& link : links) ring_doorbell(*link->segment);
}

void ShmGroup::fail_aborted(std::uint32_t state, int peer) {
  GroupControl& group = *group_control;
  // The aborting rank fills in the reason between its two stores; give it a moment (it may
  // also have died in between, hence the bound).
  for (int i = 0; i < 10000 && state == kAbortBeingWritten; ++i) {
    std::this_thread::sleep_for(1us);
    state = group.abort_state.load(std::memory_order_acquire);
  }
  bool published = state == kAbortPublished;
  std::string who = published ? "rank " + std::to_string(group.abort_rank) : "a rank";
  std::string reason =
      published ? std::string(group.abort_reason, ::strnlen(group.abort_reason, kAbortReasonBytes))
                : "(reason not recorded: the aborting rank died while writing it)";
  fail(std::make_exception_ptr(Error(ErrorKind::kAborted, "group aborted by " + who + ": " + reason,
                                     rank, peer, "shm transport")));
}

void ShmGroup::connect(Store& store, const std::string& key_prefix,
                       std::chrono::milliseconds timeout, const ShmOptions& shm) {
  const auto deadline = Clock::now() + timeout;
  auto remaining = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                    0ms);
  };
  const int group_size = static_cast<int>(ranks.size());
  const int my_index = my_member =
      static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  const std::uint64_t my_pid_namespace = pid_namespace_id();
  auto segment_key = [&](int r) { return key_prefix + "/shm/segment/" + std::to_string(r); };

  // Segments that ranks killed during an earlier job's setup left behind (no process will
  // unlink them now): on a shared node they would pile up until memory runs out.
  remove_stale_shm_segments_of_every_job();
  SegmentUnlinker unlinker;

  // 1. Create and initialise our inbox, then publish its name.
  std::string own_name = make_segment_name(options.token, key_prefix, rank);
  mappings.resize(static_cast<std::size_t>(group_size));
  const Mapping& own_segment = *(mappings[static_cast<std::size_t>(my_index)] =
                                     create_segment(own_name, layout, rank, unlinker));
  own = new (own_segment.bytes()) SegmentHeader();
  own->magic = kSegmentMagic;
  own->layout_version = kLayoutVersion;
  own->group_size = static_cast<std::uint32_t>(group_size);
  own->slot_bytes = layout.slot_bytes;
  own->arena_bytes = layout.arena_bytes;
  own->segment_bytes = layout.segment_bytes;
  own->owner_rank = rank;
  own->owner_pid = static_cast<std::int32_t>(::getpid());
  own->owner_pid_namespace = my_pid_namespace;
  for (int sender = 0; sender < group_size; ++sender) {
    if (sender != my_index) {
      new (own_segment.bytes() + layout.ring_offset(sender, my_index)) RingControl();
    }
  }
  store.set(segment_key(rank), to_bytes(own_name));

  // 2. Map every peer's inbox and check it was built by a compatible transport.
  for (int index = 0; index < group_size; ++index) {
    if (index == my_index) continue;
    int peer = ranks[static_cast<std::size_t>(index)];
    std::string name;
    try {
      name = to_string(store.get(segment_key(peer), remaining()));
    } catch (const Error& e) {
      throw Error(e.kind(),
                  "rank " + std::to_string(peer) + " did not publish its segment: " + e.detail(),
                  rank, peer, "shm transport setup");
    }
    unlinker.add(name);
    const Mapping& m =
        *(mappings[static_cast<std::size_t>(index)] = open_segment(name, layout, rank, peer));
    const SegmentHeader& h = m.header();
    if (h.magic != kSegmentMagic || h.layout_version != kLayoutVersion ||
        h.group_size != static_cast<std::uint32_t>(group_size) ||
        h.slot_bytes != layout.slot_bytes || h.arena_bytes != layout.arena_bytes ||
        h.owner_rank != peer) {
      throw Error(ErrorKind::kProtocol,
                  "segment " + name + " does not hold rank " + std::to_string(peer) +
                      "'s inbox for this group (different gradsync builds or key prefixes?)",
                  rank, peer, "shm transport setup");
    }
  }

  // 3. Barrier: once every rank has mapped every segment, the names are no longer needed.
  store.set(key_prefix + "/shm/mapped/" + std::to_string(rank), to_bytes("1"));
  std::vector<std::string> mapped_keys;
  for (int r : ranks) mapped_keys.push_back(key_prefix + "/shm/mapped/" + std::to_string(r));
  try {
    store.wait(mapped_keys, remaining());
  } catch (const Error& e) {
    throw Error(e.kind(), "not every rank mapped the group's segments: " + e.detail(), rank,
                Error::kNoPeer, "shm transport setup");
  }
  unlinker.unlink_all();

  // 4. Wire up the arena and the links.
  if (static_cast<unsigned>(group_size) > usable_cores()) {
    yield_when_idle = true;
    message_spin = kOversubscribedMessageSpin;
    arena_spin = kOversubscribedArenaSpin;
  }
  if (shm.spin_us >= 0) message_spin = arena_spin = std::chrono::microseconds(shm.spin_us);
  group_control = &mappings[0]->header().group;
  link_by_member.assign(static_cast<std::size_t>(group_size), nullptr);
  for (const MappingPtr& m : mappings) {
    headers.push_back(&m->header());
    regions.push_back(m->bytes() + layout.arena_offset);
  }
  for (int index = 0; index < group_size; ++index) {
    if (index == my_index) continue;
    auto link = std::make_unique<PeerLink>();
    const Mapping& peer_segment = *mappings[static_cast<std::size_t>(index)];
    link->rank = ranks[static_cast<std::size_t>(index)];
    link->segment = &peer_segment.header();
    unsigned char* out = peer_segment.bytes() + layout.ring_offset(my_index, index);
    link->out_ring = reinterpret_cast<RingControl*>(out);
    link->out_slots = out + layout.control_bytes;
    unsigned char* in = own_segment.bytes() + layout.ring_offset(index, my_index);
    link->in_ring = reinterpret_cast<RingControl*>(in);
    link->in_slots = in + layout.control_bytes;
    link->pid = static_cast<pid_t>(link->segment->owner_pid);
    bool same_namespace = link->segment->owner_pid_namespace == my_pid_namespace;
    link->pid_checkable = same_namespace && link->pid != ::getpid();
    if (link->pid_checkable) {
      link->pidfd = open_pidfd(link->pid);
      if (link->pidfd < 0 && errno == ESRCH) {
        throw Error(ErrorKind::kPeerLost,
                    "peer process " + std::to_string(link->pid) + " exited during setup", rank,
                    link->rank, "shm transport setup");
      }
    }
    link_by_rank[static_cast<std::size_t>(link->rank)] = link.get();
    link_by_member[static_cast<std::size_t>(index)] = link.get();
    links.push_back(std::move(link));
  }
}

}  // namespace gradsync::transport::shm
