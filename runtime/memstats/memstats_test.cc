// Tests of memlean::memstats on the CPU: exact bytes, nesting peaks, threads, autograd,
// phases, reports, categories and errors. (This binary does not load libtorch_cuda.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <regex>
#include <set>
#include <thread>
#include <vector>

#include "runtime/memstats/internal/cpu_accounting.h"
#include "runtime/memstats/memstats.h"
#include "testing/expect_error.h"

namespace memlean::memstats {
namespace {

using ::memlean::testing::expect_error;

// Allocated during static initialization, before anything enabled the counting allocator.
bool g_enabled_before_main = enabled();
at::Tensor g_allocated_before_main = at::ones({1000});

at::Tensor floats(int64_t n) { return at::empty({n}, at::kFloat); }

TEST(Memstats, NotEnabledUntilAsked) {
  EXPECT_FALSE(g_enabled_before_main);
  enable();
  EXPECT_TRUE(enabled());
  enable();  // idempotent
  EXPECT_TRUE(enabled());
  EXPECT_EQ(c10::GetCPUAllocator(), detail::counting_allocator());
}

TEST(Memstats, FloatTensorMovesCurrentByExactlyFourN) {
  Tracker t;
  const int64_t base = t.current();
  for (int64_t n : {1, 3, 1000, 12345, 1 << 20}) {
    at::Tensor x = floats(n);
    EXPECT_EQ(t.current() - base, 4 * n) << n;
    EXPECT_EQ(memory_allocated() - base, 4 * n);
    x.reset();
    EXPECT_EQ(t.current(), base) << n;
  }
  EXPECT_EQ(t.peak() - base, 4 << 20);
  // Other dtypes and factory functions.
  at::Tensor d = at::zeros({7, 9}, at::kDouble);
  at::Tensor h = at::ones({5}, at::kHalf);
  at::Tensor r = at::randn({10, 10});
  at::Tensor c = r.clone();
  at::Tensor sum = r + c;
  EXPECT_EQ(t.current() - base, 7 * 9 * 8 + 5 * 2 + 4 * 100 * 3);
}

TEST(Memstats, ZeroSizeAndViewsAllocateNothing) {
  Tracker t;
  const int64_t base = t.current();
  at::Tensor e = floats(0);
  at::Tensor x = floats(100);
  at::Tensor v = x.view({10, 10}).t().narrow(0, 1, 3);
  EXPECT_EQ(t.current() - base, 400);
}

// What memory_allocated counts for given tensors: each storage once, whatever views of it are
// passed; nothing for undefined tensors, empty storages or another device's tensors.
TEST(Memstats, AllocatedBytesOfCountsEachStorageOnce) {
  Tracker t;
  const int64_t base = t.current();
  at::Tensor x = floats(100);
  at::Tensor y = at::empty({3, 7}, at::kDouble);
  const std::vector<at::Tensor> tensors = {x, x.view({10, 10}).t(), x.narrow(0, 5, 2), y,
                                           at::Tensor(), floats(0), y[1]};
  EXPECT_EQ(allocated_bytes_of(tensors, c10::kCPU), t.current() - base);
  EXPECT_EQ(allocated_bytes_of(tensors, c10::kCPU), 400 + 168);
  EXPECT_EQ(allocated_bytes_of({}, c10::kCPU), 0);
  EXPECT_EQ(allocated_bytes_of({at::Tensor()}, c10::kCPU), 0);
  EXPECT_EQ(allocated_bytes_of({x.to(at::kMeta)}, c10::kCPU), 0);
  // A sparse tensor has no storage of its own: its indices and values count.
  const at::Tensor dense = at::eye(4, at::kFloat);
  const at::Tensor coo = dense.to_sparse();
  const at::Tensor csr = dense.to_sparse_csr();
  EXPECT_EQ(allocated_bytes_of({coo}, c10::kCPU),
            allocated_bytes_of({coo._indices(), coo._values()}, c10::kCPU));
  EXPECT_EQ(allocated_bytes_of({coo}, c10::kCPU), 2 * 4 * 8 + 4 * 4);
  // (Their storages, which torch's conversion may make larger than the parts.)
  EXPECT_EQ(allocated_bytes_of({csr}, c10::kCPU),
            allocated_bytes_of({csr.crow_indices(), csr.col_indices(), csr.values()},
                               c10::kCPU));
  EXPECT_GE(allocated_bytes_of({csr}, c10::kCPU), 5 * 8 + 4 * 8 + 4 * 4);
}

TEST(Memstats, FreesOfEarlierStoragesAreNotCounted) {
  enable();
  Tracker t;
  const int64_t base = t.current();
  g_allocated_before_main.reset();
  EXPECT_EQ(t.current(), base);
  // A storage from the default allocator carries its deleter, not memstats'.
  c10::Storage s(c10::Storage::use_byte_size_t(), 4096, c10::GetDefaultCPUAllocator());
  EXPECT_EQ(detail::header_of(*s.unsafeGetStorageImpl()), nullptr);
  s = c10::Storage();
  EXPECT_EQ(t.current(), base);
}

TEST(Memstats, ResizeCountsTheNewStorage) {
  Tracker t;
  const int64_t base = t.current();
  at::Tensor x = floats(100);
  x.resize_({300});
  EXPECT_EQ(t.current() - base, 1200);
  EXPECT_EQ(t.peak() - base, 400 + 1200);  // old and new storage alive during the copy
}

TEST(Memstats, RawAllocateAndCopyOnWrite) {
  Tracker t;
  const int64_t base = t.current();
  // oneDNN's scratchpads use raw_allocate/raw_deallocate on the CPU allocator.
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(1000);
  EXPECT_EQ(t.current() - base, 1000);
  a->raw_deallocate(p);
  EXPECT_EQ(t.current(), base);
  // Copy-on-write clones need a "simple" DataPtr.
  at::Tensor x = at::arange(100, at::kFloat);
  at::Tensor y = at::_lazy_clone(x);
  EXPECT_EQ(t.current() - base, 400);
  y.add_(1);  // materializes a copy
  EXPECT_EQ(t.current() - base, 800);
  EXPECT_EQ(y[5].item<float>(), 6.0f);
  x.reset();
  y.reset();
  EXPECT_EQ(t.current(), base);
}

TEST(Memstats, NestedTrackersHaveTheirOwnPeaks) {
  Tracker outer;
  const int64_t base = outer.current();
  at::Tensor a = floats(1000);  // +4000
  {
    Tracker inner;
    EXPECT_EQ(inner.peak() - base, 4000);
    at::Tensor b = floats(500);  // +2000
    b.reset();
    EXPECT_EQ(inner.peak() - base, 6000);
    EXPECT_EQ(outer.peak() - base, 6000);
    inner.reset_peak();
    EXPECT_EQ(inner.peak() - base, 4000);
    EXPECT_EQ(outer.peak() - base, 6000);  // untouched by inner's reset
    {
      Tracker innermost;
      at::Tensor c = floats(250);  // +1000
      c.reset();
      EXPECT_EQ(innermost.peak() - base, 5000);
      innermost.reset_peak();
      EXPECT_EQ(innermost.peak() - base, 4000);
    }
    EXPECT_EQ(inner.peak() - base, 5000);
    outer.reset_peak();
    EXPECT_EQ(outer.peak() - base, 4000);
    EXPECT_EQ(inner.peak() - base, 5000);  // untouched by outer's reset
    at::Tensor d = floats(2000);  // +8000
    inner.stop();
    EXPECT_FALSE(inner.running());
    EXPECT_EQ(inner.current() - base, 12000);
    EXPECT_EQ(inner.peak() - base, 12000);
  }
  EXPECT_EQ(outer.current() - base, 4000);
  EXPECT_EQ(outer.peak() - base, 12000);
  EXPECT_GE(max_memory_allocated(), base + 12000);
}

TEST(Memstats, PeakOfTemporariesInsideOneOp) {
  Tracker t;
  const int64_t base = t.current();
  at::Tensor x = at::randn({256, 256});
  {
    Tracker inner;
    at::Tensor y = at::mm(x, x).sum();  // mm's 256x256 result is a temporary
    EXPECT_EQ(inner.current() - base, 256 * 256 * 4 + 4);
    EXPECT_GE(inner.peak() - base, 2 * 256 * 256 * 4);
  }
}

TEST(Memstats, AllocationsInsideParallelForAreCounted) {
  at::set_num_threads(4);
  Tracker t;
  const int64_t base = t.current();
  constexpr int64_t kChunks = 64;
  std::vector<at::Tensor> kept(kChunks);
  std::atomic<int64_t> expected{0};
  std::mutex mutex;
  std::set<std::thread::id> threads;
  at::parallel_for(0, kChunks, 1, [&](int64_t begin, int64_t end) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      threads.insert(std::this_thread::get_id());
    }
    for (int64_t i = begin; i < end; ++i) {
      at::Tensor tmp = floats(1000 + i);  // freed at once
      kept[i] = floats(10 + i);
      expected += 4 * (10 + i);
    }
  });
  // Several threads allocated (this file is compiled with OpenMP where ATen uses it).
  EXPECT_GT(threads.size(), 1u);
  EXPECT_EQ(t.current() - base, expected.load());
  kept.clear();
  EXPECT_EQ(t.current(), base);
}

TEST(Memstats, ManyThreadsAllocatingAndFreeingBalanceExactly) {
  Tracker t;
  const int64_t base = t.current();
  std::vector<std::thread> threads;
  std::vector<at::Tensor> survivors(8);
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([k, &survivors] {
      for (int i = 0; i < 2000; ++i) {
        at::Tensor x = at::empty({(i * 7 + k) % 97 + 1}, at::kFloat);
      }
      survivors[k] = at::empty({k + 1}, at::kDouble);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.current() - base, 8 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8));
  survivors.clear();
  EXPECT_EQ(t.current(), base);
}

TEST(Memstats, KeptBytesFollowAllocationsAcrossThreadsThatExit) {
  Tracker t;
  t.mark("start");
  std::vector<at::Tensor> made(4);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([k, &made] {
      made[k] = at::empty({100 * (k + 1)}, at::kFloat);
      at::Tensor tmp = at::empty({999});
    });
  }
  for (auto& th : threads) th.join();  // their rings are merged as they exit
  EXPECT_EQ(t.mark("made").kept, 4 * 100 * (1 + 2 + 3 + 4));
  // Freed here, allocated there: the phase that made them keeps nothing of them.
  made[0].reset();
  made[3].reset();
  const std::vector<at::Tensor> others = {at::empty({5})};
  Mark m = t.mark("freed");
  EXPECT_EQ(m.kept, 20);
  // Freed by yet another thread.
  std::thread([&made] { made[1].reset(); }).join();
  EXPECT_EQ(t.categories({}, "made").activations, 4 * 100 * 3);
}

TEST(Memstats, BackwardAllocationsAreCounted) {
  constexpr int64_t n = 10000;
  at::Tensor x = at::randn({n}).set_requires_grad(true);
  at::Tensor y = x.mul(x).sum();  // saves x twice (no copy); mul's output dies after sum
  Tracker t;
  const int64_t before = t.current();
  y.backward();
  // What is left is x.grad; backward's temporaries (grad * x twice) are gone.
  EXPECT_EQ(t.current() - before, 4 * n);
  EXPECT_GE(t.peak() - before, 2 * 4 * n);
  EXPECT_NE(detail::header_of(*x.grad().storage().unsafeGetStorageImpl()), nullptr);
  // backward called from another thread too.
  at::Tensor z = x.mul(3).sum();
  std::thread([&] { z.backward(); }).join();
  EXPECT_EQ(t.current() - before, 4 * n + 4);  // z's 4 bytes; the grad accumulated in place
  z.reset();
  EXPECT_EQ(t.current() - before, 4 * n);
}

TEST(Memstats, MarksRecordCurrentPeakAndKept) {
  Tracker t;
  const int64_t base = t.current();
  at::Tensor x = floats(1000);
  Mark a = t.mark("a");
  EXPECT_EQ(a.step, 1);
  EXPECT_EQ(a.current - base, 4000);
  EXPECT_EQ(a.kept, 4000);
  EXPECT_EQ(a.peak - base, 4000);
  at::Tensor tmp = floats(2000);
  tmp.reset();
  at::Tensor y = floats(100);
  x.reset();  // freed, allocated in an earlier phase: not part of this phase's kept bytes
  Mark b = t.mark("b");
  EXPECT_EQ(b.step, 1);
  EXPECT_EQ(b.current - base, 400);
  EXPECT_EQ(b.kept, 400);
  EXPECT_EQ(b.peak - base, 4000 + 8000);
  Mark a2 = t.mark("a");  // the name repeats: step 2
  EXPECT_EQ(a2.step, 2);
  EXPECT_EQ(a2.kept, 0);
  EXPECT_EQ(a2.peak - base, 400);
  EXPECT_EQ(t.marks().size(), 3u);
  // The module-level mark() goes to the innermost running tracker.
  {
    Tracker inner;
    at::Tensor z = floats(10);
    Mark m = mark("inner");
    EXPECT_EQ(m.kept, 40);
    EXPECT_EQ(inner.marks().size(), 1u);
    EXPECT_EQ(t.marks().size(), 3u);
  }
  // The outer tracker's phase spans the inner tracker's epochs.
  at::Tensor w = floats(5);
  Mark b2 = mark("b");
  EXPECT_EQ(b2.step, 2);
  EXPECT_EQ(b2.kept, 20);  // z died with its scope
  EXPECT_EQ(b2.current - base, 420);
}

// The free mark() acts on the innermost tracker of the calling thread: a tracker another
// thread started later (innermost process-wide) is not marked from here.
TEST(Memstats, FreeMarkFindsTheTrackerOfItsOwnThread) {
  Tracker mine;
  std::mutex mu;
  std::condition_variable cv;
  bool other_started = false, marked = false;
  size_t other_marks = 0;
  std::thread other([&] {
    Tracker theirs;  // started after `mine`: the process-wide innermost
    {
      std::unique_lock<std::mutex> lock(mu);
      other_started = true;
      cv.notify_all();
      cv.wait(lock, [&] { return marked; });
    }
    mark("theirs");  // this thread's own tracker
    other_marks = theirs.marks().size();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return other_started; });
  }
  const Mark m = mark("mine");
  EXPECT_EQ(m.name, "mine");
  EXPECT_EQ(mine.marks().size(), 1u);
  {
    std::lock_guard<std::mutex> lock(mu);
    marked = true;
    cv.notify_all();
  }
  other.join();
  EXPECT_EQ(other_marks, 1u);  // only its own mark, not "mine"
  EXPECT_EQ(mine.marks().size(), 1u);
  // A thread that started no tracker has none to mark, whatever other threads run.
  std::thread third([] { expect_error([] { mark("x"); }, "no tracker running on this thread"); });
  third.join();
}

TEST(Memstats, TableCsvAndJson) {
  Tracker t;
  std::vector<at::Tensor> keep;
  // Two steps of data/forw/back with exact sizes; the tracker's baseline is whatever is
  // alive, so compare differences through the bytes table of a fresh layout.
  const int64_t base = t.current();
  keep.push_back(floats(262144));  // 1 MiB
  t.mark("data");
  keep.push_back(floats(524288));  // 2 MiB
  t.mark("forw");
  keep.pop_back();
  t.mark("back");
  keep.push_back(floats(262144));
  t.mark("data");
  t.mark("forw");
  const std::string mib = t.table();
  auto m = [&](double mib_value) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.2f", (base + mib_value * 1048576) / 1048576.0);
    return std::string(buf);
  };
  EXPECT_NE(mib.find("memstats cpu: bytes alive at each mark (MiB)\n"), std::string::npos) << mib;
  EXPECT_NE(mib.find("step 1"), std::string::npos);
  EXPECT_NE(mib.find("step 2"), std::string::npos);
  EXPECT_NE(mib.find(m(1)), std::string::npos) << mib;
  EXPECT_NE(mib.find(m(3)), std::string::npos) << mib;
  EXPECT_NE(mib.find("(peak)"), std::string::npos);
  EXPECT_NE(mib.find("\nback  "), std::string::npos) << mib;
  EXPECT_NE(mib.find("-"), std::string::npos) << mib;  // no "back" in step 2

  TableOptions kept;
  kept.bytes = true;
  kept.value = TableValue::kKept;
  EXPECT_EQ(t.table(kept),
            "memstats cpu: allocated since the previous mark and still alive (bytes)\n"
            "phase   step 1   step 2\n"
            "data   1048576  1048576\n"
            "forw   2097152        0\n"
            "back         0        -\n");

  const std::string csv = t.csv();
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "step,phase,current_bytes,peak_bytes,kept_bytes,reserved_bytes,seconds");
  const std::regex row("2,forw," + std::to_string(base + 2 * 1048576) + "," +
                       std::to_string(base + 2 * 1048576) + ",0," +
                       std::to_string(base + 2 * 1048576) + ",[0-9]+\\.[0-9]{6}\n$");
  EXPECT_TRUE(std::regex_search(csv, row)) << csv;
  const std::string json = t.json();
  EXPECT_EQ(json.rfind("{\"device\": \"cpu\", \"running\": true, ", 0), 0u) << json;
  EXPECT_NE(json.find("{\"step\": 1, \"phase\": \"forw\", \"current\": " +
                      std::to_string(base + 3 * 1048576) + ", \"peak\": " +
                      std::to_string(base + 3 * 1048576) + ", \"kept\": 2097152"),
            std::string::npos)
      << json;
}

TEST(Memstats, CsvAndJsonQuoteNames) {
  Tracker t;
  t.mark("a,b \"q\"");
  EXPECT_NE(t.csv().find(",\"a,b \"\"q\"\"\","), std::string::npos) << t.csv();
  EXPECT_NE(t.json().find("\"phase\": \"a,b \\\"q\\\"\""), std::string::npos) << t.json();
  Tracker empty;
  EXPECT_EQ(empty.table(), "memstats cpu: bytes alive at each mark (MiB)\n(no marks)\n");
}

TEST(Memstats, CategoriesSumToTheTotal) {
  enable();
  // A model: two parameters, one sharing a storage with a view; grads; optimizer state.
  at::Tensor w = at::randn({64, 32}).set_requires_grad(true);
  at::Tensor b = at::zeros({64}).set_requires_grad(true);
  at::Tensor w_view = w.detach().view({-1});
  at::Tensor before = at::ones({10}).set_requires_grad(true);
  // A parameter whose storage came from elsewhere (not in the accounted total).
  c10::Storage foreign(c10::Storage::use_byte_size_t(), 256, c10::GetDefaultCPUAllocator());
  at::Tensor untracked = at::empty({0}).set_(foreign, 0, {64}, {1});
  Tracker t;
  at::Tensor x = at::randn({128, 32});
  t.mark("data");
  at::Tensor h = at::relu(at::linear(x, w, b));  // linear's output dies in relu
  at::Tensor loss = h.sum();
  t.mark("forward");
  loss.backward();
  t.mark("back");
  at::Tensor exp_avg = at::zeros_like(w), step = at::zeros({}, at::kFloat);
  at::Tensor running_mean = at::zeros({16}, at::kDouble);
  Tracker::Tensors tensors;
  tensors.parameters = {w, b, w_view, untracked};
  tensors.buffers = {running_mean};
  tensors.gradients = {w.grad(), b.grad(), at::Tensor()};
  tensors.optimizer_state = {exp_avg, step, w};  // w again: counted once
  Categories c = t.categories(tensors);
  EXPECT_EQ(c.parameters, (64 * 32 + 64) * 4);
  EXPECT_EQ(c.buffers, 16 * 8);
  EXPECT_EQ(c.gradients, (64 * 32 + 64) * 4);
  EXPECT_EQ(c.optimizer_state, 64 * 32 * 4 + 4);
  EXPECT_EQ(c.untracked, 256);
  // Alive from the forward phase: relu's output h (saved for backward, still referenced)
  // and the loss.
  EXPECT_EQ(c.activations, 128 * 64 * 4 + 4);
  EXPECT_EQ(c.allocator_rounding, 0);
  EXPECT_EQ(c.total, t.current());
  EXPECT_EQ(c.parameters + c.buffers + c.gradients + c.optimizer_state + c.activations + c.other,
            c.total);
  // With an explicit forward mark, or the data phase.
  EXPECT_EQ(t.categories(tensors, "forward").activations, c.activations);
  EXPECT_EQ(t.categories(tensors, "data").activations, 128 * 32 * 4);
  // Nothing given: everything is "other" but the forward phase's survivors.
  Categories bare = t.categories({});
  EXPECT_EQ(bare.activations + bare.other, bare.total);
  const std::string s = c.str(/*bytes=*/true);
  EXPECT_NE(s.find("parameters"), std::string::npos);
  EXPECT_NE(s.find("untracked (not in total)"), std::string::npos);
  EXPECT_NE(s.find(std::to_string(c.total) + " B\n"), std::string::npos) << s;
  EXPECT_NE(c.json().find("\"parameters\": " + std::to_string(c.parameters)), std::string::npos);
  expect_error([&] { t.categories(tensors, "nope"); }, "no mark with that name");
}

// A sparse tensor (COO, CSR: an optimizer's state for a sparse gradient) has no storage of its
// own: categories count its indices and values, as allocated_bytes_of does.
TEST(Memstats, CategoriesCountASparseTensorByItsParts) {
  enable();
  Tracker t;
  const at::Tensor coo = at::eye(8, at::kFloat).to_sparse();
  const at::Tensor csr = at::eye(8, at::kDouble).to_sparse_csr();
  Tracker::Tensors tensors;
  tensors.gradients = {coo};
  tensors.optimizer_state = {csr};
  const Categories c = t.categories(tensors);
  EXPECT_EQ(c.gradients, 2 * 8 * 8 + 8 * 4);
  EXPECT_EQ(c.gradients, allocated_bytes_of({coo}, c10::kCPU));
  EXPECT_EQ(c.optimizer_state, allocated_bytes_of({csr}, c10::kCPU));
  EXPECT_GE(c.optimizer_state, 9 * 8 + 8 * 8 + 8 * 8);
  EXPECT_EQ(c.untracked, 0);
}

TEST(Memstats, Errors) {
  expect_error([] { mark("forward"); }, "mark(\"forward\") with no tracker running");
  expect_error([] { Tracker t("meta"); }, "device must be 'cpu' or 'cuda[:index]', got 'meta'");
  expect_error([] { Tracker t("not a device"); },
               "device must be 'cpu' or 'cuda[:index]', got 'not a device'");
  expect_error([] { Tracker t("cpu:1"); }, "got 'cpu:1'");
  expect_error([] { Tracker t("cuda"); }, "device 'cuda' was asked for, but CUDA is not available");
  expect_error([] { Tracker t(c10::Device(c10::DeviceType::CUDA, 0)); },
               "CUDA is not available");
  expect_error([] { memory_allocated(c10::Device(c10::DeviceType::XPU)); },
               "device must be 'cpu' or 'cuda[:index]', got 'xpu'");
  Tracker t;
  expect_error([&] { t.mark(""); }, "mark name must not be empty");
  expect_error([&] { t.mark("two\nlines"); }, "mark name must be one line of printable text");
  expect_error([] { parse_table_value("max"); },
               "table value must be 'current', 'peak', 'kept' or 'reserved', got 'max'");
  EXPECT_EQ(parse_table_value("kept"), TableValue::kKept);
  t.stop();
  t.stop();  // idempotent
  expect_error([&] { t.mark("x"); }, "mark(\"x\") on a stopped tracker");
  expect_error([&] { t.reset_peak(); }, "reset_peak() on a stopped tracker");
  expect_error([] { mark("x"); }, "no tracker running");
  EXPECT_EQ(parse_device("cpu"), c10::Device(c10::DeviceType::CPU));
  EXPECT_EQ(parse_device("cpu:0"), c10::Device(c10::DeviceType::CPU));
}

}  // namespace
}  // namespace memlean::memstats
