// The counting CPU allocator: wraps the CPU allocator found at install time, adds a 64-byte
// header in front of each allocation, and keeps the counters. Hot path: one atomic add on
// the global current bytes, a load (a CAS when it grows) of the epoch peak, and a plain
// load + store in the calling thread's own ring of live bytes per epoch.
#include "runtime/memstats/internal/cpu_accounting.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <new>
#include <vector>

namespace memlean::memstats::detail {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_epoch_peak{0};
std::atomic<uint32_t> g_epoch{0};

namespace {

// Live bytes per epoch: one ring of kRing slots per thread, written only by its thread
// (plain load + store, no lock prefix), summed over all threads by readers. A slot word is
// the epoch's lap (epoch >> kRingBits) above the thread's net bytes for that epoch (signed:
// a thread may free what another allocated). A slot still holding an older lap is reused;
// one holding a newer lap means the epoch is too old to be asked about, so it is skipped.
constexpr int kLapBits = 32 - static_cast<int>(kRingBits);
constexpr int kBytesBits = 64 - kLapBits;
constexpr uint64_t kBytesMask = (uint64_t{1} << kBytesBits) - 1;
constexpr uint32_t kLapMask = (uint32_t{1} << kLapBits) - 1;

inline uint32_t lap_of(uint32_t epoch) { return epoch >> kRingBits; }
inline uint64_t pack(uint32_t lap, int64_t bytes) {
  return (uint64_t{lap} << kBytesBits) | (static_cast<uint64_t>(bytes) & kBytesMask);
}
inline uint32_t lap_in(uint64_t w) { return static_cast<uint32_t>(w >> kBytesBits); }
inline int64_t bytes_in(uint64_t w) {
  return static_cast<int64_t>(w << kLapBits) >> kLapBits;  // sign-extends
}

struct Ring {
  std::atomic<uint64_t> slots[kRing] = {};
};

// Adds delta to the slot of `epoch`; one writer per ring at a time.
inline void ring_update(Ring& ring, uint32_t epoch, int64_t delta) {
  std::atomic<uint64_t>& s = ring.slots[epoch & (kRing - 1)];
  const uint64_t w = s.load(std::memory_order_relaxed);
  const uint32_t lap = lap_of(epoch), have = lap_in(w);
  if (have == lap) {
    s.store(pack(lap, bytes_in(w) + delta), std::memory_order_relaxed);
  } else if (((lap - have) & kLapMask) < (uint32_t{1} << (kLapBits - 1))) {
    s.store(pack(lap, delta), std::memory_order_relaxed);
  }
}

// The rings of live threads, and one for threads that exited (and for frees that happen
// while a thread exits), under one mutex. Leaked: frees run until the process is gone.
struct Rings {
  std::mutex mu;
  std::vector<Ring*> live;
  Ring exited;
};
Rings& rings() {
  static Rings* r = new Rings;
  return *r;
}

thread_local Ring* tls_ring = nullptr;
thread_local bool tls_exiting = false;

struct RingOwner {
  Ring* ring = nullptr;
  ~RingOwner() {
    tls_exiting = true;
    tls_ring = nullptr;
    if (ring == nullptr) return;
    Rings& r = rings();
    std::lock_guard<std::mutex> lock(r.mu);
    for (uint32_t i = 0; i < kRing; ++i) {
      const uint64_t w = ring->slots[i].load(std::memory_order_relaxed);
      if (bytes_in(w) == 0) continue;
      const uint32_t epoch = (lap_in(w) << kRingBits) | i;
      ring_update(r.exited, epoch, bytes_in(w));
    }
    r.live.erase(std::find(r.live.begin(), r.live.end(), ring));
    delete ring;
  }
};
thread_local RingOwner tls_owner;

C10_NOINLINE void ring_add_slow(uint32_t epoch, int64_t delta) {
  Rings& r = rings();
  if (!tls_exiting) {
    auto* ring = new Ring;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      r.live.push_back(ring);
    }
    tls_owner.ring = ring;
    tls_ring = ring;
    ring_update(*ring, epoch, delta);
    return;
  }
  std::lock_guard<std::mutex> lock(r.mu);
  ring_update(r.exited, epoch, delta);
}

inline void ring_add(uint32_t epoch, int64_t delta) {
  if (Ring* ring = tls_ring; C10_LIKELY(ring != nullptr)) {
    ring_update(*ring, epoch, delta);
  } else {
    ring_add_slow(epoch, delta);
  }
}

inline void count_alloc(uint64_t n, uint32_t epoch) {
  const int64_t now = g_current.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) +
                      static_cast<int64_t>(n);
  int64_t peak = g_epoch_peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !g_epoch_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  ring_add(epoch, static_cast<int64_t>(n));
}

inline void count_free(uint64_t n, uint32_t epoch) {
  g_current.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  ring_add(epoch, -static_cast<int64_t>(n));
}

void counting_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeaderBytes;
  const Header* h = reinterpret_cast<const Header*>(base);
  TORCH_INTERNAL_ASSERT(h->magic == kMagic, "memstats: freeing memory without a memstats header");
  count_free(h->nbytes, h->epoch);
  if (h->inner_deleter == nullptr) {
    c10::profiledCPUMemoryReporter().Delete(data);
    c10::free_cpu(base);
  } else {
    h->inner_deleter(h->inner_context);
  }
}

class CountingAllocator final : public c10::Allocator {
 public:
  // direct: the wrapped allocator is c10's default one; allocate with c10::alloc_cpu and
  // report (data, nbytes) to the profiler exactly as it would. Otherwise the wrapped
  // allocator allocates nbytes + kHeaderBytes and reports what it reports.
  CountingAllocator(c10::Allocator* inner, bool direct) : inner_(inner), direct_(direct) {}

  c10::DataPtr allocate(size_t nbytes) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (nbytes == 0) return {nullptr, nullptr, &counting_delete, cpu};
    TORCH_CHECK(nbytes <= std::numeric_limits<size_t>::max() - kHeaderBytes,
                "memstats: cannot allocate ", nbytes, " bytes");
    char* base = nullptr;
    void* inner_context = nullptr;
    c10::DeleterFnPtr inner_deleter = nullptr;
    if (direct_) {
      try {
        base = static_cast<char*>(c10::alloc_cpu(nbytes + kHeaderBytes));
      } catch (const c10::Error&) {
        c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
        throw;
      }
    } else {
      c10::DataPtr inner = inner_->allocate(nbytes + kHeaderBytes);
      base = static_cast<char*>(inner.get());
      inner_deleter = inner.get_deleter();
      inner_context = inner.release_context();
      TORCH_INTERNAL_ASSERT(inner_deleter != nullptr && base != nullptr);
    }
    const uint32_t epoch = g_epoch.load(std::memory_order_acquire);
    new (base) Header{nbytes, epoch, kMagic, inner_context, inner_deleter};
    char* data = base + kHeaderBytes;
    count_alloc(nbytes, epoch);
    if (direct_) c10::profiledCPUMemoryReporter().New(data, nbytes);
    return {data, data, &counting_delete, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
  bool direct_;
};

std::atomic<CountingAllocator*> g_allocator{nullptr};
std::once_flag g_install_once;

}  // namespace

c10::Allocator* install() {
  std::call_once(g_install_once, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    // Intentionally leaked: c10 keeps a raw pointer, and storages outlive everything.
    auto* counting = new CountingAllocator(inner, inner == c10::GetDefaultCPUAllocator());
    g_allocator.store(counting);
    // The highest priority: whatever allocator was installed, at any priority, is wrapped.
    c10::SetCPUAllocator(counting, /*priority=*/255);
  });
  c10::Allocator* counting = g_allocator.load();
  TORCH_CHECK(c10::GetCPUAllocator() == counting,
              "memstats: another CPU allocator replaced memstats' counting allocator "
              "(c10::SetCPUAllocator with priority 255); CPU accounting is off");
  return counting;
}

c10::Allocator* counting_allocator() { return g_allocator.load(); }

const Header* header_of(const c10::StorageImpl& storage) {
  const c10::DataPtr& dp = storage.data_ptr();
  if (dp.get_deleter() != &counting_delete || dp.get() == nullptr) return nullptr;
  return reinterpret_cast<const Header*>(static_cast<const char*>(dp.get()) - kHeaderBytes);
}

int64_t advance_epoch() {
  const uint32_t next = g_epoch.load(std::memory_order_relaxed) + 1;
  const int64_t peak =
      g_epoch_peak.exchange(g_current.load(std::memory_order_relaxed), std::memory_order_acq_rel);
  g_epoch.store(next, std::memory_order_release);
  return peak;
}

int64_t live_bytes_in_epochs(uint32_t first, uint32_t last) {
  const uint32_t now = g_epoch.load(std::memory_order_acquire);
  if (now - first >= kRing || last - first > now - first) return -1;
  Rings& r = rings();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t sum = 0;
  auto add = [&](const Ring& ring) {
    for (uint32_t e = first;; ++e) {
      const uint64_t w = ring.slots[e & (kRing - 1)].load(std::memory_order_relaxed);
      if (lap_in(w) == lap_of(e)) sum += bytes_in(w);
      if (e == last) break;
    }
  };
  for (const Ring* ring : r.live) add(*ring);
  add(r.exited);
  return sum;
}

}  // namespace memlean::memstats::detail
