// memstats internals: the counting CPU allocator and its global counters (for memstats.cc,
// the tests and the benchmark; not a public API).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace memlean::memstats::detail {

// Every counted allocation carries this header in the kHeaderBytes just before its data, so
// the DataPtr stays "simple" (context == data, what Allocator::raw_allocate, oneDNN's
// scratchpads and copy-on-write storages require) and the free knows its size and epoch.
constexpr size_t kHeaderBytes = 64;
constexpr uint32_t kMagic = 0x6d656d73;  // "mems"

struct Header {
  uint64_t nbytes;
  uint32_t epoch;              // the accounting epoch when it was allocated
  uint32_t magic;
  void* inner_context;         // the wrapped allocator's DataPtr (generic path)
  c10::DeleterFnPtr inner_deleter;  // nullptr: allocated directly with c10::alloc_cpu
};
static_assert(sizeof(Header) <= kHeaderBytes);

// Bytes alive that the counting allocator allocated, and the largest value since the last
// epoch change (Tracker start, reset_peak, mark).
extern std::atomic<int64_t> g_current;
extern std::atomic<int64_t> g_epoch_peak;
// The epoch new allocations are stamped with.
extern std::atomic<uint32_t> g_epoch;

// Live bytes per epoch are kept for the last kRing epochs: a phase can be asked about while
// fewer than kRing epochs have passed since it began.
constexpr uint32_t kRingBits = 10;
constexpr uint32_t kRing = 1u << kRingBits;

// The counting allocator, created and installed by install() (idempotent). Returns it.
c10::Allocator* install();
// The counting allocator if install() ran, else nullptr.
c10::Allocator* counting_allocator();

// The header of a storage the counting allocator allocated, else nullptr.
const Header* header_of(const c10::StorageImpl& storage);

// Starts a new epoch and returns the largest g_current of the epoch that ends. Callers
// serialize (memstats.cc holds its registry lock).
int64_t advance_epoch();
// Bytes alive now that were allocated in epochs [first, last]; -1 if the ring no longer
// holds `first`.
int64_t live_bytes_in_epochs(uint32_t first, uint32_t last);

}  // namespace memlean::memstats::detail
