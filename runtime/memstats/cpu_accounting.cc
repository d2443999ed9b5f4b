// The counting CPU allocator: wraps the CPU allocator found at install time, adds a 64-byte
// header in front of each allocation, and keeps global atomic counters. Hot path: one
// fetch_add on the current bytes, a load (rarely a CAS) on the epoch peak, one fetch_add on
// the epoch's live bytes.
#include "runtime/memstats/cpu_accounting.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <limits>
#include <mutex>
#include <new>

namespace memlean::memstats::detail {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_epoch_peak{0};
std::atomic<uint32_t> g_epoch{0};

namespace {

// Slot word: the epoch's lap (epoch >> kRingBits, 20 bits) above 44 bits of live bytes. A
// slot is reused every kRing epochs; the lap tells a free whether the slot still belongs to
// the epoch of its allocation.
constexpr int kBytesBits = 44;
constexpr uint64_t kBytesMask = (uint64_t{1} << kBytesBits) - 1;
static_assert(32 - kRingBits + kBytesBits == 64);

std::atomic<uint64_t> g_ring[kRing];

inline uint64_t lap_tag(uint32_t epoch) { return uint64_t{epoch >> kRingBits} << kBytesBits; }
inline std::atomic<uint64_t>& slot(uint32_t epoch) { return g_ring[epoch & (kRing - 1)]; }

inline void count_alloc(uint64_t n, uint32_t epoch) {
  const int64_t now = g_current.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) +
                      static_cast<int64_t>(n);
  int64_t peak = g_epoch_peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !g_epoch_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  // The slot of the epoch just read is initialized (advance_epoch publishes the epoch after
  // resetting its slot) and is not reused before kRing more epochs.
  slot(epoch).fetch_add(n, std::memory_order_relaxed);
}

inline void count_free(uint64_t n, uint32_t epoch) {
  g_current.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  std::atomic<uint64_t>& s = slot(epoch);
  const uint64_t tag = lap_tag(epoch);
  uint64_t w = s.load(std::memory_order_relaxed);
  // A slot reused by a later epoch (the allocation is more than kRing epochs old) is left
  // alone: its old bytes were dropped when it was reused.
  while ((w & ~kBytesMask) == tag && (w & kBytesMask) >= n) {
    if (s.compare_exchange_weak(w, w - n, std::memory_order_relaxed)) break;
  }
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

c10::DeleterFnPtr counting_deleter() { return &counting_delete; }

const Header* header_of(const c10::StorageImpl& storage) {
  const c10::DataPtr& dp = storage.data_ptr();
  if (dp.get_deleter() != &counting_delete || dp.get() == nullptr) return nullptr;
  return reinterpret_cast<const Header*>(static_cast<const char*>(dp.get()) - kHeaderBytes);
}

int64_t advance_epoch() {
  const uint32_t next = g_epoch.load(std::memory_order_relaxed) + 1;
  // Reuse the slot before publishing the epoch: an allocation that reads `next` finds its
  // slot ready; a late free of an allocation kRing epochs older sees a different lap.
  slot(next).store(lap_tag(next), std::memory_order_relaxed);
  const int64_t peak =
      g_epoch_peak.exchange(g_current.load(std::memory_order_relaxed), std::memory_order_acq_rel);
  g_epoch.store(next, std::memory_order_release);
  return peak;
}

int64_t live_bytes_in_epochs(uint32_t first, uint32_t last) {
  const uint32_t now = g_epoch.load(std::memory_order_acquire);
  if (now - first >= kRing || last - first > now - first) return -1;
  int64_t sum = 0;
  for (uint32_t e = first;; ++e) {
    const uint64_t w = slot(e).load(std::memory_order_relaxed);
    if ((w & ~kBytesMask) == lap_tag(e)) sum += static_cast<int64_t>(w & kBytesMask);
    if (e == last) break;
  }
  return sum;
}

}  // namespace memlean::memstats::detail
