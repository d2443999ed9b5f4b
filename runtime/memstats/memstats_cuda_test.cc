// memstats on CUDA, in a process that loads libtorch_cuda (when torch has CUDA). Without a
// GPU: the clear errors. With one: the caching allocator's figures, nesting, categories.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#ifdef MEMLEAN_TEST_WITH_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "runtime/memstats/memstats.h"
#include "testing/expect_error.h"
#include "third_party/torch/devices.h"

namespace memlean::memstats {
namespace {

using ::memlean::testing::expect_error;

bool have_gpu() { return memlean::have_cuda_device(); }

TEST(MemstatsCuda, LibtorchCudaIsLoadedWhenTorchHasCuda) {
#ifdef MEMLEAN_TEST_WITH_TORCH_CUDA
  // Referencing c10_cuda keeps the library linked; its allocator is a DeviceAllocator.
  EXPECT_GE(c10::cuda::device_count(), 0);
  EXPECT_NE(dynamic_cast<c10::DeviceAllocator*>(c10::GetAllocator(c10::DeviceType::CUDA)),
            nullptr);
#else
  GTEST_SKIP() << "torch has no CUDA";
#endif
}

TEST(MemstatsCuda, ClearErrorWithoutAGpu) {
  if (have_gpu()) GTEST_SKIP() << "a GPU is present";
  expect_error([] { Tracker t("cuda"); }, "CUDA is not available");
  expect_error([] { Tracker t("cuda:0"); }, "CUDA is not available");
  expect_error([] { memory_allocated(c10::Device(c10::DeviceType::CUDA, 0)); },
               "CUDA is not available");
  // The CPU side works in the same process.
  Tracker t("cpu");
  const int64_t base = t.current();
  at::Tensor x = at::empty({100});
  EXPECT_EQ(t.current() - base, 400);
}

TEST(MemstatsCuda, AllocatedBytesPeaksAndCategories) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const c10::Device dev(c10::DeviceType::CUDA, 0);
  const auto opts = at::TensorOptions().device(dev).dtype(at::kFloat);
  expect_error([] { Tracker t("cuda:99"); }, "out of range");
  Tracker outer("cuda");
  EXPECT_EQ(outer.device(), dev);
  const int64_t base = outer.current();
  at::Tensor a = at::empty({1000}, opts);  // 4000 bytes, a 4096-byte block
  EXPECT_EQ(outer.current() - base, 4096);
  {
    Tracker inner(dev);
    at::Tensor b = at::empty({1 << 20}, opts);  // 4 MiB
    b.reset();
    EXPECT_EQ(inner.peak() - base, 4096 + (4 << 20));
    inner.reset_peak();
    EXPECT_EQ(inner.peak() - base, 4096);
    EXPECT_EQ(outer.peak() - base, 4096 + (4 << 20));
    EXPECT_GE(inner.reserved(), inner.current());
    Mark m = inner.mark("x");
    EXPECT_EQ(m.kept, -1);
  }
  EXPECT_GE(max_memory_allocated(dev), base + 4096 + (4 << 20));
  at::Tensor p = at::empty({1000}, opts);
  Tracker::Tensors tensors;
  tensors.parameters = {p};
  Categories c = outer.categories(tensors);
  EXPECT_EQ(c.parameters, 4000);
  EXPECT_EQ(c.total, outer.current());
  EXPECT_GE(c.allocator_rounding, 96 * 2);
  EXPECT_EQ(c.parameters + c.buffers + c.gradients + c.optimizer_state + c.activations + c.other +
                c.allocator_rounding,
            c.total);
}

// allocated_bytes_of counts the caching allocator's blocks: what memory_allocated grew by
// when the tensors were made (their requests rounded up to 512 bytes, and larger where a
// cached block was not split), each storage once.
TEST(MemstatsCuda, AllocatedBytesOfCountsTheAllocatorsBlocks) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const c10::Device dev(c10::DeviceType::CUDA, 0);
  const auto bytes = at::TensorOptions().device(dev).dtype(at::kByte);
  // A free cached 3 MiB block between allocated ones: the 2.5 MiB request below may get it
  // whole (the rest of a large block is not split off when under 1 MiB), a block larger than
  // the request rounded.
  at::Tensor first = at::empty({3 << 20}, bytes);
  at::Tensor fence = at::empty({3 << 19}, bytes);
  first.reset();
  const int64_t before = memory_allocated(dev);
  std::vector<at::Tensor> made = {at::empty({1}, bytes), at::empty({513}, bytes),
                                  at::empty({(5 << 19) + 1}, bytes), at::empty({4096}, bytes)};
  const int64_t grown = memory_allocated(dev) - before;
  EXPECT_GT(grown, 1 + 513 + (5 << 19) + 1 + 4096);
  std::vector<at::Tensor> with_views = made;
  with_views.push_back(made[3].view({64, 64}).t());
  with_views.push_back(made[2].narrow(0, 7, 100));
  with_views.push_back(at::empty({1000}, at::kFloat));  // on the CPU: not counted here
  EXPECT_EQ(allocated_bytes_of(with_views, dev), grown);
  EXPECT_EQ(allocated_bytes_of({made[0]}, dev), 512);
  EXPECT_EQ(allocated_bytes_of({made[1]}, dev), 1024);
  EXPECT_GE(allocated_bytes_of({made[2]}, dev), (5 << 19) + 512);
  std::printf("a request of %d bytes holds a block of %lld\n", (5 << 19) + 1,
              static_cast<long long>(allocated_bytes_of({made[2]}, dev)));
  EXPECT_EQ(allocated_bytes_of({made[0]}, c10::Device(c10::DeviceType::CUDA)), 512);
  EXPECT_EQ(allocated_bytes_of({made[0]}, c10::kCPU), 0);
}

// torch.cuda.max_memory_allocated() is the allocator's own peak: users read it, so starting,
// nesting, resetting, marking and stopping trackers must leave it as it is.
TEST(MemstatsCuda, TorchPeakCounterIsLeftAlone) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const c10::Device dev(c10::DeviceType::CUDA, 0);
  const auto opts = at::TensorOptions().device(dev).dtype(at::kFloat);
  c10::DeviceAllocator* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  constexpr size_t kAggregate =
      static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  auto torch_peak = [&] { return allocator->getDeviceStats(0).allocated_bytes[kAggregate].peak; };
  at::empty({16 << 20}, opts);  // 64 MiB, freed at once: torch's peak is at least that
  const int64_t before = torch_peak();
  {
    Tracker outer(dev);
    const int64_t base = outer.current();
    at::Tensor a = at::empty({1 << 20}, opts);
    {
      Tracker inner(dev);
      at::empty({1 << 18}, opts);
      inner.reset_peak();
      inner.mark("m");
      EXPECT_EQ(inner.peak() - base, 4 << 20);
    }
    EXPECT_EQ(outer.peak() - base, (4 << 20) + (1 << 20));
    // The process-wide figure starts from torch's peak when memstats first observes it.
    EXPECT_GE(max_memory_allocated(dev), before);
    EXPECT_EQ(torch_peak(), before);
  }
  EXPECT_EQ(torch_peak(), before);
}

}  // namespace
}  // namespace memlean::memstats
