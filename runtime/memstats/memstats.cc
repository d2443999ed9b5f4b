// Trackers, phases and categories on top of the per-device counters (cpu_accounting.cc for
// the CPU, the caching allocator's statistics and cuda_peaks.cc for CUDA).
//
// Scoped peaks: every device has one "epoch peak", the largest current value since the last
// epoch change (the CPU counter's own, or the peak cuda_peaks.cc observes: torch's own peak
// counters are never reset).
// Each tracker holds watches; a watch's peak is max(folded, epoch peak, current). Starting a
// watch (tracker start, reset_peak, mark) ends the device's epoch under the registry lock and
// folds that epoch's peak into every other watch of the device, so nested trackers keep
// exact, independent peaks while the allocation path touches only the global counters.
#include "runtime/memstats/memstats.h"

#include <ATen/Context.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "runtime/memstats/internal/cpu_accounting.h"
#include "runtime/memstats/internal/cuda_peaks.h"
#include "runtime/memstats/report.h"

namespace memlean::memstats {

namespace {

using detail::g_current;
using detail::g_epoch;
using detail::g_epoch_peak;

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

struct CudaFigures {
  int64_t allocated = 0, reserved = 0, requested = 0;
};

c10::DeviceAllocator* cuda_allocator() {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA);
}

CudaFigures cuda_figures(c10::DeviceIndex index) {
  // Before anything has initialised CUDA's allocator nothing is allocated, and asking it
  // for statistics raises ("did you call init?"): 0, as torch.cuda.memory_allocated() says.
  c10::DeviceAllocator* allocator = cuda_allocator();
  if (!allocator->initialized()) return {};
  const auto stats = allocator->getDeviceStats(index);
  return {stats.allocated_bytes[kAggregate].current, stats.reserved_bytes[kAggregate].current,
          stats.requested_bytes[kAggregate].current};
}

// "cpu" (no index) or "cuda:<index>".
c10::Device canonical(c10::Device d) {
  if (d.is_cpu()) return c10::Device(c10::DeviceType::CPU);
  if (d.is_cuda() && !d.has_index()) {
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
  }
  return d;
}

int64_t device_current(c10::Device d) {
  return d.is_cpu() ? g_current.load(std::memory_order_relaxed) : cuda_figures(d.index()).allocated;
}

int64_t device_epoch_peak(c10::Device d) {
  return d.is_cpu() ? g_epoch_peak.load(std::memory_order_relaxed)
                    : detail::cuda_peaks().epoch_peak(d.index());
}

int64_t device_reserved(c10::Device d) {
  return d.is_cpu() ? g_current.load(std::memory_order_relaxed) : cuda_figures(d.index()).reserved;
}

struct Watch {
  c10::Device device;
  int64_t folded = 0;
};

struct Registry {
  std::mutex mu;
  std::vector<Watch*> watches;             // every watch of every running tracker + process
  std::vector<detail::TrackerState*> running;     // in start order
  std::vector<std::unique_ptr<Watch>> process;  // one per device, process-wide peaks
};

// Leaked on purpose: trackers destroyed during exit still find it.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// The process-wide watch of a device, created on first use (caller holds mu).
Watch& process_watch(Registry& r, c10::Device d) {
  for (auto& w : r.process) {
    if (w->device == d) return *w;
  }
  r.process.push_back(std::make_unique<Watch>(Watch{d, 0}));
  r.watches.push_back(r.process.back().get());
  return *r.process.back();
}

// Ends the device's epoch and folds its peak into every watch of the device (holds mu).
void new_epoch(Registry& r, c10::Device d) {
  process_watch(r, d);
  int64_t peak = 0;
  if (d.is_cpu()) {
    peak = detail::advance_epoch();
  } else {
    peak = detail::cuda_peaks().new_epoch(d.index());
  }
  for (Watch* w : r.watches) {
    if (w->device == d) w->folded = std::max(w->folded, peak);
  }
}

int64_t watch_peak(const Watch& w) {
  return std::max({w.folded, device_epoch_peak(w.device), device_current(w.device)});
}

void check_mark_name(const std::string& name) {
  TORCH_CHECK_VALUE(!name.empty(), "memstats: mark name must not be empty");
  for (unsigned char c : name) {
    TORCH_CHECK_VALUE(c >= 0x20 && c != 0x7f,
                      "memstats: mark name must be one line of printable text, got \"", name,
                      "\"");
  }
}

std::string format_mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

std::string format_value(int64_t v, bool bytes) {
  if (v < 0) return "-";
  return bytes ? std::to_string(v) : format_mib(v);
}

}  // namespace

struct detail::TrackerState {
  c10::Device device{c10::DeviceType::CPU};
  Watch total{c10::Device(c10::DeviceType::CPU)};
  Watch phase{c10::Device(c10::DeviceType::CPU)};
  bool running = false;
  uint32_t phase_first_epoch = 0;
  std::thread::id thread;  // the thread that started it (the free mark() finds it by this)
  std::vector<Mark> marks;
  std::vector<std::pair<uint32_t, uint32_t>> mark_epochs;  // [first, last] of each phase
  std::vector<std::string> step_names;                     // names seen in the current step
  int64_t step = 1;
  int64_t final_current = 0, final_peak = 0, final_reserved = 0;
  std::chrono::steady_clock::time_point t0;
};

namespace {

// Records a mark on a running tracker (holds mu).
Mark mark_locked(Registry& r, detail::TrackerState& t, const std::string& name) {
  TORCH_CHECK(t.running, "memstats: mark(\"", name, "\") on a stopped tracker");
  const c10::Device d = t.device;
  Mark m;
  m.name = name;
  m.current = device_current(d);
  m.peak = watch_peak(t.phase);
  m.reserved = device_reserved(d);
  const uint32_t last = g_epoch.load(std::memory_order_acquire);
  m.kept = d.is_cpu() ? detail::live_bytes_in_epochs(t.phase_first_epoch, last) : -1;
  m.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t.t0).count();
  if (std::find(t.step_names.begin(), t.step_names.end(), name) != t.step_names.end()) {
    ++t.step;
    t.step_names.clear();
  }
  t.step_names.push_back(name);
  m.step = t.step;
  t.marks.push_back(m);
  t.mark_epochs.emplace_back(t.phase_first_epoch, last);
  new_epoch(r, d);
  t.phase.folded = device_current(d);
  t.phase_first_epoch = g_epoch.load(std::memory_order_acquire);
  return m;
}

}  // namespace

void enable() { detail::install(); }

bool enabled() {
  c10::Allocator* counting = detail::counting_allocator();
  return counting != nullptr && c10::GetCPUAllocator() == counting;
}

void check_device(c10::Device device) {
  if (device.is_cpu()) {
    TORCH_CHECK_VALUE(!device.has_index() || device.index() == 0,
                      "memstats: device must be 'cpu' or 'cuda[:index]', got '", device.str(),
                      "'");
    return;
  }
  TORCH_CHECK_VALUE(device.is_cuda(), "memstats: device must be 'cpu' or 'cuda[:index]', got '",
                    device.str(), "'");
  TORCH_CHECK(at::hasCUDA(), "memstats: device '", device.str(),
              "' was asked for, but CUDA is not available here (torch without CUDA, "
              "libtorch_cuda not loaded, or no GPU visible)");
  const auto count = static_cast<int64_t>(at::getNumGPUs());
  TORCH_CHECK_VALUE(!device.has_index() || device.index() < count, "memstats: device '",
                    device.str(), "' is out of range: there are ", count, " CUDA devices");
}

c10::Device parse_device(const std::string& device) {
  std::optional<c10::Device> d;
  try {
    d.emplace(device);
  } catch (const c10::Error&) {
  }
  TORCH_CHECK_VALUE(d.has_value(), "memstats: device must be 'cpu' or 'cuda[:index]', got '",
                    device, "'");
  check_device(*d);
  return canonical(*d);
}

int64_t memory_allocated(c10::Device device) {
  check_device(device);
  device = canonical(device);
  if (device.is_cpu()) enable();
  return device_current(device);
}

int64_t max_memory_allocated(c10::Device device) {
  check_device(device);
  device = canonical(device);
  if (device.is_cpu()) enable();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return watch_peak(process_watch(r, device));
}

int64_t memory_reserved(c10::Device device) {
  check_device(device);
  device = canonical(device);
  if (device.is_cpu()) enable();
  return device_reserved(device);
}

namespace {

// The tensors whose storages hold t: a sparse tensor's indices and values (it has no storage
// of its own; e.g. SGD's momentum for a sparse gradient), else t.
void add_storage_parts(std::vector<at::Tensor>& parts, const at::Tensor& t) {
  switch (t.layout()) {
    case c10::kSparse:
      parts.push_back(t._indices());
      parts.push_back(t._values());
      return;
    case c10::kSparseCsr:
    case c10::kSparseBsr:
      parts.push_back(t.crow_indices());
      parts.push_back(t.col_indices());
      parts.push_back(t.values());
      return;
    case c10::kSparseCsc:
    case c10::kSparseBsc:
      parts.push_back(t.ccol_indices());
      parts.push_back(t.row_indices());
      parts.push_back(t.values());
      return;
    default:
      parts.push_back(t);
  }
}

}  // namespace

int64_t allocated_bytes_of(const std::vector<at::Tensor>& tensors, c10::Device device) {
  check_device(device);
  device = canonical(device);
  std::vector<at::Tensor> parts;
  for (const auto& t : tensors) {
    if (t.defined()) add_storage_parts(parts, t);
  }
  std::unordered_set<const void*> seen;
  std::vector<std::pair<uintptr_t, int64_t>> storages;
  int64_t total = 0;
  for (const auto& t : parts) {
    if (!t.has_storage() || canonical(t.device()) != device) continue;
    const c10::Storage& storage = t.storage();
    const auto nbytes = static_cast<int64_t>(storage.nbytes());
    if (nbytes == 0 || !seen.insert(storage.unsafeGetStorageImpl()).second) continue;
    if (device.is_cpu()) {
      total += nbytes;
    } else {
      storages.emplace_back(reinterpret_cast<uintptr_t>(storage.data()), nbytes);
    }
  }
  if (!storages.empty()) total += detail::cuda_peaks().block_bytes(device.index(), storages);
  return total;
}

Tracker::Tracker(const std::string& device) : Tracker(parse_device(device)) {}

Tracker::Tracker(c10::Device device) : impl_(std::make_unique<detail::TrackerState>()) {
  check_device(device);
  device = canonical(device);
  if (device.is_cpu()) enable();
  detail::TrackerState& t = *impl_;
  t.device = device;
  t.total.device = device;
  t.phase.device = device;
  t.t0 = std::chrono::steady_clock::now();
  t.thread = std::this_thread::get_id();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  new_epoch(r, device);
  t.total.folded = t.phase.folded = device_current(device);
  t.phase_first_epoch = g_epoch.load(std::memory_order_acquire);
  r.watches.push_back(&t.total);
  r.watches.push_back(&t.phase);
  r.running.push_back(&t);
  t.running = true;
}

Tracker::~Tracker() {
  try {
    stop();
  } catch (...) {
    // stop() unregisters before anything that can throw; the figures are lost, not the
    // registry's consistency.
  }
}

c10::Device Tracker::device() const { return impl_->device; }

bool Tracker::running() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return impl_->running;
}

int64_t Tracker::current() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return impl_->running ? device_current(impl_->device) : impl_->final_current;
}

int64_t Tracker::peak() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return impl_->running ? watch_peak(impl_->total) : impl_->final_peak;
}

int64_t Tracker::reserved() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return impl_->running ? device_reserved(impl_->device) : impl_->final_reserved;
}

void Tracker::reset_peak() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(impl_->running, "memstats: reset_peak() on a stopped tracker");
  new_epoch(r, impl_->device);
  impl_->total.folded = device_current(impl_->device);
}

Mark Tracker::mark(const std::string& name) {
  check_mark_name(name);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return mark_locked(r, *impl_, name);
}

std::vector<Mark> Tracker::marks() const {
  std::lock_guard<std::mutex> lock(registry().mu);
  return impl_->marks;
}

void Tracker::stop() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  detail::TrackerState& t = *impl_;
  if (!t.running) return;
  t.running = false;
  int64_t current = 0, peak = 0, reserved = 0;
  bool figures = false;
  try {
    current = device_current(t.device);
    peak = watch_peak(t.total);
    reserved = device_reserved(t.device);
    figures = true;
  } catch (...) {
  }
  auto& w = r.watches;
  w.erase(std::remove_if(w.begin(), w.end(),
                         [&](Watch* x) { return x == &t.total || x == &t.phase; }),
          w.end());
  r.running.erase(std::remove(r.running.begin(), r.running.end(), &t), r.running.end());
  TORCH_CHECK(figures, "memstats: could not read the figures of ", t.device.str(),
              " when the tracker stopped");
  t.final_current = current;
  t.final_peak = peak;
  t.final_reserved = reserved;
}

Mark mark(const std::string& name) {
  check_mark_name(name);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // The innermost tracker this thread started: a tracker another thread runs (a data
  // loader's, a second training loop's) is never marked from here.
  const auto self = std::this_thread::get_id();
  const auto it = std::find_if(r.running.rbegin(), r.running.rend(),
                               [&](const detail::TrackerState* t) { return t->thread == self; });
  TORCH_CHECK(it != r.running.rend(), "memstats: mark(\"", name,
              "\") with no tracker running on this thread; start one first "
              "(memstats::Tracker in C++, `with memlean.memstats.track():` in Python), or "
              "mark another thread's tracker through its handle (Tracker::mark)");
  return mark_locked(r, **it, name);
}

TableValue parse_table_value(const std::string& value) {
  if (value == "current") return TableValue::kCurrent;
  if (value == "peak") return TableValue::kPeak;
  if (value == "kept") return TableValue::kKept;
  TORCH_CHECK_VALUE(value == "reserved",
                    "memstats: table value must be 'current', 'peak', 'kept' or 'reserved', got '",
                    value, "'");
  return TableValue::kReserved;
}

std::string Tracker::table(const TableOptions& options) const {
  const TableValue value = options.value;
  const std::vector<Mark> marks = this->marks();
  const char* what = value == TableValue::kCurrent ? "bytes alive at each mark"
                     : value == TableValue::kPeak  ? "peak since the previous mark"
                     : value == TableValue::kKept
                         ? "allocated since the previous mark and still alive"
                         : "reserved at each mark";
  std::ostringstream out;
  out << "memstats " << impl_->device.str() << ": " << what << " ("
      << (options.bytes ? "bytes" : "MiB") << ")\n";
  if (marks.empty()) {
    out << "(no marks)\n";
    return out.str();
  }
  std::vector<std::string> rows;
  int64_t steps = 0;
  for (const Mark& m : marks) {
    if (std::find(rows.begin(), rows.end(), m.name) == rows.end()) rows.push_back(m.name);
    steps = std::max(steps, m.step);
  }
  const bool peak_row = value == TableValue::kCurrent;
  // cells[row][step - 1]; the last row is the step's peak when peak_row.
  const size_t nrows = rows.size() + (peak_row ? 1 : 0);
  std::vector<std::vector<std::string>> cells(nrows, std::vector<std::string>(steps, "-"));
  std::vector<int64_t> step_peak(steps, -1);
  for (const Mark& m : marks) {
    const size_t row = std::find(rows.begin(), rows.end(), m.name) - rows.begin();
    const int64_t v = value == TableValue::kCurrent ? m.current
                      : value == TableValue::kPeak  ? m.peak
                      : value == TableValue::kKept  ? m.kept
                                                    : m.reserved;
    cells[row][m.step - 1] = format_value(v, options.bytes);
    step_peak[m.step - 1] = std::max({step_peak[m.step - 1], m.peak, m.current});
  }
  std::vector<std::string> labels = rows;
  if (peak_row) {
    labels.push_back("(peak)");
    for (int64_t s = 0; s < steps; ++s) cells.back()[s] = format_value(step_peak[s], options.bytes);
  }
  size_t label_width = std::string("phase").size();
  for (const auto& l : labels) label_width = std::max(label_width, l.size());
  std::vector<size_t> widths(steps);
  for (int64_t s = 0; s < steps; ++s) {
    widths[s] = ("step " + std::to_string(s + 1)).size();
    for (size_t row = 0; row < nrows; ++row) widths[s] = std::max(widths[s], cells[row][s].size());
  }
  auto pad_left = [](const std::string& s, size_t w) { return std::string(w - s.size(), ' ') + s; };
  auto pad_right = [](const std::string& s, size_t w) { return s + std::string(w - s.size(), ' '); };
  out << pad_right("phase", label_width);
  for (int64_t s = 0; s < steps; ++s) out << "  " << pad_left("step " + std::to_string(s + 1), widths[s]);
  out << "\n";
  for (size_t row = 0; row < nrows; ++row) {
    out << pad_right(labels[row], label_width);
    for (int64_t s = 0; s < steps; ++s) out << "  " << pad_left(cells[row][s], widths[s]);
    out << "\n";
  }
  return out.str();
}

std::string Tracker::csv() const {
  std::ostringstream out;
  out << "step,phase,current_bytes,peak_bytes,kept_bytes,reserved_bytes,seconds\n";
  char secs[32];
  for (const Mark& m : marks()) {
    std::snprintf(secs, sizeof(secs), "%.6f", m.seconds);
    out << m.step << "," << csv_field(m.name) << "," << m.current << "," << m.peak << ","
        << (m.kept < 0 ? "" : std::to_string(m.kept)) << "," << m.reserved << "," << secs
        << "\n";
  }
  return out.str();
}

std::string Tracker::json() const {
  const bool is_running = running();
  std::ostringstream out;
  out << "{\"device\": " << json_string(impl_->device.str())
      << ", \"running\": " << (is_running ? "true" : "false") << ", \"current\": " << current()
      << ", \"peak\": " << peak() << ", \"reserved\": " << reserved() << ", \"marks\": [";
  char secs[32];
  const std::vector<Mark> marks = this->marks();
  for (size_t i = 0; i < marks.size(); ++i) {
    const Mark& m = marks[i];
    std::snprintf(secs, sizeof(secs), "%.6f", m.seconds);
    out << (i ? ", " : "") << "{\"step\": " << m.step << ", \"phase\": " << json_string(m.name)
        << ", \"current\": " << m.current << ", \"peak\": " << m.peak
        << ", \"kept\": " << (m.kept < 0 ? "null" : std::to_string(m.kept))
        << ", \"reserved\": " << m.reserved << ", \"seconds\": " << secs << "}";
  }
  out << "]}";
  return out.str();
}

Categories Tracker::categories(const Tensors& tensors, const std::string& forward_mark) const {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const detail::TrackerState& t = *impl_;
  const c10::Device d = t.device;

  // The epochs of the forward phase, if any.
  bool have_forward = false;
  std::pair<uint32_t, uint32_t> fwd{0, 0};
  for (size_t i = t.marks.size(); i-- > 0;) {
    const std::string& n = t.marks[i].name;
    if (forward_mark.empty() ? (n == "forward" || n == "forw") : n == forward_mark) {
      have_forward = true;
      fwd = t.mark_epochs[i];
      break;
    }
  }
  TORCH_CHECK_VALUE(have_forward || forward_mark.empty(), "memstats: categories(forward_mark=\"",
                    forward_mark, "\"): this tracker has no mark with that name");
  auto in_forward = [&](uint32_t e) { return have_forward && e - fwd.first <= fwd.second - fwd.first; };

  Categories c;
  int64_t forward_categorized = 0;
  std::unordered_set<const c10::StorageImpl*> seen;
  std::function<void(const at::Tensor&, int64_t&)> add_tensor = [&](const at::Tensor& x,
                                                                     int64_t& bucket) {
    if (!x.defined()) return;
    if (x.layout() != c10::kStrided) {  // a sparse tensor: its parts (add_storage_parts)
      std::vector<at::Tensor> parts;
      add_storage_parts(parts, x);
      if (parts.size() > 1) {
        for (const auto& part : parts) add_tensor(part, bucket);
        return;
      }
    }
    if (!x.has_storage() || canonical(x.device()) != d) return;
    const c10::StorageImpl* s = x.storage().unsafeGetStorageImpl();
    if (!seen.insert(s).second) return;
    if (d.is_cpu()) {
      const detail::Header* h = detail::header_of(*s);
      if (h == nullptr) {
        c.untracked += static_cast<int64_t>(s->nbytes());
        return;
      }
      bucket += static_cast<int64_t>(h->nbytes);
      if (in_forward(h->epoch)) forward_categorized += static_cast<int64_t>(h->nbytes);
    } else {
      bucket += static_cast<int64_t>(s->nbytes());
    }
  };
  for (const auto& x : tensors.parameters) add_tensor(x, c.parameters);
  for (const auto& x : tensors.buffers) add_tensor(x, c.buffers);
  for (const auto& x : tensors.gradients) add_tensor(x, c.gradients);
  for (const auto& x : tensors.optimizer_state) add_tensor(x, c.optimizer_state);

  if (d.is_cpu()) {
    c.total = device_current(d);
    if (have_forward) {
      const int64_t live = detail::live_bytes_in_epochs(fwd.first, fwd.second);
      TORCH_CHECK(live >= 0, "memstats: categories(): the forward phase began more than ",
                  detail::kRing, " epochs (marks and peak resets) ago; ask in the same step");
      c.activations = live - forward_categorized;
    }
  } else {
    const CudaFigures f = cuda_figures(d.index());
    c.total = f.allocated;
    c.allocator_rounding = f.allocated - f.requested;
  }
  c.other = c.total - c.parameters - c.buffers - c.gradients - c.optimizer_state - c.activations -
            c.allocator_rounding;
  return c;
}

std::string Categories::str(bool bytes) const {
  std::vector<std::pair<std::string, int64_t>> rows = {
      {"parameters", parameters},           {"buffers", buffers},
      {"gradients", gradients},             {"optimizer state", optimizer_state},
      {"activations", activations},         {"other", other}};
  if (allocator_rounding != 0) rows.emplace_back("allocator rounding", allocator_rounding);
  rows.emplace_back("total", total);
  if (untracked != 0) rows.emplace_back("untracked (not in total)", untracked);
  auto fmt = [&](int64_t v) { return bytes ? std::to_string(v) : format_mib(v); };
  size_t lw = 0, vw = 0;
  for (const auto& [k, v] : rows) {
    lw = std::max(lw, k.size());
    vw = std::max(vw, fmt(v).size());
  }
  std::ostringstream out;
  for (const auto& [k, v] : rows) {
    const std::string s = fmt(v);
    out << k << std::string(lw - k.size() + 2 + vw - s.size(), ' ') << s
        << (bytes ? " B" : " MiB") << "\n";
  }
  return out.str();
}

std::string Categories::json() const {
  std::ostringstream out;
  out << "{\"parameters\": " << parameters << ", \"buffers\": " << buffers
      << ", \"gradients\": " << gradients
      << ", \"optimizer_state\": " << optimizer_state << ", \"activations\": " << activations
      << ", \"other\": " << other << ", \"allocator_rounding\": " << allocator_rounding
      << ", \"total\": " << total << ", \"untracked\": " << untracked << "}";
  return out.str();
}

}  // namespace memlean::memstats
