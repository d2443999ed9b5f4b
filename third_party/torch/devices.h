// Whether this process can run CUDA work, asked one way everywhere (experiments, tests and
// benchmarks choose their device or skip with it), and waiting for a device's work.
#pragma once

#include <ATen/Context.h>
#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace memlean {

// torch was built with CUDA, its CUDA library is loaded, and at least one GPU is visible.
inline bool have_cuda_device() { return at::hasCUDA() && at::getNumGPUs() > 0; }

// Waits for the work queued on `device` (its current device when it has no index); nothing on
// the CPU. For timing a step, and before reading a device's memory figures.
inline void synchronize(c10::Device device) {
  if (device.is_cpu()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  impl->synchronizeDevice(device.has_index() ? device.index() : impl->getDevice().index());
}

}  // namespace memlean
