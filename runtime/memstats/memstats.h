// memlean::memstats: exact accounting of tensor memory per device, scoped peaks that nest,
// phases (the Swish blog post's data/forw/loss/back/step table, docs/sources.md), categories,
// and text/CSV/JSON reports.
//
// CPU: a counting allocator wraps the CPU allocator (installed once with
// c10::SetCPUAllocator by enable(); every Tracker on the CPU enables it). It counts, to the
// byte, every storage allocated through c10::GetCPUAllocator() after that moment by any
// thread, and the frees of exactly those storages. Storages allocated before enable() are
// not counted, nor are their frees; pinned host memory (CUDA's host allocator) is not CPU
// memory here.
// CUDA: the caching allocator's device statistics (allocated bytes, current and peak, and
// reserved bytes), through c10's generic DeviceAllocator interface, so this library does not
// link libtorch_cuda: a process that uses CUDA loads it anyway.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace memlean::memstats {

// Installs the counting CPU allocator (idempotent, thread-safe). Call it before building
// the model to have parameters counted.
void enable();
// Whether the counting allocator is the current CPU allocator.
bool enabled();

// "cpu", "cuda", "cuda:1" → a device memstats can account; a clear error naming `device`
// otherwise (unknown device type, CUDA asked without CUDA, device index out of range).
c10::Device parse_device(const std::string& device);
// The same checks for a c10::Device.
void check_device(c10::Device device);

// Process-wide figures, named after torch.cuda's:
// CPU: bytes alive that the counting allocator allocated (enables it); CUDA: allocated bytes.
int64_t memory_allocated(c10::Device device = c10::kCPU);
// The largest memory_allocated since accounting began (CPU) or since the process began
// (CUDA: torch's own peak when memstats first observes the device, then what it observes; a
// later torch.cuda.reset_peak_memory_stats does not lower it). Trackers never lower it.
int64_t max_memory_allocated(c10::Device device = c10::kCPU);
// CPU: the same as memory_allocated (no cache); CUDA: bytes reserved by the caching allocator.
int64_t memory_reserved(c10::Device device = c10::kCPU);

// What memory_allocated(device) counts for the storages of `tensors` that lie on `device`, each
// storage once (views and tensors sharing a storage count it once): on the CPU the storages'
// bytes; on CUDA the caching allocator's block of each (its request rounded up to 512 bytes, or
// more where a cached block was not split), read from the allocator's snapshot, and a storage
// the allocator did not make (from_blob) its own bytes. A sparse tensor (COO, CSR, CSC, BSR,
// BSC) counts its indices and values. Undefined tensors, tensors on other devices and other
// tensors without a storage (nested: pass their parts) count nothing.
// For budgets that hold what stays resident (parameters, optimizer state) to the same count as
// a step's peak above it.
int64_t allocated_bytes_of(const std::vector<at::Tensor>& tensors, c10::Device device);

// What one mark() recorded.
struct Mark {
  std::string name;
  int64_t step = 1;      // 1-based column: a new step starts when a name repeats in a step
  int64_t current = 0;   // bytes alive at the mark
  int64_t peak = 0;      // the largest number of bytes alive since the previous mark (or start)
  int64_t kept = -1;     // bytes allocated since the previous mark and still alive at this
                         // one (after "forward": the activations kept for backward);
                         // -1 where unknown (CUDA)
  int64_t reserved = 0;  // CUDA: reserved bytes; CPU: = current
  double seconds = 0;    // since the tracker started
};

// The live bytes of a device split into parts that sum to `total`, to the byte.
struct Categories {
  int64_t parameters = 0;
  int64_t buffers = 0;  // module state that is not a parameter (BatchNorm running stats)
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  // Bytes allocated during the latest forward phase (see Tracker::categories) still alive
  // now, other than parameters, gradients and optimizer state. 0 on CUDA.
  int64_t activations = 0;
  int64_t other = 0;               // everything else: inputs, outputs, temporaries
  int64_t allocator_rounding = 0;  // CUDA: allocated - requested bytes (block rounding); CPU: 0
  int64_t total = 0;               // memory_allocated(device) when computed
  // Bytes of the given tensors that are outside `total` (CPU: allocated before enable()).
  int64_t untracked = 0;

  // Aligned text, MiB with two decimals (bytes = true: exact bytes).
  std::string str(bool bytes = false) const;
  std::string json() const;
};

// What a Tracker::table cell shows for each mark.
enum class TableValue {
  kCurrent,   // bytes alive at the mark (plus a "(peak)" row: each step's peak)
  kPeak,      // the peak since the previous mark
  kKept,      // allocated since the previous mark and still alive (CPU only)
  kReserved,  // bytes reserved at the mark
};

// "current", "peak", "kept" or "reserved" (as Python's Tracker.table(value=...) takes them);
// anything else is a ValueError naming the value.
TableValue parse_table_value(const std::string& value);

struct TableOptions {
  bool bytes = false;                         // exact bytes instead of MiB with two decimals
  TableValue value = TableValue::kCurrent;
};

// A scoped view of one device's memory. Starting (construction) and reset_peak() begin its
// own peak; trackers nest and never disturb each other's peaks, on any thread. Nor torch's:
// on CUDA, memstats observes the caching allocator (a trace tracker, attached once per
// process on first CUDA use) and never resets its counters, so
// torch.cuda.max_memory_allocated() reads the same with or without trackers. The
// cudaMallocAsync backend cannot be observed: CUDA trackers fail there with a clear error.
namespace detail {
struct TrackerState;  // memstats.cc
}  // namespace detail

class Tracker {
 public:
  explicit Tracker(c10::Device device = c10::kCPU);
  explicit Tracker(const std::string& device);
  ~Tracker();
  Tracker(const Tracker&) = delete;
  Tracker& operator=(const Tracker&) = delete;

  c10::Device device() const;
  bool running() const;
  // Bytes alive on the device now (memory_allocated); after stop(), the value at stop().
  int64_t current() const;
  // The largest current() since start or the last reset_peak(); frozen by stop().
  int64_t peak() const;
  int64_t reserved() const;
  void reset_peak();
  // Ends the phase that began at the previous mark (or start) and records it under `name`.
  Mark mark(const std::string& name);
  std::vector<Mark> marks() const;
  void stop();

  // Rows = phase names (first-seen order), columns = steps, as in the Swish post's phase table.
  std::string table(const TableOptions& options = {}) const;
  // One row per mark: step,phase,current_bytes,peak_bytes,kept_bytes,reserved_bytes.
  std::string csv() const;
  // {"device", "running", "current", "peak", "reserved", "marks": [...]}.
  std::string json() const;

  // Splits the live bytes of this tracker's device into categories. Each storage is counted
  // once (the first list that holds it wins: parameters, buffers, gradients, optimizer state);
  // undefined tensors and tensors on other devices are skipped; a sparse tensor counts as its
  // indices and values (as allocated_bytes_of). Activations come from the
  // latest mark named `forward_mark` ("" = the latest "forward" or "forw" mark; none: 0).
  struct Tensors {
    std::vector<at::Tensor> parameters, buffers, gradients, optimizer_state;
  };
  Categories categories(const Tensors& tensors, const std::string& forward_mark = "") const;

 private:
  std::unique_ptr<detail::TrackerState> impl_;
};

// Marks the innermost running tracker of this thread (the one this thread started last); an
// error when this thread runs none. Another thread's tracker: mark it through its handle.
Mark mark(const std::string& name);

}  // namespace memlean::memstats
