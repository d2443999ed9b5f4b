// Scoped CUDA peaks observed from the caching allocator, without touching torch's counters.
// Internal to memstats (memstats.cc is the only user).
//
// torch keeps one peak per device (torch.cuda.max_memory_allocated), and resetting it is the
// only way to ask the allocator for the peak of a span. memstats must not change a counter
// its users read, so it observes the allocator instead: a trace tracker attached to the
// caching allocator sees every allocation and free, and keeps a peak of its own per device.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace memlean::memstats::detail {

// What memstats asks of the observer, per device index. epoch_peak: the largest
// allocated-bytes value (torch.cuda.memory_allocated) since the last new_epoch; before the
// first one, since the process started (torch's own peak, read once when observation of the
// device starts). new_epoch: returns the ending epoch's peak and starts the next epoch at
// the bytes allocated now. The first call for any device attaches the observer, and fails
// with a clear error under an allocator that cannot be observed (cudaMallocAsync).
// block_bytes: for (data pointer, bytes) pairs of distinct storages on the device, the sum of
// the allocator's allocated block at each pointer, or of the bytes given where no block starts
// there.
struct CudaPeaks {
  int64_t (*epoch_peak)(c10::DeviceIndex device);
  int64_t (*new_epoch)(c10::DeviceIndex device);
  int64_t (*block_bytes)(c10::DeviceIndex device,
                         const std::vector<std::pair<uintptr_t, int64_t>>& storages);
};

// cuda_peaks.cc registers itself when it is linked in (memlean built against a torch with
// CUDA); the getter fails with a clear error otherwise.
bool register_cuda_peaks(CudaPeaks peaks);
const CudaPeaks& cuda_peaks();

}  // namespace memlean::memstats::detail
