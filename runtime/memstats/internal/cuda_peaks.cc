// cuda_peaks.h: a trace tracker on torch's CUDA caching allocator keeps each device's peak.
//
// What the allocator reports, and when (c10/cuda/CUDACachingAllocator.cpp, torch 2.11-2.14):
// ALLOC is reported before the allocation is counted in allocated_bytes, FREE_REQUESTED after
// the free is subtracted, and both carry the requested size, not the rounded block size that
// allocated_bytes counts. So the tracker reads the allocator's own figures instead: at every
// event, allocated_bytes is exact for everything reported before it; an allocation still
// uncounted at its own event is resolved at the device's next event, where active_bytes
// (which grows by the block's size after ALLOC and shrinks only after FREE_COMPLETED) has
// grown by exactly that block's size. Between events, allocated_bytes read directly is exact.
#include "runtime/memstats/internal/cuda_peaks.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace memlean::memstats::detail {

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
constexpr int kMaxDevices = 64;

struct Figures {
  int64_t allocated = 0, active = 0, torch_peak = 0;
};

Figures figures(c10::DeviceIndex device) {
  const auto s = cca::getDeviceStats(device);
  return {s.allocated_bytes[kAggregate].current, s.active_bytes[kAggregate].current,
          s.allocated_bytes[kAggregate].peak};
}

// One device's peak. The tracker runs under the allocator's (recursive) lock of the device
// and reads the allocator's figures before taking `mu`; nothing calls the allocator while
// holding `mu`, so the locks are always taken allocator first, and nothing can deadlock.
struct DevicePeak {
  std::atomic<bool> observed{false};
  std::mutex mu;
  int64_t peak = 0;
  // An allocation reported but not yet counted: allocated and active bytes at its event.
  bool pending = false;
  int64_t pending_allocated = 0, pending_active = 0;
};

// Leaked on purpose: the allocator may report events during exit.
std::array<DevicePeak, kMaxDevices>& device_peaks() {
  static auto* peaks = new std::array<DevicePeak, kMaxDevices>;
  return *peaks;
}

void on_event(const cca::TraceEntry& event) {
  // Only what changes allocated bytes. The others carry no figure of their own, and one,
  // SNAPSHOT, is recorded as device 0 from every device's allocator under that device's
  // lock: acting on it, a torch.cuda.memory_snapshot() racing an allocation on cuda:0 could
  // resolve a pending allocation with a stale figure.
  switch (event.action_) {
    case cca::TraceEntry::ALLOC:
    case cca::TraceEntry::FREE_REQUESTED:
    case cca::TraceEntry::FREE_COMPLETED:
      break;
    default:
      return;
  }
  if (event.device_ < 0 || event.device_ >= kMaxDevices) return;
  DevicePeak& p = device_peaks()[event.device_];
  if (!p.observed.load(std::memory_order_acquire)) return;
  const Figures f = figures(event.device_);
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.pending) {
    p.peak = std::max(p.peak, p.pending_allocated + (f.active - p.pending_active));
    p.pending = false;
  }
  p.peak = std::max(p.peak, f.allocated);
  if (event.action_ == cca::TraceEntry::ALLOC) {
    p.pending = true;
    p.pending_allocated = f.allocated;
    p.pending_active = f.active;
  }
}

// Attaches the tracker once per process (the allocator has no way to detach one). The
// allocator must be initialized first: it attaches trackers to the devices it has set up.
void attach() {
  static std::once_flag once;
  std::call_once(once, [] {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    try {
      cca::attachAllocatorTraceTracker(on_event);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false,
                  "memstats: CUDA peaks are observed from torch's caching allocator, and this "
                  "allocator cannot be observed (PYTORCH_CUDA_ALLOC_CONF's "
                  "backend:cudaMallocAsync?): ",
                  e.what_without_backtrace());
    }
  });
}

// The device's peak, observed from now on; the peak before is torch's own, read once.
DevicePeak& observed(c10::DeviceIndex device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "memstats: CUDA device index ", device,
              " is out of range (memstats observes devices 0 to ", kMaxDevices - 1, ")");
  DevicePeak& p = device_peaks()[device];
  if (!p.observed.load(std::memory_order_acquire)) {
    attach();
    {
      std::lock_guard<std::mutex> lock(p.mu);
      p.observed.store(true, std::memory_order_release);
    }
    // Events from here on are observed; torch's peak covers everything before this read.
    const Figures f = figures(device);
    std::lock_guard<std::mutex> lock(p.mu);
    p.peak = std::max(p.peak, f.torch_peak);
  }
  return p;
}

int64_t epoch_peak(c10::DeviceIndex device) {
  DevicePeak& p = observed(device);
  // A pending allocation is counted by now: allocated_bytes read here includes it.
  const int64_t allocated = figures(device).allocated;
  std::lock_guard<std::mutex> lock(p.mu);
  return std::max(p.peak, allocated);
}

int64_t new_epoch(c10::DeviceIndex device) {
  DevicePeak& p = observed(device);
  const int64_t allocated = figures(device).allocated;
  std::lock_guard<std::mutex> lock(p.mu);
  const int64_t peak = std::max(p.peak, allocated);
  // A pending allocation stays pending: one made after the read above belongs to the new
  // epoch, and one made before resolves to `allocated`, the new epoch's start anyway.
  p.peak = allocated;
  return peak;
}

int64_t block_bytes(c10::DeviceIndex device,
                    const std::vector<std::pair<uintptr_t, int64_t>>& storages) {
  if (storages.empty()) return 0;
  // Each segment's blocks lie end to end from its address (as torch.cuda.memory_snapshot()
  // gives them addresses).
  std::unordered_map<uintptr_t, int64_t> blocks;
  for (const auto& segment : cca::snapshot({0, 0}, /*include_traces=*/false).segments) {
    if (segment.device != device) continue;
    auto address = static_cast<uintptr_t>(segment.address);
    for (const auto& block : segment.blocks) {
      if (block.allocated) blocks[address] = static_cast<int64_t>(block.size);
      address += block.size;
    }
  }
  int64_t total = 0;
  for (const auto& [ptr, nbytes] : storages) {
    const auto found = blocks.find(ptr);
    total += found != blocks.end() ? found->second : nbytes;
  }
  return total;
}

const bool registered = register_cuda_peaks({&epoch_peak, &new_epoch, &block_bytes});

}  // namespace

}  // namespace memlean::memstats::detail
