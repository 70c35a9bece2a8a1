// offload-ref's simulated accelerator: a second torch device on a CPU-only machine.
//
// Note [Simulated accelerator]
//   The device registers on torch's in-tree HPU dispatch key (PrivateUse1 cannot take
//   `param.data = device_tensor`, and `Module.to(device)` would replace Parameters there; see
//   docs/simulated-accelerator.md).  Device memory is ordinary host memory, 256-byte aligned,
//   from an allocator that keeps per-device statistics (torch.accelerator.memory_allocated reads
//   them) and an optional capacity (an out-of-memory error like CUDA's).  Every op runs CPU's own
//   kernel on the same bytes: a boxed fallback checks that every tensor argument is on one
//   device (CUDA's rules: 0-dim host tensors are allowed, and host indices for index ops), views
//   each device tensor as a CPU tensor over the same memory, redispatches to CPU, and maps the
//   results back (a mutated argument returns itself, a view becomes a device view of the same
//   storage, a fresh result is copied once into device memory so the allocator counts it).  So
//   outputs are bit-exact to CPU and a host tensor meeting a device tensor raises torch's
//   same-device error, as on a GPU.  Streams are synchronous: an event is complete when recorded.
//   The device generator is a CPU generator seeded from a mix of the seed, so a generator made
//   on the wrong device changes the numbers, as on CUDA.
//
//   Nothing registers at load: `init()` refuses when a real backend owns the HPU key.

#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/HPUHooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_copy_from_and_resize_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_to_copy_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace simdev {

constexpr c10::DeviceType kDev = c10::DeviceType::HPU;
constexpr c10::DispatchKey kKey = c10::DispatchKey::HPU;
constexpr size_t kAlignment = 256;
constexpr int kMaxDevices = 8;

std::atomic<int> g_device_count{2};
std::atomic<bool> g_initialized{false};

std::string describe(c10::DeviceIndex index) {
  std::ostringstream out;
  out << "hpu:" << static_cast<int>(index) << " (offload-ref's simulated accelerator)";
  return out.str();
}

// -- crash record -----------------------------------------------------------------------------------
//
// Note [Crash record]
//   Each thread keeps the name of the hpu op it is running (two pointers into the op's schema,
//   which lives as long as the registration: no string is built per op).  A fatal signal
//   (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) runs a handler, installed by init(), that writes one
//   line naming the signal and that op to fd 2 and to the file named by OFFLOAD_REF_SIM_CRASH_FILE
//   (opened by init(), appended to), with async-signal-safe calls only, then gives the signal to
//   the handler that was installed before (Python's faulthandler prints the Python stack) or to
//   the default action, so the process still dies of the signal.  Every thread that runs an hpu op
//   gets an alternate signal stack, so a stack overflow inside an op is recorded too.

struct RunningOp {
  const char* name = nullptr;      // e.g. "aten::mul"
  const char* overload = nullptr;  // e.g. "Tensor" (may be empty)
};

thread_local RunningOp tls_running_op;

struct AltStack {
  void* memory = nullptr;
  AltStack() {
    stack_t current{};
    if (sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE)) {
      const size_t size = 64 * 1024;
      memory = std::malloc(size);
      if (memory != nullptr) {
        stack_t fresh{};
        fresh.ss_sp = memory;
        fresh.ss_size = size;
        fresh.ss_flags = 0;
        if (sigaltstack(&fresh, nullptr) != 0) {
          std::free(memory);
          memory = nullptr;
        }
      }
    }
  }
  ~AltStack() {
    if (memory == nullptr) return;
    stack_t off{};
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
    std::free(memory);
  }
};

std::atomic<bool> g_crash_handler_installed{false};

// Marks the op this thread runs for the crash record; restores the enclosing one on exit.
class OpScope {
 public:
  OpScope(const char* name, const char* overload) : saved_(tls_running_op) {
    if (g_crash_handler_installed.load(std::memory_order_relaxed)) {
      thread_local AltStack alt_stack;  // once per thread
      (void)alt_stack;
    }
    tls_running_op.name = name;
    tls_running_op.overload = overload;
  }
  explicit OpScope(const char* name) : OpScope(name, "") {}
  ~OpScope() { tls_running_op = saved_; }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  RunningOp saved_;
};

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kNumFatalSignals = sizeof(kFatalSignals) / sizeof(kFatalSignals[0]);
struct sigaction g_previous_actions[kNumFatalSignals];
int g_crash_fd = -1;

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    default: return "signal";
  }
}

// Async-signal-safe helpers: a bounded line buffer, no allocation.
struct LineBuffer {
  char data[512];
  size_t size = 0;
  void add(const char* text) {
    if (text == nullptr) return;
    for (; *text != '\0' && size < sizeof(data) - 1; ++text) data[size++] = *text;
  }
  void add_int(int value) {
    char digits[16];
    int count = 0;
    unsigned magnitude = value < 0 ? static_cast<unsigned>(-value) : static_cast<unsigned>(value);
    do {
      digits[count++] = static_cast<char>('0' + magnitude % 10);
      magnitude /= 10;
    } while (magnitude != 0 && count < 15);
    if (value < 0) add("-");
    while (count > 0 && size < sizeof(data) - 1) data[size++] = digits[--count];
  }
};

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t written = ::write(fd, data, size);
    if (written <= 0) return;
    data += written;
    size -= static_cast<size_t>(written);
  }
}

void crash_handler(int sig, siginfo_t* info, void* context) {
  int saved_errno = errno;
  LineBuffer line;
  line.add("offload-ref simulated accelerator: fatal signal ");
  line.add_int(sig);
  line.add(" (");
  line.add(signal_name(sig));
  line.add(") while running ");
  const RunningOp running = tls_running_op;
  if (running.name != nullptr) {
    line.add(running.name);
    if (running.overload != nullptr && running.overload[0] != '\0') {
      line.add(".");
      line.add(running.overload);
    }
    line.add(" on hpu\n");
  } else {
    line.add("no hpu op (the signal came from outside the simulated accelerator's ops)\n");
  }
  write_all(2, line.data, line.size);
  if (g_crash_fd >= 0) write_all(g_crash_fd, line.data, line.size);
  // Hand the signal on: to the handler installed before, or to the default action.
  int slot = 0;
  while (slot < kNumFatalSignals && kFatalSignals[slot] != sig) ++slot;
  struct sigaction previous {};
  if (slot < kNumFatalSignals) previous = g_previous_actions[slot];
  bool handler = (previous.sa_flags & SA_SIGINFO)
                     ? previous.sa_sigaction != nullptr
                     : (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN);
  if (!handler) {
    previous = {};
    previous.sa_handler = SIG_DFL;
    sigemptyset(&previous.sa_mask);
  }
  sigaction(sig, &previous, nullptr);
  errno = saved_errno;
  if (handler) {
    // call it in place (it sees this signal's siginfo); it re-raises or returns
    if (previous.sa_flags & SA_SIGINFO) {
      previous.sa_sigaction(sig, info, context);
    } else {
      previous.sa_handler(sig);
    }
    return;
  }
  // default action: a fault re-executes and dies of it; a raised signal is raised again
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

void install_crash_handler() {
  if (g_crash_handler_installed.load()) return;
  const char* path = std::getenv("OFFLOAD_REF_SIM_CRASH_FILE");
  if (path != nullptr && path[0] != '\0') {
    g_crash_fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
  struct sigaction action {};
  action.sa_sigaction = &crash_handler;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int i = 0; i < kNumFatalSignals; ++i) {
    sigaction(kFatalSignals[i], &action, &g_previous_actions[i]);
  }
  g_crash_handler_installed = true;
}

// -- current device and stream of each thread -------------------------------------------------------

thread_local c10::DeviceIndex tls_device = 0;
thread_local std::unordered_map<int, c10::StreamId> tls_stream;  // device -> current stream id
std::atomic<c10::StreamId> g_next_stream{1};

c10::StreamId current_stream_id(c10::DeviceIndex device) {
  auto it = tls_stream.find(device);
  return it == tls_stream.end() ? 0 : it->second;
}

// -- stream sanitizer ----------------------------------------------------------------------------------
//
// Note [Stream sanitizer]
//   The device runs every op at once, in program order, so a missing wait between streams never
//   changes a result here; on a GPU it does, sometimes.  The sanitizer finds such races by
//   happens-before, not by timing (torch's CUDA sanitizer is the model, torch/cuda/_sanitizer.py):
//   * each stream has a sequence number, bumped by every op launched on it, and a vector clock
//     (what it has waited for); an event's record takes a copy of its stream's clock, a stream's
//     wait on an event merges that copy in; a host synchronization (stream, event, device, a
//     query that answers "done", and every blocking copy, which is a copy followed by a stream
//     synchronize, as on CUDA) merges the synchronized clock into the host's, and every stream
//     takes the host's, since any later launch comes after;
//   * every access to device memory (an op's tensor arguments, written when its schema says so,
//     read otherwise; fresh results are written; copies read the source and write the
//     destination) is recorded per byte range of its block with its stream and sequence number,
//     and checked against the block's earlier accesses: one on another stream, overlapping, not
//     ordered before this one, with one of the two a write, is a race;
//   * pinned host memory is a block too: a non_blocking copy from or to it is an access by the
//     stream, and while such an access is not yet ordered before the host, the thread that
//     launched it watches every op (the TESTING_ONLY_GenericMode key in its thread-local included
//     set) for a host read or write of that memory;
//   * the allocator caches freed blocks per (device, allocation stream), as CUDA's does: a block's
//     history outlives a free, except the accesses of streams named by record_stream (the
//     allocator waits for those), so a reuse that another stream's unordered access may still
//     touch is a race, reported as a use after free.
//   Source lines are captured (with the GIL) for accesses on streams other than the default one,
//   for non_blocking copies, and for every access to a block some such stream has touched: the
//   accesses that can race.  Races are kept once each, named through the namer the kit installs.

namespace san {

std::atomic<bool> g_on{false};
constexpr int64_t kHost = std::numeric_limits<int64_t>::min();

int64_t key_of(c10::DeviceIndex device, c10::StreamId id) {
  return (static_cast<int64_t>(device) << 48) + id;
}
c10::DeviceIndex device_of(int64_t key) { return static_cast<c10::DeviceIndex>(key >> 48); }
c10::StreamId id_of(int64_t key) { return key - (static_cast<int64_t>(device_of(key)) << 48); }

using Clock = std::unordered_map<int64_t, uint64_t>;
using Where = std::shared_ptr<const std::vector<std::string>>;

void merge(Clock& into, const Clock& from) {
  for (const auto& [key, seq] : from) {
    auto& mine = into[key];
    if (seq > mine) mine = seq;
  }
}

struct Record {
  int64_t stream;
  uint64_t seq;
  size_t lo, hi;  // byte range in the block
  bool write;
  const char* op;
  const char* argument;  // a schema's argument name (lives as long as the op) or a literal
  Where where;
  uint64_t generation;  // the block's generation (frees) when it was made
  bool reported = false;  // a race with it was reported: one report for each earlier access
  bool hashed = false;    // a stream's read of pinned memory: the bytes' hash when it was made
  uint64_t hash = 0;
};

struct Block {
  std::vector<Record> records;
  uint64_t generation = 0;
  bool shared = false;  // touched by a stream other than the default one
  bool pinned = false;
  int64_t alloc_stream = 0;
  std::vector<int64_t> recorded;  // record_stream
  Where freed_at;
  bool free = false;  // in its allocation stream's pool (freed, not yet handed out again)
};

struct Conflict {
  std::string kind;
  int device;
  uintptr_t address;
  size_t nbytes;
  std::string tensor;  // "a float32 tensor of shape (8, 8)"
  int64_t stream;
  const char* op;
  const char* argument;
  bool write;
  Where where;
  Record previous;
  Where freed_at;
};

std::recursive_mutex g_mu;
std::unordered_map<int64_t, Clock> g_streams;  // stream key -> its clock
Clock g_host;
std::unordered_map<uintptr_t, Block> g_blocks;
std::unordered_set<uintptr_t> g_pinned_pending;  // pinned blocks with unsynchronized accesses
std::atomic<size_t> g_pinned_pending_count{0};   // of those, blocks a stream writes (host watch)
std::vector<Conflict> g_deferred;  // found under the lock, reported after it (flush())

std::mutex g_races_mu;
std::vector<py::dict>* g_races = nullptr;  // guarded by the GIL
std::unordered_set<std::string> g_race_keys;
py::object* g_namer = nullptr;             // guarded by the GIL
constexpr size_t kMaxRaces = 256;
constexpr size_t kMaxRecords = 256;

bool on() { return g_on.load(std::memory_order_relaxed); }

Clock& stream_clock(int64_t key) {
  auto it = g_streams.find(key);
  if (it != g_streams.end()) return it->second;
  Clock& clock = g_streams[key];
  clock = g_host;  // launched after everything the host has waited for
  clock[key];
  return clock;
}

bool ordered(const Record& r, int64_t stream, const Clock& clock) {
  if (r.stream == stream) return true;
  auto it = clock.find(r.stream);
  return it != clock.end() && it->second >= r.seq;
}

bool host_ordered(const Record& r) { return ordered(r, kHost, g_host); }

// Note [Modeled timeline]
//   With stream checking on, the sanitizer can also keep the order of what the host launched:
//   each op on its stream (its sequence number, kind of copy, bytes, and for matrix products,
//   convolutions and attention their FLOPs from the operands' shapes), each wait of a stream
//   for another's work (an event wait, a copy between devices), and each time the host waits
//   (a synchronize, a blocking copy, a query that answered done), with the vector clock it
//   waited for.  offload_ref/timeline.py replays that record on a device model (bandwidths, a
//   compute rate, a launch cost): the same program gives the same modeled time on every run,
//   whatever this machine's load.  Only the order is recorded, never a time.
struct TraceEntry {
  char kind;         // 'o' an op, 'w' a stream waits, 's' the host waits
  int64_t stream;    // 'o', 'w': the stream
  uint64_t seq;      // 'o': its sequence number on the stream
  std::string op;    // 'o': the op's name
  int copy;          // 'o': 0 compute, 1 host to device (pinned), 2 device to host, 3 device to
                     // device, 4 host to device from pageable memory
  uint64_t bytes;    // 'o': bytes read and written (a copy: bytes copied)
  double flops;      // 'o': floating-point operations (0 where not counted)
  int element_size;  // 'o': of its first operand
  Clock clock;       // 'w', 's': what is waited for
};
std::atomic<bool> g_tracing{false};
std::vector<TraceEntry> g_trace;  // guarded by g_mu

void trace_wait(char kind, int64_t stream, const Clock& clock) {
  if (!g_tracing.load(std::memory_order_relaxed)) return;
  g_trace.push_back(TraceEntry{kind, stream, 0, std::string(), 0, 0, 0.0, 0, clock});
}

// A hash of bytes [base + lo, base + hi) of host memory.
uint64_t hash_bytes(uintptr_t base, size_t lo, size_t hi) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(base) + lo;
  size_t n = hi - lo;
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes + i, 8);
    h = (h ^ word) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  }
  for (; i < n; ++i) h = (h ^ bytes[i]) * 0x100000001B3ULL;
  return h;
}

// Note [Host writes to pinned memory a copy reads]
//   A stream's non_blocking read of pinned memory keeps a hash of the bytes it read.  When the
//   read becomes ordered before the host (a synchronization), when another copy reads the same
//   bytes while it is still pending, and when the races are collected, the bytes are hashed
//   again: a difference means the host (any thread) wrote them while the copy may still have
//   been reading them.  Writes are found without watching every host op of every thread; the
//   writer's own line is not known, the place where the change was found is.
void verify(uintptr_t base, Record& r, const char* found_at) {
  if (!r.hashed || r.reported || hash_bytes(base, r.lo, r.hi) == r.hash) return;
  r.reported = true;
  g_deferred.push_back(Conflict{"host-write-before-copy-done", static_cast<int>(device_of(r.stream)),
                                base + r.lo, r.hi - r.lo, "", kHost, found_at, "", true, nullptr,
                                r, nullptr});
}

void prune_pinned() {
  size_t written = 0;
  for (auto it = g_pinned_pending.begin(); it != g_pinned_pending.end();) {
    auto block = g_blocks.find(*it);
    if (block != g_blocks.end()) {
      auto& records = block->second.records;
      for (Record& r : records) {
        if (host_ordered(r)) {
          verify(*it, r, "a host write seen by its effect (the bytes changed after the copy "
                         "read them; noticed at this synchronization)");
        }
      }
      records.erase(std::remove_if(records.begin(), records.end(), host_ordered), records.end());
      if (!records.empty()) {
        for (const Record& r : records) {
          if (r.write) {
            ++written;
            break;
          }
        }
        ++it;
        continue;
      }
    }
    it = g_pinned_pending.erase(it);
  }
  g_pinned_pending_count = written;
}

void host_learns(const Clock& clock) {
  trace_wait('s', kHost, clock);
  merge(g_host, clock);
  for (auto& [key, state] : g_streams) merge(state, g_host);
  prune_pinned();
}

const char* dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::ComplexFloat: return "complex64";
    case c10::ScalarType::ComplexDouble: return "complex128";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    default: return c10::toString(type);
  }
}

std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream out;
  out << "a " << dtype_name(t.scalar_type()) << " tensor of shape (";
  for (int64_t d = 0; d < t.dim(); ++d) out << (d ? ", " : "") << t.size(d);
  out << (t.dim() == 1 ? ",)" : ")");
  return out.str();
}

// The byte range of `t` in its storage; false when it touches no byte.
bool range_of(const at::Tensor& t, uintptr_t& base, size_t& lo, size_t& hi) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return false;
  const void* data = t.storage().data();
  if (data == nullptr) return false;
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * std::abs(t.stride(d));
  base = reinterpret_cast<uintptr_t>(data);
  lo = static_cast<size_t>(t.storage_offset()) * t.element_size();
  hi = lo + static_cast<size_t>(span) * t.element_size();
  return true;
}

struct Access {
  at::Tensor tensor;
  uintptr_t base;
  size_t lo, hi;
  bool write;
  const char* argument;
  uint64_t hash = 0;  // a read of pinned memory: its bytes' hash
};

const char* kind_of(const Record& previous, bool write, const Block& block) {
  // memory freed while another stream's access was unordered, handed out again; an access by
  // the allocation stream itself is in that stream's order: a new user on another stream that
  // did not wait for it is an ordinary read/write race
  if (previous.generation < block.generation && previous.stream != block.alloc_stream) {
    return "use-after-free";
  }
  if (previous.write && write) return "write-after-write";
  return previous.write ? "read-after-write" : "write-after-read";
}

// Check `a` (by `stream`, whose clock is `clock`) against the block's records and record it.
void check_and_record(Block& block, int64_t stream, uint64_t seq, const Clock& clock,
                      const Access& a, const char* op, const Where& where, int device,
                      std::vector<Conflict>& found) {
  auto& records = block.records;
  for (Record& r : records) {
    if (r.hi <= a.lo || a.hi <= r.lo) continue;
    if (!r.write && !a.write) continue;
    if (ordered(r, stream, clock)) continue;
    // reported already: the next earlier access may be an unordered one of its own (an
    // overlapping write by a third stream), so look on rather than stop
    if (r.reported) continue;
    r.reported = true;
    const int where_device =
        a.tensor.device().type() == kDev ? a.tensor.device().index() : device;
    found.push_back(Conflict{kind_of(r, a.write, block), where_device, a.base + a.lo,
                             a.hi - a.lo,
                             describe_tensor(a.tensor), stream, op, a.argument, a.write, where,
                             r, block.freed_at});
    break;
  }
  records.erase(std::remove_if(records.begin(), records.end(),
                               [&](const Record& r) {
                                 bool inside = a.lo <= r.lo && r.hi <= a.hi;
                                 if (!inside) return false;
                                 return a.write || (r.stream == stream && !r.write);
                               }),
                records.end());
  if (records.size() >= kMaxRecords) {
    records.erase(std::remove_if(records.begin(), records.end(), host_ordered), records.end());
    if (records.size() >= kMaxRecords) records.erase(records.begin());
  }
  records.push_back(Record{stream, seq, a.lo, a.hi, a.write, op, a.argument, where,
                           block.generation});
  if (id_of(stream) != 0) block.shared = true;
}

// Where the calling Python code is: the innermost frames outside torch and offload-ref's
// platform layer ("path.py:12 in forward"); empty on a thread without Python frames.
bool skipped_file(const char* file) {
  return std::strstr(file, "/torch/") != nullptr ||
         std::strstr(file, "/offload_ref/platform/") != nullptr ||
         std::strstr(file, "contextlib.py") != nullptr || file[0] == '<';
}

// Per code object (held for the life of the process, so its address is never reused): its file,
// whether it is skipped, and "file:LINE in name" without the line.  Guarded by the GIL.
struct CodeInfo {
  bool skipped;
  std::string file;
  std::string name;
};

CodeInfo& code_info(PyCodeObject* code) {
  static auto* cache = new std::unordered_map<PyCodeObject*, CodeInfo>();
  auto it = cache->find(code);
  if (it != cache->end()) return it->second;
  Py_INCREF(code);
  CodeInfo info{true, "", "?"};
  PyObject* filename = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename");
  PyObject* name = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_name");
  const char* file = filename ? PyUnicode_AsUTF8(filename) : nullptr;
  const char* function = name ? PyUnicode_AsUTF8(name) : nullptr;
  if (file != nullptr) {
    info.file = file;
    info.skipped = skipped_file(file);
  }
  if (function != nullptr) info.name = function;
  PyErr_Clear();
  Py_XDECREF(filename);
  Py_XDECREF(name);
  return cache->emplace(code, std::move(info)).first->second;
}

Where capture_where() {
  if (!Py_IsInitialized()) return nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return nullptr;
#else
  if (_Py_IsFinalizing()) return nullptr;
#endif
  PyGILState_STATE gil = PyGILState_Ensure();
  auto frames = std::make_shared<std::vector<std::string>>();
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  while (frame != nullptr && frames->size() < 3) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const CodeInfo& info = code_info(code);
    if (!info.skipped) {
      frames->push_back(info.file + ":" + std::to_string(PyFrame_GetLineNumber(frame)) + " in " +
                        info.name);
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  PyGILState_Release(gil);
  return frames;
}

py::list where_list(const Where& where) {
  py::list out;
  if (where) {
    for (const auto& line : *where) out.append(line);
  }
  return out;
}

std::string stream_name(int64_t key) {
  if (key == kHost) return "the host";
  std::ostringstream out;
  auto id = id_of(key);
  if (id == 0) {
    out << "the default stream of hpu:" << static_cast<int>(device_of(key));
  } else {
    out << "stream " << id << " of hpu:" << static_cast<int>(device_of(key));
  }
  return out.str();
}

py::dict access_dict(int64_t stream, const char* op, const char* argument, bool write,
                     const Where& where) {
  py::dict d;
  d["stream"] = stream == kHost ? -1 : id_of(stream);
  d["stream_name"] = stream_name(stream);
  d["op"] = op ? op : "?";
  d["argument"] = argument ? argument : "";
  d["write"] = write;
  d["where"] = where_list(where);
  return d;
}

// Name and keep the races found (outside the sanitizer's lock; takes the GIL).
void report(std::vector<Conflict>& found) {
  if (found.empty() || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  if (g_races == nullptr) g_races = new std::vector<py::dict>();
  for (auto& c : found) {
    std::string tensor = c.tensor;
    if (g_namer != nullptr && !g_namer->is_none()) {
      try {
        py::object name = (*g_namer)(c.device, c.address, c.nbytes);
        if (!name.is_none()) tensor = py::str(name);
      } catch (py::error_already_set& e) {
        tensor += " (the namer raised " + std::string(e.what()) + ")";
      }
    }
    auto first = [](const Where& w) { return (w && !w->empty()) ? (*w)[0] : std::string(); };
    std::ostringstream key;
    auto text = [](const char* p) { return p ? p : ""; };
    key << c.kind << "|" << text(c.op) << "|" << text(c.argument) << "|" << first(c.where) << "|"
        << text(c.previous.op) << "|" << text(c.previous.argument) << "|"
        << first(c.previous.where) << "|"
        << id_of(c.stream) << "|" << id_of(c.previous.stream) << "|" << tensor;
    if (!g_race_keys.insert(key.str()).second || g_races->size() >= kMaxRaces) continue;
    py::dict race;
    race["kind"] = c.kind;
    race["device"] = c.device;
    race["tensor"] = tensor;
    race["current"] = access_dict(c.stream, c.op, c.argument, c.write, c.where);
    race["previous"] = access_dict(c.previous.stream, c.previous.op, c.previous.argument,
                                   c.previous.write, c.previous.where);
    race["freed_at"] = c.kind == "use-after-free" ? where_list(c.freed_at) : py::list();
    g_races->push_back(race);
  }
}

// Report what was found under the lock (g_deferred), with where it was found.
void flush() {
  std::vector<Conflict> deferred;
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    if (g_deferred.empty()) return;
    deferred.swap(g_deferred);
  }
  Where where = capture_where();
  for (auto& c : deferred) {
    if (!c.where) c.where = where;
    if (c.tensor.empty()) c.tensor = "pinned host memory (" + std::to_string(c.nbytes) + " bytes)";
  }
  report(deferred);
}

// Check every pending read of pinned memory (the races are being collected).
void verify_all() {
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    for (uintptr_t base : g_pinned_pending) {
      auto it = g_blocks.find(base);
      if (it == g_blocks.end()) continue;
      for (Record& r : it->second.records) {
        if (!host_ordered(r)) {
          verify(base, r, "a host write seen by its effect (the bytes changed after the copy "
                          "read them; noticed when the races were collected)");
        }
      }
    }
  }
  flush();
}

// One launch on the current stream of `device` with its accesses (an op, a copy).
class Launch {
 public:
  Launch(c10::DeviceIndex device, const char* op) : device_(device), op_(op) {}

  void add(const at::Tensor& t, bool write, const char* argument) {
    Access a{t, 0, 0, 0, write, argument};
    if (range_of(t, a.base, a.lo, a.hi)) accesses_.push_back(std::move(a));
  }
  void capture() { capture_ = true; }
  void host_sync_after() { host_sync_ = true; }
  // an access by the stream to pinned host memory, asynchronous to the host
  void add_pinned(const at::Tensor& t, bool write, const char* argument) {
    Access a{t, 0, 0, 0, write, argument};
    if (!range_of(t, a.base, a.lo, a.hi)) return;
    if (!write) a.hash = hash_bytes(a.base, a.lo, a.hi);
    pinned_.push_back(std::move(a));
  }

  // Note [Modeled timeline]: this op, as the timeline replays it (under the sanitizer's lock)
  void trace_op(int64_t stream, uint64_t seq) {
    std::string name(op_);
    int copy = 0;
    if (name.rfind("copy host to device", 0) == 0) {
      copy = name.find("pageable") != std::string::npos ? 4 : 1;
    } else if (name.rfind("copy device to host", 0) == 0) {
      copy = 2;
    } else if (name.rfind("copy device to device", 0) == 0) {
      copy = 3;
    }
    uint64_t read = 0, written = 0;
    for (const Access& a : accesses_) (a.write ? written : read) += a.hi - a.lo;
    for (const Access& a : pinned_) (a.write ? written : read) += a.hi - a.lo;
    uint64_t bytes = copy == 0 ? read + written : std::max(read, written);
    int element = accesses_.empty() ? 0 : static_cast<int>(accesses_[0].tensor.element_size());
    g_trace.push_back(TraceEntry{'o', stream, seq, std::move(name), copy, bytes,
                                 copy == 0 ? flops() : 0.0, element, Clock()});
  }

  // FLOPs of a matrix product, convolution or attention from its operands' shapes; 0 for
  // anything else (the timeline times those by their bytes)
  double flops() const {
    std::string name(op_);
    std::vector<const at::Tensor*> in;
    const at::Tensor* out = nullptr;
    for (const Access& a : accesses_) {
      if (a.write) {
        out = &a.tensor;
      } else {
        in.push_back(&a.tensor);
      }
    }
    auto numel = [](const at::Tensor* t) { return static_cast<double>(t->numel()); };
    auto matmul = [&](const at::Tensor* a, const at::Tensor* b) -> double {
      if (a->dim() < 2 || b->dim() < 2) return 0.0;
      // a: (..., M, K), b: (..., K, N): 2 M K N per batch
      return 2.0 * numel(a) * static_cast<double>(b->size(-1));
    };
    if (name == "aten::mm" || name == "aten::bmm") {
      return in.size() >= 2 ? matmul(in[0], in[1]) : 0.0;
    }
    if (name == "aten::addmm" || name == "aten::baddbmm" || name == "aten::_addmm_activation" ||
        name == "aten::addbmm") {
      return in.size() >= 3 ? matmul(in[1], in[2]) : 0.0;
    }
    if (name == "aten::linear") {
      return in.size() >= 2 && in[1]->dim() == 2 ? 2.0 * numel(in[0]) * in[1]->size(0) : 0.0;
    }
    if (name == "aten::scaled_dot_product_attention" && in.size() >= 2 && in[1]->dim() >= 2) {
      return 4.0 * numel(in[0]) * static_cast<double>(in[1]->size(-2));
    }
    if (name == "aten::convolution" && in.size() >= 2 && out != nullptr && in[1]->dim() >= 1 &&
        in[1]->size(0) > 0) {
      return 2.0 * numel(out) * numel(in[1]) / static_cast<double>(in[1]->size(0));
    }
    return 0.0;
  }

  void commit() {
    if (accesses_.empty() && pinned_.empty() && !host_sync_) return;
    int64_t stream = key_of(device_, current_stream_id(device_));
    bool need_where = capture_ || id_of(stream) != 0 || !pinned_.empty();
    std::vector<Conflict> found;
    std::unique_lock<std::recursive_mutex> lock(g_mu);
    if (!need_where) {
      for (const Access& a : accesses_) {
        auto it = g_blocks.find(a.base);
        if (it != g_blocks.end() && it->second.shared) need_where = true;
      }
    }
    Where where;
    if (need_where) {
      lock.unlock();  // never wait for the GIL holding the sanitizer's lock
      where = capture_where();
      lock.lock();
    }
    {
      Clock& clock = stream_clock(stream);
      uint64_t seq = ++clock[stream];
      if (g_tracing.load(std::memory_order_relaxed)) trace_op(stream, seq);
      for (const Access& a : accesses_) {
        check_and_record(g_blocks[a.base], stream, seq, clock, a, op_, where, device_, found);
      }
      bool watch = false;
      for (const Access& a : pinned_) {
        Block& block = g_blocks[a.base];
        block.pinned = true;
        for (Record& r : block.records) {
          if (r.hi <= a.lo || a.hi <= r.lo || host_ordered(r)) continue;
          verify(a.base, r, "a host write seen by its effect (the bytes changed after the "
                            "copy read them; noticed at this later copy from them)");
        }
        check_and_record(block, stream, seq, clock, a, op_, where, device_, found);
        Record& made = block.records.back();
        made.hashed = !a.write;
        made.hash = a.hash;
        g_pinned_pending.insert(a.base);
        watch = watch || a.write;
      }
      if (watch) g_pinned_pending_count += 1;
      if (host_sync_) host_learns(clock);
      if (watch) {
        // a stream writes pinned memory: this thread's host ops are watched until it is synchronized
        c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::TESTING_ONLY_GenericMode,
                                                 true);
      }
    }
    lock.unlock();
    report(found);
    flush();
  }

 private:
  c10::DeviceIndex device_;
  const char* op_;
  c10::SmallVector<Access, 4> accesses_;
  std::vector<Access> pinned_;
  bool capture_ = false;
  bool host_sync_ = false;
};

// Whether an op writes `argument`: its schema says so, or it is an output of one of c10d's
// collectives, whose schemas do not (allgather's output_tensor, allreduce's tensors, ...).
bool writes_argument(const c10::FunctionSchema& schema, const c10::Argument& argument) {
  const auto* alias = argument.alias_info();
  if (alias != nullptr && alias->isWrite()) return true;
  if (schema.name().rfind("c10d::", 0) != 0) return false;
  const auto& name = argument.name();
  return name.rfind("output", 0) == 0 || (name == "tensors" && schema.name() != "c10d::send");
}

// Ops that read no element of their tensors (metadata, pinning state).
// (Module._apply's `_has_compatible_shallow_copy_type` and `param.data = t` read no byte; nor do
// `set_`, which points a tensor at another's memory, and the factories `*_like` / `new_*`.)
bool touches_no_data(const c10::FunctionSchema& schema) {
  static const std::unordered_set<std::string> names = {
      "aten::is_pinned",       "aten::size",         "aten::stride",
      "aten::sym_size",        "aten::sym_stride",   "aten::sym_numel",
      "aten::is_same_size",    "aten::record_stream", "aten::sym_storage_offset",
      "aten::_has_same_storage_numel", "aten::is_set_to", "aten::_has_compatible_shallow_copy_type",
      "aten::set_",            "aten::empty_like",   "aten::empty_strided",
      "aten::new_empty",       "aten::new_empty_strided", "aten::new_zeros",
      "aten::new_ones",        "aten::new_full",     "aten::zeros_like",
      "aten::ones_like",       "aten::full_like",    "aten::rand_like",
      "aten::randn_like",      "aten::randint_like", "aten::empty_permuted",
      "aten::resize_",         "aten::resize_as_",   "aten::_is_zerotensor",
      "aten::is_complex",      "aten::is_floating_point", "aten::detach",
      "aten::alias",           "aten::lift_fresh",   "aten::dim",
      "aten::numel",           "aten::result_type",  "aten::is_conj",
      "aten::is_neg",          "aten::_nnz"};
  return names.count(schema.name()) > 0;
}

// A host op's accesses to pinned memory that a stream may still be copying from or to.
void check_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  auto arguments = torch::jit::last(stack, n);
  std::vector<Conflict> found;
  Where where;
  bool captured = false;
  auto visit = [&](const at::Tensor& t, bool write, const char* argument) {
    if (!t.defined() || !t.device().is_cpu()) return;
    uintptr_t base;
    size_t lo, hi;
    if (!range_of(t, base, lo, hi)) return;
    {
      std::lock_guard<std::recursive_mutex> lock(g_mu);
      if (!g_pinned_pending.count(base)) return;
    }
    if (!captured) {
      where = capture_where();
      captured = true;
    }
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    auto it = g_blocks.find(base);
    if (it == g_blocks.end()) return;
    for (Record& r : it->second.records) {
      if (r.hi <= lo || hi <= r.lo) continue;
      if (!r.write && !write) continue;
      if (host_ordered(r)) continue;
      if (r.reported) continue;
      r.reported = true;
      found.push_back(Conflict{write ? "host-write-before-copy-done" : "host-read-before-sync",
                               static_cast<int>(device_of(r.stream)), base + lo, hi - lo,
                               describe_tensor(t), kHost, schema.name().c_str(), argument,
                               write, where, r, nullptr});
      break;
    }
  };
  if (touches_no_data(schema)) return;
  for (size_t i = 0; i < n; ++i) {
    const auto& argument = schema.arguments()[i];
    const auto* alias = argument.alias_info();
    bool write = alias != nullptr && alias->isWrite();
    if (alias != nullptr && !write) continue;  // a view of it: no data is touched
    const auto& value = arguments[i];
    if (value.isTensor()) {
      visit(value.toTensor(), write, argument.name().c_str());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) visit(t, write, argument.name().c_str());
    }
  }
  report(found);
}

void host_watch(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                torch::jit::Stack* stack) {
  if (on() && g_pinned_pending_count.load() > 0) {
    check_host(op, stack);
  } else {
    c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::TESTING_ONLY_GenericMode, false);
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                                c10::DispatchKey::TESTING_ONLY_GenericMode),
                     stack);
}

// -- events and synchronizations --------------------------------------------------------------

void event_record(Clock& event_clock, bool& has_clock, int64_t stream) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  event_clock = stream_clock(stream);
  has_clock = true;
}

void stream_waits(int64_t stream, const Clock& event_clock) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  trace_wait('w', stream, event_clock);
  merge(stream_clock(stream), event_clock);
}

// The current stream of device `waiter` waits for the current stream of device `other`.
void streams_meet(c10::DeviceIndex waiter, c10::DeviceIndex other) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  Clock copy = stream_clock(key_of(other, current_stream_id(other)));
  trace_wait('w', key_of(waiter, current_stream_id(waiter)), copy);
  merge(stream_clock(key_of(waiter, current_stream_id(waiter))), copy);
}

// Whether the host already comes after everything `clock` holds.
bool host_knows(const Clock& clock) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  for (const auto& [key, seq] : clock) {
    auto it = g_host.find(key);
    if (seq > (it == g_host.end() ? 0 : it->second)) return false;
  }
  return true;
}

void host_syncs_stream(int64_t stream);

// A stream's query (Note [Queries under stream checking]).
bool query_stream(int64_t stream) {
  static std::unordered_map<int64_t, uint64_t> answered;  // stream -> its seq answered "not done"
  uint64_t seq;
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    Clock& clock = stream_clock(stream);
    seq = clock[stream];
    auto it = g_host.find(stream);
    if (seq == 0 || (it != g_host.end() && it->second >= seq)) return true;
    auto& last = answered[stream];
    if (last != seq) {
      last = seq;
      return false;
    }
  }
  host_syncs_stream(stream);
  return true;
}

void host_syncs_stream(int64_t stream) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    Clock copy = stream_clock(stream);
    host_learns(copy);
  }
  flush();
}

void host_syncs_event(const Clock& event_clock) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    host_learns(event_clock);
  }
  flush();
}

void host_syncs_device(c10::DeviceIndex device) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    Clock all;
    for (const auto& [key, clock] : g_streams) {
      if (device < 0 || device_of(key) == device) merge(all, clock);
    }
    host_learns(all);
  }
  flush();
}

// -- the allocator's hooks --------------------------------------------------------------------------

void record_stream(uintptr_t base, int64_t stream) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  Block& block = g_blocks[base];
  if (std::find(block.recorded.begin(), block.recorded.end(), stream) == block.recorded.end()) {
    block.recorded.push_back(stream);
  }
}

// A block returns to its allocation stream's pool: the accesses of record_stream's streams are
// waited for by the allocator; the others stay, to be checked against the reuse.
void freed(uintptr_t base, int64_t alloc_stream) {
  bool need_where = false;
  {
    std::lock_guard<std::recursive_mutex> lock(g_mu);
    auto it = g_blocks.find(base);
    if (it == g_blocks.end()) return;
    Block& block = it->second;
    auto& records = block.records;
    records.erase(std::remove_if(records.begin(), records.end(),
                                 [&](const Record& r) {
                                   return std::find(block.recorded.begin(), block.recorded.end(),
                                                    r.stream) != block.recorded.end() ||
                                          host_ordered(r);
                                 }),
                  records.end());
    block.recorded.clear();
    block.generation += 1;
    block.freed_at = nullptr;
    block.free = true;
    block.alloc_stream = alloc_stream;
    for (const Record& r : records) {
      if (r.stream != alloc_stream) need_where = true;
    }
    if (records.empty()) {
      g_blocks.erase(it);
      return;
    }
  }
  if (!need_where) return;
  Where where = capture_where();
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  auto it = g_blocks.find(base);
  if (it != g_blocks.end()) it->second.freed_at = where;
}

// A cached block is handed out again.
void allocated(uintptr_t base) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  auto it = g_blocks.find(base);
  if (it != g_blocks.end()) it->second.free = false;
}

// Note [Freed memory another stream may still use]
//   A block in its allocation stream's pool goes to the next allocation on that stream, of any
//   size on a real allocator (which splits blocks); here only of the same rounded size.  So when
//   the races are collected, every free block whose earlier access by another stream is still
//   not ordered before its allocation stream is reported as a use after free: the allocation
//   that would get it next would race with that access, whatever its size.  (A free followed by
//   a wait of the allocation stream before the next allocation is ordered by then: no report.)
void check_freed() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  for (auto& [base, block] : g_blocks) {
    if (!block.free || block.pinned) continue;
    const Clock& clock = stream_clock(block.alloc_stream);
    for (Record& r : block.records) {
      if (r.reported || ordered(r, block.alloc_stream, clock)) continue;
      r.reported = true;
      g_deferred.push_back(Conflict{
          "use-after-free", static_cast<int>(device_of(block.alloc_stream)), base + r.lo,
          r.hi - r.lo, "device memory freed earlier (" + std::to_string(r.hi - r.lo) + " bytes)",
          block.alloc_stream, "the next allocation on it (the memory is free in its pool)", "",
          true, block.freed_at, r, block.freed_at});
    }
  }
}

// The memory goes back to the system (or a pinned block is freed: CUDA's host allocator waits
// for the streams that used it before it reuses the memory).
void forget(uintptr_t base) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  auto it = g_blocks.find(base);
  if (it == g_blocks.end()) return;
  if (it->second.pinned) {
    for (Record& r : it->second.records) {
      if (!host_ordered(r)) {
        verify(base, r, "a host write seen by its effect (the bytes changed after the copy "
                        "read them; noticed when the pinned memory was freed)");
      }
    }
  }
  g_blocks.erase(it);
  if (g_pinned_pending.erase(base)) prune_pinned();
}

void set_on(bool enabled) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (enabled && !g_on.load()) {
    // a fresh start: what happened unchecked is unknown
    g_blocks.clear();
    g_streams.clear();
    g_host.clear();
    g_pinned_pending.clear();
    g_pinned_pending_count = 0;
    g_deferred.clear();
  }
  g_on = enabled;
}

}  // namespace san


// -- memory ------------------------------------------------------------------------------------

void* aligned_alloc_bytes(size_t nbytes) {
  size_t rounded = ((nbytes + kAlignment - 1) / kAlignment) * kAlignment;
  if (rounded == 0) rounded = kAlignment;
  void* ptr = std::aligned_alloc(kAlignment, rounded);
  TORCH_CHECK(ptr != nullptr, "offload-ref's simulated accelerator: host allocation of ", nbytes,
              " bytes failed");
  return ptr;
}

struct DeviceState {
  c10::CachingDeviceAllocator::DeviceStats stats;
  int64_t capacity = -1;  // bytes; -1: unlimited
};

// Note [Caching allocator]
//   As CUDA's caching allocator does, a freed block goes back to a pool of its device and of the
//   stream that was current when it was allocated, and the next allocation of the same rounded
//   size on that stream takes it (the last freed first); so an offloader that frees a block
//   another stream may still use, without record_stream or a wait, gets it reused at once, and
//   the stream sanitizer sees the reuse (Note [Stream sanitizer]).  The statistics count live
//   bytes (allocated, active, requested and reserved alike, as before the cache); at most
//   kCacheLimit bytes per device are kept cached, empty_cache() returns them.
class SimAllocator final : public c10::DeviceAllocator {
 public:
  static constexpr size_t kRound = 512;
  static constexpr size_t kCacheLimit = size_t(1) << 30;

  struct Context {
    void* ptr;
    size_t nbytes;
    size_t rounded;
    c10::DeviceIndex device;
    c10::StreamId stream;
    SimAllocator* owner;
  };

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex device = current_device();
    return allocate_on(nbytes, device);
  }

  c10::DataPtr allocate_on(size_t nbytes, c10::DeviceIndex device) {
    size_t rounded = nbytes ? ((nbytes + kRound - 1) / kRound) * kRound : 0;
    c10::StreamId stream = current_stream_id(device);
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      DeviceState& state = states_[device];
      int64_t current = state.stats.allocated_bytes[0].current;
      if (state.capacity >= 0 && current + static_cast<int64_t>(nbytes) > state.capacity) {
        state.stats.num_ooms += 1;
        TORCH_CHECK_WITH(
            OutOfMemoryError, false, describe(device), " out of memory. Tried to allocate ",
            nbytes, " bytes; ", current, " bytes are allocated of a capacity of ",
            state.capacity, " bytes (OFFLOAD_REF_SIM_CAPACITY or set_capacity() sets it)");
      }
      increase(state, nbytes);
      if (rounded) {
        auto& pool = pools_[device][stream];
        auto range = pool.equal_range(rounded);
        if (range.first != range.second) {
          auto last = std::prev(range.second);
          ptr = last->second;
          pool.erase(last);
          cached_[device] -= rounded;
          if (san::on()) san::allocated(reinterpret_cast<uintptr_t>(ptr));
        }
      }
    }
    if (rounded && ptr == nullptr) ptr = aligned_alloc_bytes(rounded);
    auto* ctx = new Context{ptr, nbytes, rounded, device, stream, this};
    return c10::DataPtr(ptr, ctx, &SimAllocator::deleter, c10::Device(kDev, device));
  }

  static void deleter(void* raw) {
    auto* ctx = static_cast<Context*>(raw);
    if (ctx->ptr && san::on()) {
      san::freed(reinterpret_cast<uintptr_t>(ctx->ptr), san::key_of(ctx->device, ctx->stream));
    }
    ctx->owner->release(*ctx);
    delete ctx;
  }

  void release(const Context& ctx) {
    bool keep = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      DeviceState& state = states_[ctx.device];
      for (auto* stat : {&state.stats.allocated_bytes, &state.stats.reserved_bytes,
                         &state.stats.active_bytes, &state.stats.requested_bytes}) {
        (*stat)[0].decrease(ctx.nbytes);
      }
      for (auto* stat : {&state.stats.allocation, &state.stats.segment, &state.stats.active}) {
        (*stat)[0].decrease(1);
      }
      if (ctx.ptr && cached_[ctx.device] + ctx.rounded <= kCacheLimit) {
        pools_[ctx.device][ctx.stream].emplace(ctx.rounded, ctx.ptr);
        cached_[ctx.device] += ctx.rounded;
        keep = true;
      }
    }
    if (ctx.ptr && !keep) {
      if (san::on()) san::forget(reinterpret_cast<uintptr_t>(ctx.ptr));
      std::free(ctx.ptr);
    }
  }

  // Does `ptr` belong to this allocator (a DataPtr it made)?
  static const Context* context_of(const c10::DataPtr& data) {
    if (data.get_deleter() != &SimAllocator::deleter) return nullptr;
    return static_cast<const Context*>(data.get_context());
  }

  void empty_cache() {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      for (int d = 0; d < kMaxDevices; ++d) {
        for (auto& [stream, pool] : pools_[d]) {
          for (auto& [size, ptr] : pool) blocks.push_back(ptr);
        }
        pools_[d].clear();
        cached_[d] = 0;
      }
    }
    for (void* ptr : blocks) {
      if (san::on()) san::forget(reinterpret_cast<uintptr_t>(ptr));
      std::free(ptr);
    }
  }

  size_t cached_bytes(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> guard(mutex_);
    return cached_[check(device)];
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override { empty_cache(); }
  void recordStream(const c10::DataPtr& data, c10::Stream stream) override {
    if (!san::on() || context_of(data) == nullptr || data.get() == nullptr) return;
    san::record_stream(reinterpret_cast<uintptr_t>(data.get()),
                       san::key_of(stream.device_index(), stream.id()));
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> guard(mutex_);
    return states_[check(device)].stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> guard(mutex_);
    DeviceState& state = states_[check(device)];
    for (auto* stat : all_stats(state)) (*stat)[0].reset_accumulated();
    state.stats.num_ooms = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> guard(mutex_);
    DeviceState& state = states_[check(device)];
    for (auto* stat : all_stats(state)) (*stat)[0].reset_peak();
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> guard(mutex_);
    DeviceState& state = states_[check(device)];
    size_t total = state.capacity >= 0 ? static_cast<size_t>(state.capacity)
                                       : static_cast<size_t>(1) << 40;
    size_t used = static_cast<size_t>(state.stats.allocated_bytes[0].current);
    return {used < total ? total - used : 0, total};
  }

  void set_capacity(c10::DeviceIndex device, int64_t capacity) {
    std::lock_guard<std::mutex> guard(mutex_);
    states_[check(device)].capacity = capacity;
  }

  int64_t capacity(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> guard(mutex_);
    return states_[check(device)].capacity;
  }

  static c10::DeviceIndex current_device();

 private:
  static c10::DeviceIndex check(c10::DeviceIndex device) {
    if (device < 0) device = current_device();
    TORCH_CHECK(device < g_device_count.load(), "offload-ref's simulated accelerator has ",
                g_device_count.load(), " devices; hpu:", static_cast<int>(device),
                " does not exist");
    return device;
  }

  static std::vector<c10::CachingDeviceAllocator::StatArray*> all_stats(DeviceState& state) {
    return {&state.stats.allocated_bytes, &state.stats.reserved_bytes,
            &state.stats.active_bytes,    &state.stats.requested_bytes,
            &state.stats.allocation,      &state.stats.segment,
            &state.stats.active};
  }

  static void increase(DeviceState& state, size_t nbytes) {
    for (auto* stat : {&state.stats.allocated_bytes, &state.stats.reserved_bytes,
                       &state.stats.active_bytes, &state.stats.requested_bytes}) {
      (*stat)[0].increase(nbytes);
    }
    for (auto* stat : {&state.stats.allocation, &state.stats.segment, &state.stats.active}) {
      (*stat)[0].increase(1);
    }
  }

  std::mutex mutex_;
  DeviceState states_[kMaxDevices];
  // device -> allocation stream -> rounded size -> cached blocks
  std::unordered_map<c10::StreamId, std::multimap<size_t, void*>> pools_[kMaxDevices];
  size_t cached_[kMaxDevices] = {};
};

SimAllocator g_allocator;

// Pinned host memory: aligned host allocations whose ranges are remembered, so is_pinned()
// answers for any pointer inside one.
class PinnedAllocator final : public c10::Allocator {
 public:
  struct Context {
    void* ptr;
    size_t nbytes;
    PinnedAllocator* owner;
  };

  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? aligned_alloc_bytes(nbytes) : nullptr;
    auto* ctx = new Context{ptr, nbytes, this};
    if (ptr) {
      std::lock_guard<std::mutex> guard(mutex_);
      ranges_[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
      total_ += nbytes;
    }
    return c10::DataPtr(ptr, ctx, &PinnedAllocator::deleter, c10::Device(c10::DeviceType::CPU));
  }

  static void deleter(void* raw) {
    auto* ctx = static_cast<Context*>(raw);
    if (ctx->ptr) {
      std::lock_guard<std::mutex> guard(ctx->owner->mutex_);
      ctx->owner->ranges_.erase(reinterpret_cast<uintptr_t>(ctx->ptr));
      if (san::on()) san::forget(reinterpret_cast<uintptr_t>(ctx->ptr));
      ctx->owner->total_ -= ctx->nbytes;
      std::free(ctx->ptr);
    }
    delete ctx;
  }

  bool contains(const void* data) {
    auto address = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = ranges_.upper_bound(address);
    if (it == ranges_.begin()) return false;
    --it;
    return address < it->first + std::max<size_t>(it->second, 1);
  }

  int64_t total() {
    std::lock_guard<std::mutex> guard(mutex_);
    return static_cast<int64_t>(total_);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  std::mutex mutex_;
  std::map<uintptr_t, size_t> ranges_;
  size_t total_ = 0;
};

PinnedAllocator g_pinned;

// -- device guard: current device, synchronous streams and events ---------------------------------

c10::DeviceIndex SimAllocator::current_device() { return tls_device; }

struct SimEvent {
  bool recorded = false;
  std::chrono::steady_clock::time_point time;
  c10::DeviceIndex device = 0;
  san::Clock clock;  // the recording stream's clock (Note [Stream sanitizer])
  bool has_clock = false;
  bool answered_not_done = false;  // a query of this recording answered "not done" once
};

class SimGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kDev; }

  c10::Device exchangeDevice(c10::Device device) const override {
    auto old = getDevice();
    setDevice(device);
    return old;
  }

  c10::Device getDevice() const override { return c10::Device(kDev, tls_device); }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kDev, "expected an hpu device, got ", device);
    if (device.index() < 0) return;
    TORCH_CHECK(device.index() < g_device_count.load(), "offload-ref's simulated accelerator has ",
                g_device_count.load(), " devices; ", device, " does not exist");
    tls_device = device.index();
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) tls_device = device.index();
  }

  c10::Stream getStream(c10::Device device) const override {
    auto index = device.index() < 0 ? tls_device : device.index();
    auto it = tls_stream.find(index);
    c10::StreamId id = it == tls_stream.end() ? 0 : it->second;
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, index), id);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    auto index = device.index() < 0 ? tls_device : device.index();
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kDev, index));
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    auto index = device.index() < 0 ? tls_device : device.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, index), g_next_stream.fetch_add(1));
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*high*/) const override {
    return getNewStream(device, 0);
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    auto old = getStream(stream.device());
    tls_stream[stream.device_index()] = stream.id();
    return old;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) *event = new SimEvent();
    auto* sim = static_cast<SimEvent*>(*event);
    sim->recorded = true;
    sim->time = std::chrono::steady_clock::now();
    sim->device = device_index >= 0 ? device_index : stream.device_index();
    sim->has_clock = false;
    sim->answered_not_done = false;
    if (san::on()) {
      san::event_record(sim->clock, sim->has_clock, san::key_of(stream.device_index(), stream.id()));
    }
  }

  void block(void* event, const c10::Stream& stream) const override {
    auto* sim = static_cast<SimEvent*>(event);
    if (sim == nullptr || !sim->has_clock || !san::on()) return;
    san::stream_waits(san::key_of(stream.device_index(), stream.id()), sim->clock);
  }

  // Note [Queries under stream checking]
  //   A query that answers "done" tells the host the work is complete, so what it launches next
  //   comes after.  The device's work is always done at once, but on a GPU a query soon after
  //   the work was launched answers "not done": with stream checking on, the first query of work
  //   the host is not yet ordered after answers "not done" (so the code's not-done branch, a
  //   wait it skips, is checked), and the next answers "done" and orders the host after it (so
  //   a polling loop ends, correctly ordered).  Without stream checking every query is "done".
  bool queryEvent(void* event) const override {
    auto* sim = static_cast<SimEvent*>(event);
    if (sim == nullptr || !sim->has_clock || !san::on() || san::host_knows(sim->clock)) {
      return true;
    }
    if (!sim->answered_not_done) {
      sim->answered_not_done = true;
      return false;
    }
    san::host_syncs_event(sim->clock);
    return true;
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<SimEvent*>(event);
  }

  bool queryStream(const c10::Stream& stream) const override {
    if (!san::on()) return true;
    return san::query_stream(san::key_of(stream.device_index(), stream.id()));
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    if (san::on()) san::host_syncs_stream(san::key_of(stream.device_index(), stream.id()));
  }
  void synchronizeEvent(void* event) const override {
    auto* sim = static_cast<SimEvent*>(event);
    if (sim != nullptr && sim->has_clock && san::on()) san::host_syncs_event(sim->clock);
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    if (san::on()) san::host_syncs_device(device_index);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    g_allocator.recordStream(data, stream);
  }

  double elapsedTime(void* event1, void* event2,
                     const c10::DeviceIndex /*device_index*/) const override {
    auto* start = static_cast<SimEvent*>(event1);
    auto* end = static_cast<SimEvent*>(event2);
    TORCH_CHECK(start && end && start->recorded && end->recorded,
                "elapsed_time: both events must have been recorded");
    return std::chrono::duration<double, std::milli>(end->time - start->time).count();
  }
};

// -- random numbers -------------------------------------------------------------------------------

// A device generator: a CPU generator (so CPU's kernels can draw from it) seeded from a mix of the
// user's seed, so the same seed gives other numbers than the CPU generator, as on CUDA.
uint64_t mix_seed(uint64_t seed) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

class SimGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit SimGeneratorImpl(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(kDev, index), c10::DispatchKeySet(kKey)),
        inner_(c10::make_intrusive<at::CPUGeneratorImpl>(mix_seed(seed))),
        seed_(seed) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    inner_->set_current_seed(mix_seed(seed));
  }
  void set_offset(uint64_t offset) override { inner_->set_offset(offset); }
  uint64_t get_offset() const override { return inner_->get_offset(); }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    uint64_t fresh = c10::detail::getNonDeterministicRandom();
    set_current_seed(fresh);
    return fresh;
  }
  void set_state(const c10::TensorImpl& new_state) override { inner_->set_state(new_state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return inner_->get_state(); }

  at::Generator inner() const { return at::Generator(inner_); }

 private:
  SimGeneratorImpl* clone_impl() const override {
    auto* copy = new SimGeneratorImpl(device().index(), seed_);
    copy->inner_->set_state(*inner_->get_state());
    return copy;
  }

  c10::intrusive_ptr<at::CPUGeneratorImpl> inner_;
  uint64_t seed_;
};

std::vector<at::Generator>& default_generators() {
  static std::vector<at::Generator> generators = [] {
    std::vector<at::Generator> made;
    for (int i = 0; i < kMaxDevices; ++i) {
      made.emplace_back(at::make_generator<SimGeneratorImpl>(static_cast<c10::DeviceIndex>(i)));
    }
    return made;
  }();
  return generators;
}

// -- hooks ----------------------------------------------------------------------------------------

struct SimHooks final : public at::HPUHooksInterface {
  explicit SimHooks(at::HPUHooksArgs) {}
  void init() const override {}
  bool hasHPU() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override { tls_device = device; }
  c10::DeviceIndex getCurrentDevice() const override { return tls_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = tls_device;
    tls_device = device;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  bool isPinnedPtr(const void* data) const override { return g_pinned.contains(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }
  c10::Device getDeviceFromPtr(void* /*data*/) const override {
    return c10::Device(kDev, tls_device);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    auto index = device_index < 0 ? tls_device : device_index;
    TORCH_CHECK(index < g_device_count.load(), describe(index), " does not exist");
    return default_generators()[index];
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    auto index = device_index < 0 ? tls_device : device_index;
    return at::make_generator<SimGeneratorImpl>(index);
  }
};

// -- tensors --------------------------------------------------------------------------------------

bool is_dev(const at::Tensor& t) { return t.defined() && t.device().type() == kDev; }

// A CPU tensor over the same bytes as device tensor `t` (no copy).  Its storage keeps the device
// storage alive.
struct AliasContext {
  c10::Storage storage;
};

void alias_deleter(void* raw) { delete static_cast<AliasContext*>(raw); }

c10::Storage cpu_storage_over(const c10::Storage& storage) {
  void* data = storage.mutable_data();
  auto* ctx = new AliasContext{storage};
  c10::DataPtr ptr(data, ctx, &alias_deleter, c10::Device(c10::DeviceType::CPU));
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(ptr),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

// Note [Tensor flags]
//   A tensor's meaning is more than its bytes and geometry: the lazy conjugate and negative bits
//   (`x.conj()` of a complex tensor is a view with the conjugate bit), the zero-tensor bit
//   (`_efficientzerotensor`, which autograd makes for zero gradients), and the wrapped-number flag
//   of a 0-dim tensor made from a Python scalar (it changes type promotion).  A CPU alias of a
//   device tensor, and a device view of a CPU result, carry all of them, so CPU's kernel sees
//   exactly the tensor the caller passed, and a result means what CPU's result means.
// The keys of a tensor of `backend` with the flags of `from` that live in its key set.
c10::DispatchKeySet keys_like(c10::DispatchKey backend, const at::Tensor& from) {
  c10::DispatchKeySet keys(backend);
  if (from._is_zerotensor()) keys = keys | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return keys;
}

void copy_flags(const at::Tensor& from, c10::TensorImpl* to) {
  const c10::TensorImpl* source = from.unsafeGetTensorImpl();
  if (source->is_conj()) to->_set_conj(true);
  if (source->is_neg()) to->_set_neg(true);
  if (source->is_wrapped_number()) to->set_wrapped_number(true);
}

at::Tensor cpu_alias(const at::Tensor& t) {
  auto storage = cpu_storage_over(t.storage());
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), keys_like(c10::DispatchKey::CPU, t), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  copy_flags(t, impl.get());
  return at::Tensor(std::move(impl));
}

// A device tensor over device storage `storage` with the geometry (and flags) of `like`.
at::Tensor device_view(const c10::Storage& storage, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage),
                                                   keys_like(kKey, like), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  copy_flags(like, impl.get());
  return at::Tensor(std::move(impl));
}

at::Tensor device_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                                c10::ScalarType dtype, c10::DeviceIndex index) {
  int64_t nelements = 1;
  int64_t span = 1;  // elements the strided tensor reaches
  bool empty = false;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] == 0) empty = true;
    nelements *= size[i];
    span += (size[i] - 1) * stride[i];
  }
  auto itemsize = c10::elementSize(dtype);
  size_t nbytes = empty ? 0 : static_cast<size_t>(span) * itemsize;
  auto data = g_allocator.allocate_on(nbytes, index);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), &g_allocator,
                       /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(kKey),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(size, stride);
  return at::Tensor(std::move(impl));
}

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  if (!device.has_value() || device->index() < 0) return tls_device;
  TORCH_CHECK(device->index() < g_device_count.load(), describe(device->index()),
              " does not exist: offload-ref's simulated accelerator has ", g_device_count.load(),
              " devices");
  return device->index();
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device,
                               std::optional<bool> /*pin_memory*/,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided,
              "offload-ref's simulated accelerator supports strided tensors only");
  auto type = dtype.value_or(c10::get_default_dtype_as_scalartype());
  auto format = memory_format.value_or(c10::MemoryFormat::Contiguous);
  std::vector<int64_t> strides(size.size());
  // contiguous strides first, then the requested format's
  auto tmp = at::empty({0}, at::TensorOptions().dtype(type).device(c10::kMeta))
                 .resize_(size, format);
  for (size_t i = 0; i < size.size(); ++i) strides[i] = tmp.stride(i);
  return device_empty_strided(size, strides, type, index_of(device));
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided,
              "offload-ref's simulated accelerator supports strided tensors only");
  auto type = dtype.value_or(c10::get_default_dtype_as_scalartype());
  return device_empty_strided(size, stride, type, index_of(device));
}

// A copy's accesses (Note [Stream sanitizer]): on the current stream of the device side; a
// non_blocking copy from or to pinned host memory is asynchronous to the host, any other copy
// with a host side ends in a host synchronization with the stream, as on CUDA (a blocking copy
// synchronizes its stream; a device-to-host copy into pageable memory returns when done).
bool is_pinned_host(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.has_storage() && t.storage().data() != nullptr &&
         g_pinned.contains(t.storage().data());
}

void sanitize_copy(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  if (is_dev(src) && is_dev(dst)) {
    // as CUDA's copy between devices: on the source device's current stream, after a two-way
    // barrier with the destination device's current stream, which then waits for the copy
    const auto from = src.device().index(), to = dst.device().index();
    if (from != to) san::streams_meet(from, to);
    san::Launch launch(from, "copy device to device");
    launch.add(src, false, "src");
    launch.add(dst, true, "self");
    launch.commit();
    if (from != to) san::streams_meet(to, from);
  } else if (is_dev(dst)) {
    bool pinned = is_pinned_host(src);
    san::Launch launch(dst.device().index(),
                       !non_blocking ? "copy host to device"
                       : pinned      ? "copy host to device (non_blocking, from pinned memory)"
                                     : "copy host to device (non_blocking, from pageable memory)");
    launch.add(dst, true, "self");
    if (non_blocking && pinned) launch.add_pinned(src, false, "src");
    if (!non_blocking) launch.host_sync_after();
    launch.commit();
  } else if (is_dev(src)) {
    bool pinned = is_pinned_host(dst);
    san::Launch launch(src.device().index(),
                       !non_blocking ? "copy device to host"
                       : pinned      ? "copy device to host (non_blocking, into pinned memory)"
                                     : "copy device to host (non_blocking, into pageable memory)");
    launch.add(src, false, "src");
    if (non_blocking && pinned) {
      launch.add_pinned(dst, true, "self");
    } else {
      launch.host_sync_after();
    }
    launch.commit();
  }
}

// Plain byte-level copies in both directions (the memory is host memory on both sides).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  OpScope scope("aten::_copy_from");
  at::Tensor src_view = is_dev(self) ? cpu_alias(self) : self;
  at::Tensor dst_view = is_dev(dst) ? cpu_alias(dst) : dst;
  TORCH_CHECK(src_view.device().is_cpu() && dst_view.device().is_cpu(),
              "offload-ref's simulated accelerator copies to and from the host only, not ",
              self.device(), " -> ", dst.device());
  dst_view.copy_(src_view);
  if (san::on()) sanitize_copy(self, dst, non_blocking);
  return dst;
}

// `copy_` of a tensor with the conjugate or negative bit to or from the device: torch reaches
// `_copy_from` (the device is not one its copy kernel knows), whose math-bit fallback would
// resolve the bit with `clone`, which copies through `_copy_from` again, forever (a stack
// overflow).  The CPU aliases carry the bits (Note [Tensor flags]) and CPU's copy resolves them,
// as CUDA's copy kernel does.
at::Tensor copy_from_math_bits(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (is_dev(self) || is_dev(dst)) return copy_from(self, dst, non_blocking);
  // no simulated tensor here: resolve the bits of the source, as torch's fallback would
  TORCH_CHECK(!dst.is_conj() && !dst.is_neg(),
              "_copy_from into a tensor with the conjugate or negative bit between ",
              self.device(), " and ", dst.device(), " is not supported");
  return at::_copy_from(self.resolve_conj().resolve_neg(), dst, non_blocking);
}

void resize_device_storage(const at::Tensor& self, size_t nbytes) {
  auto* storage = self.storage().unsafeGetStorageImpl();
  if (nbytes <= storage->nbytes()) return;
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  auto data = g_allocator.allocate_on(nbytes, self.device().index());
  if (storage->nbytes() && storage->data()) {
    std::memcpy(data.get(), storage->data(), storage->nbytes());
  }
  storage->set_data_ptr_noswap(std::move(data));
  storage->set_nbytes(nbytes);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  auto format = memory_format.value_or(c10::MemoryFormat::Contiguous);
  if (format != c10::MemoryFormat::Preserve) impl->empty_tensor_restride(format);
  int64_t span = 0;
  if (self.numel() > 0) {
    span = 1;
    for (int64_t i = 0; i < self.dim(); ++i) span += (self.size(i) - 1) * self.stride(i);
  }
  resize_device_storage(self, static_cast<size_t>(span + self.storage_offset()) *
                                  self.element_size());
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  OpScope scope("aten::_copy_from_and_resize");
  if (dst.sizes() != self.sizes()) {
    if (is_dev(dst)) {
      resize_(dst, self.sizes(), std::nullopt);
    } else {
      dst.resize_(self.sizes());
    }
  }
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                        c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kDev || source.nbytes() == 0,
              "set_: expected a storage of ", describe(self.device().index()), ", got one on ",
              source.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                              offset.expect_int());
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.element_size());
  std::vector<c10::SymInt> size{c10::SymInt(numel)};
  std::vector<c10::SymInt> stride{c10::SymInt(1)};
  return set_storage(self, std::move(source), c10::SymInt(0), size, stride);
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  TORCH_CHECK(is_dev(source), "set_: expected a tensor on ", describe(self.device().index()),
              ", got one on ", source.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(source.storage());
  impl->set_sizes_and_strides(source.sizes(), source.strides(), source.storage_offset());
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  auto data = g_allocator.allocate_on(0, self.device().index());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(data), &g_allocator, true);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(storage));
  impl->set_sizes_contiguous({0});
  return self;
}

// Views: torch's generic implementations make a view of the same kind as `self`.
at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  std::optional<int64_t> plain;
  if (offset.has_value()) plain = offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), plain);
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  OpScope scope("aten::_local_scalar_dense");
  at::Scalar value = at::_local_scalar_dense(cpu_alias(self));
  if (san::on()) {  // .item(): a device-to-host copy that the host waits for
    san::Launch launch(self.device().index(), "aten::_local_scalar_dense (item)");
    launch.add(self, false, "self");
    launch.host_sync_after();
    launch.commit();
  }
  return value;
}

// A fresh CPU result copied once into device memory (so the allocator counts it).
at::Tensor to_device(const at::Tensor& cpu, c10::DeviceIndex index) {
  if (!cpu.defined()) return cpu;
  if (cpu._is_zerotensor()) {
    // a zero tensor has no bytes: the device's has none either (Note [Tensor flags])
    auto data = g_allocator.allocate_on(0, index);
    c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(data), &g_allocator,
                         /*resizable=*/true);
    auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys_like(kKey, cpu),
                                                     cpu.dtype());
    impl->set_sizes_and_strides(cpu.sizes(), cpu.strides());
    return at::Tensor(std::move(impl));
  }
  at::Tensor out;
  if (cpu.is_non_overlapping_and_dense()) {
    out = device_empty_strided(cpu.sizes(), cpu.strides(), cpu.scalar_type(), index);
  } else {
    out = device_empty_strided(cpu.sizes(), c10::contiguous_strides(cpu.sizes()),
                               cpu.scalar_type(), index);
  }
  cpu_alias(out).copy_(cpu);
  return out;
}

// Convolutions on an unknown backend go to the overrideable ops: run CPU's whole convolution
// (its own algorithm choice) on the same bytes.
at::Tensor host_of(const at::Tensor& t) { return is_dev(t) ? cpu_alias(t) : t; }

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    c10::IntArrayRef stride, c10::IntArrayRef padding,
                                    c10::IntArrayRef dilation, bool transposed,
                                    c10::IntArrayRef output_padding, int64_t groups) {
  OpScope scope("aten::convolution_overrideable");
  std::optional<at::Tensor> host_bias;
  if (bias.has_value() && bias->defined()) host_bias = host_of(*bias);
  at::Tensor out = at::convolution(host_of(input), host_of(weight), host_bias, stride, padding,
                                   dilation, transposed, output_padding, groups);
  at::Tensor result = to_device(out, input.device().index());
  if (san::on()) {
    san::Launch launch(input.device().index(), "aten::convolution");
    launch.add(input, false, "input");
    launch.add(weight, false, "weight");
    if (bias.has_value()) launch.add(*bias, false, "bias");
    launch.add(result, true, "result");
    launch.commit();
  }
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    bool transposed, c10::IntArrayRef output_padding, int64_t groups,
    std::array<bool, 3> output_mask) {
  OpScope scope("aten::convolution_backward_overrideable");
  std::vector<int64_t> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
  auto grads = at::convolution_backward(host_of(grad_output), host_of(input), host_of(weight),
                                        c10::IntArrayRef(bias_sizes), stride, padding, dilation,
                                        transposed, output_padding, groups, output_mask);
  auto index = input.device().index();
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result{
      to_device(std::get<0>(grads), index), to_device(std::get<1>(grads), index),
      to_device(std::get<2>(grads), index)};
  if (san::on()) {
    san::Launch launch(index, "aten::convolution_backward");
    launch.add(grad_output, false, "grad_output");
    launch.add(input, false, "input");
    launch.add(weight, false, "weight");
    launch.add(std::get<0>(result), true, "result");
    launch.add(std::get<1>(result), true, "result");
    launch.add(std::get<2>(result), true, "result");
    launch.commit();
  }
  return result;
}

// -- the fallback: every other op runs CPU's kernel on the same bytes -------------------------------

bool allows_host_tensors(const c10::OperatorName& name) {
  // CUDA takes host index tensors in advanced indexing.
  static const std::vector<std::string> index_ops = {"aten::index", "aten::index_put_",
                                                     "aten::index_put", "aten::_index_put_impl_"};
  for (const auto& op : index_ops) {
    if (name.name == op) return true;
  }
  return false;
}

[[noreturn]] void device_mismatch(const c10::OperatorHandle& op, const std::string& argument,
                                  c10::Device first, c10::Device other) {
  std::ostringstream out;
  auto show = [](c10::Device d) {
    std::ostringstream s;
    s << d;
    return s.str();
  };
  out << "Expected all tensors to be on the same device, but found at least two devices, "
      << show(first) << " and " << show(other) << "! (when checking argument '" << argument
      << "' of " << op.schema().name();
  if (!op.schema().overload_name().empty()) out << "." << op.schema().overload_name();
  // What the user can do about it: inputs on the execution device, or a host-only run.
  out << "; hpu is offload-ref's simulated accelerator: move inputs to "
      << "offload_ref.execution_device(pipeline), or run host-only with "
      << "CpuPlatform(device='cpu') or OFFLOAD_REF_SIM=0)";
  TORCH_CHECK(false, out.str());
}

struct Scan {
  std::optional<c10::Device> device;  // the op's device (the first device tensor's)
};

void note_tensor(const c10::OperatorHandle& op, const std::string& argument, const at::Tensor& t,
                 Scan& scan, bool host_ok) {
  if (!t.defined()) return;
  if (is_dev(t)) {
    if (!scan.device.has_value()) {
      scan.device = t.device();
    } else if (*scan.device != t.device()) {
      device_mismatch(op, argument, *scan.device, t.device());
    }
  }
}

void check_host(const c10::OperatorHandle& op, const std::string& argument, const at::Tensor& t,
                const Scan& scan, bool host_ok) {
  if (!t.defined() || is_dev(t) || !scan.device.has_value()) return;
  if (t.device().is_cpu() && (t.dim() == 0 || host_ok)) return;
  device_mismatch(op, argument, *scan.device, t.device());
}

struct AliasMap {
  // CPU alias storage impl -> device storage, for mapping views back
  std::vector<std::pair<c10::StorageImpl*, c10::Storage>> entries;
  at::Tensor make(const at::Tensor& t) {
    at::Tensor alias = cpu_alias(t);
    entries.emplace_back(alias.storage().unsafeGetStorageImpl(), t.storage());
    return alias;
  }
  const c10::Storage* find(const at::Tensor& t) const {
    if (!t.defined() || !t.has_storage()) return nullptr;
    auto* impl = t.storage().unsafeGetStorageImpl();
    for (const auto& entry : entries) {
      if (entry.first == impl) return &entry.second;
    }
    return nullptr;
  }
};

bool is_generator_type(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::GeneratorType) return true;
  return type->kind() == c10::TypeKind::OptionalType &&
         type->containedType(0)->kind() == c10::TypeKind::GeneratorType;
}

void check_devices(const c10::OperatorHandle& op, torch::jit::Stack* stack, Scan& scan) {
  const auto& schema = op.schema();
  const auto n = schema.arguments().size();
  auto arguments = torch::jit::last(stack, n);
  const bool host_ok = allows_host_tensors(schema.operator_name());
  auto each = [&](auto&& visit) {
    for (size_t i = 0; i < n; ++i) {
      const auto& name = schema.arguments()[i].name();
      const auto& value = arguments[i];
      if (value.isTensor()) {
        visit(name, value.toTensor(), false);
      } else if (value.isTensorList()) {
        for (const at::Tensor& t : value.toTensorList()) visit(name, t, true);
      } else if (value.isOptionalTensorList()) {
        for (const auto& item : value.toOptionalTensorList()) {
          std::optional<at::Tensor> opt = item;
          if (opt.has_value()) visit(name, *opt, false);
        }
      }
    }
  };
  each([&](const std::string& name, const at::Tensor& t, bool) {
    note_tensor(op, name, t, scan, host_ok);
  });
  each([&](const std::string& name, const at::Tensor& t, bool in_list) {
    if (in_list) {
      // a list (cat, stack) takes no host tensors, not even 0-dim ones
      if (t.defined() && !is_dev(t) && scan.device.has_value()) {
        device_mismatch(op, name, *scan.device, t.device());
      }
    } else {
      check_host(op, name, t, scan, host_ok);
    }
  });
}

// No two elements of `t` share an address (strides need not be dense: a narrowed view passes).
bool non_overlapping(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 1;  // elements the smaller dims span
  for (const auto& [stride, size] : dims) {
    if (stride < reach) return false;
    reach = stride * size;
  }
  return true;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto num_arguments = schema.arguments().size();
  const auto num_returns = schema.returns().size();
  OpScope scope(schema.name().c_str(), schema.overload_name().c_str());

  // 1. one device for every tensor argument (CUDA's rules)
  Scan scan;
  check_devices(op, stack, scan);
  c10::DeviceIndex index = scan.device.has_value() ? scan.device->index() : tls_device;

  // 2. CPU aliases over the same bytes, the device's generators, the host for device arguments
  c10::IValue* arguments = stack->data() + (stack->size() - num_arguments);
  std::vector<c10::IValue> originals(arguments, arguments + num_arguments);
  AliasMap aliases;
  std::vector<at::Tensor> arg_aliases(num_arguments);   // the alias passed for argument i
  std::vector<bool> replaced_out(num_arguments, false);  // an empty out= given a fresh host tensor
  for (size_t i = 0; i < num_arguments; ++i) {
    const auto& argument = schema.arguments()[i];
    auto& value = arguments[i];
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (!is_dev(t)) continue;
      if (argument.is_out() && t.numel() == 0) {
        replaced_out[i] = true;
        value = at::empty({0}, at::TensorOptions().dtype(t.scalar_type()));
      } else {
        arg_aliases[i] = aliases.make(t);
        value = arg_aliases[i];
      }
    } else if (value.isTensorList()) {
      auto list = value.toTensorList();
      c10::List<at::Tensor> mapped;
      mapped.reserve(list.size());
      for (const at::Tensor& t : list) mapped.push_back(is_dev(t) ? aliases.make(t) : t);
      value = mapped;
    } else if (value.isOptionalTensorList()) {
      auto list = value.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> mapped;
      mapped.reserve(list.size());
      for (const auto& item : list) {
        std::optional<at::Tensor> opt = item;
        if (opt.has_value() && is_dev(*opt)) opt = aliases.make(*opt);
        mapped.push_back(opt);
      }
      value = mapped;
    } else if (value.isDevice()) {
      if (value.toDevice().type() == kDev) value = c10::Device(c10::DeviceType::CPU);
    } else if (value.isGenerator()) {
      auto generator = value.toGenerator();
      if (generator.device().type() == kDev) {
        value = generator.get<SimGeneratorImpl>()->inner();
      } else if (scan.device.has_value()) {
        TORCH_CHECK(false, "Expected a 'hpu' device type for generator but found '",
                    generator.device().type(), "' (in ", schema.name(),
                    "; hpu is offload-ref's simulated accelerator)");
      }
    } else if (value.isNone() && is_generator_type(argument.type())) {
      value = default_generators()[index].get<SimGeneratorImpl>()->inner();
    }
  }

  // 3. CPU's kernel on the same bytes
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  std::optional<san::Launch> launch;  // the op's accesses (Note [Stream sanitizer])
  if (san::on()) launch.emplace(index, schema.name().c_str());

  // 4. mutated arguments: copy replaced outs back, follow metadata changes of in-place ops
  for (size_t i = 0; i < num_arguments; ++i) {
    const auto* alias_info = schema.arguments()[i].alias_info();
    if (alias_info == nullptr || !alias_info->isWrite() || !originals[i].isTensor()) continue;
    const at::Tensor& device_tensor = originals[i].toTensor();
    if (!is_dev(device_tensor)) continue;
    if (replaced_out[i]) continue;  // handled from the returned value below
    const at::Tensor& alias = arg_aliases[i];
    if (!alias.defined()) continue;
    if (alias.sizes() != device_tensor.sizes() || alias.strides() != device_tensor.strides() ||
        alias.storage_offset() != device_tensor.storage_offset()) {
      TORCH_CHECK(aliases.find(alias) != nullptr, schema.name(),
                  " replaced the storage of a device tensor; offload-ref's simulated "
                  "accelerator cannot follow that");
      device_tensor.unsafeGetTensorImpl()->set_sizes_and_strides(
          alias.sizes(), alias.strides(), alias.storage_offset());
    }
    // a kernel may flip a lazy bit of its output (linalg_lu_solve with left=False returns the
    // conjugate of what it wrote): the caller's tensor follows (Note [Tensor flags])
    auto* device_impl = device_tensor.unsafeGetTensorImpl();
    if (alias.is_conj() != device_tensor.is_conj()) device_impl->_set_conj(alias.is_conj());
    if (alias.is_neg() != device_tensor.is_neg()) device_impl->_set_neg(alias.is_neg());
  }

  // 5. results back to the device
  c10::IValue* returns = stack->data() + (stack->size() - num_returns);
  auto map_back = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || !t.device().is_cpu()) return t;
    if (const c10::Storage* storage = aliases.find(t)) return device_view(*storage, t);
    at::Tensor fresh = to_device(t, index);
    if (launch.has_value()) launch->add(fresh, true, "result");
    return fresh;
  };
  for (size_t r = 0; r < num_returns; ++r) {
    auto& value = returns[r];
    const auto* alias_info = schema.returns()[r].alias_info();
    if (alias_info != nullptr && alias_info->isWrite() && value.isTensor()) {
      // a mutated argument: return the caller's own tensor
      bool found = false;
      for (size_t i = 0; i < num_arguments && !found; ++i) {
        const auto* arg_alias = schema.arguments()[i].alias_info();
        if (arg_alias == nullptr || !arg_alias->isWrite() ||
            arg_alias->beforeSets() != alias_info->beforeSets()) {
          continue;
        }
        found = true;
        if (replaced_out[i]) {
          const at::Tensor& device_tensor = originals[i].toTensor();
          const at::Tensor computed = value.toTensor();
          if (non_overlapping(computed)) {
            // CPU's kernel chose the layout of the out it filled (LAPACK's are column-major, and
            // linalg_lstsq's solution is a narrowed column-major view): the device tensor takes
            // the same strides, as it would on the CPU, so the ops after it see the same layout
            auto* impl = device_tensor.unsafeGetTensorImpl();
            impl->set_sizes_and_strides(computed.sizes(), computed.strides(),
                                        device_tensor.storage_offset());
            int64_t span = 0;
            if (computed.numel() > 0) {
              span = 1;
              for (int64_t d = 0; d < computed.dim(); ++d) {
                span += (computed.size(d) - 1) * computed.stride(d);
              }
            }
            resize_device_storage(device_tensor,
                                  static_cast<size_t>(span + device_tensor.storage_offset()) *
                                      device_tensor.element_size());
          } else {
            resize_(device_tensor, computed.sizes(), std::nullopt);
          }
          cpu_alias(device_tensor).copy_(computed);
        }
        value = originals[i];
      }
      if (found) continue;
    }
    if (value.isTensor()) {
      value = map_back(value.toTensor());
    } else if (value.isTensorList()) {
      auto list = value.toTensorList();
      c10::List<at::Tensor> mapped;
      mapped.reserve(list.size());
      for (const at::Tensor& t : list) mapped.push_back(map_back(t));
      value = mapped;
    }
  }
  if (launch.has_value() && !san::touches_no_data(schema)) {
    // the arguments, with the geometry the op left them (an out= it resized); an argument the
    // op only takes a view of is not an access
    for (size_t i = 0; i < num_arguments; ++i) {
      const auto& argument = schema.arguments()[i];
      const auto* alias_info = argument.alias_info();
      const bool write = san::writes_argument(schema, argument);
      if (alias_info != nullptr && !write) continue;
      const auto& value = originals[i];
      const char* name = argument.name().c_str();
      auto visit_list = [&](const c10::List<at::Tensor>& list) {
        for (const at::Tensor& t : list) {
          if (is_dev(t)) launch->add(t, write, name);
        }
      };
      if (value.isTensor()) {
        if (is_dev(value.toTensor())) launch->add(value.toTensor(), write, name);
      } else if (value.isTensorList()) {
        visit_list(value.toTensorList());
      } else if (value.isOptionalTensorList()) {
        for (const auto& item : value.toOptionalTensorList()) {
          std::optional<at::Tensor> opt = item;
          if (opt.has_value() && is_dev(*opt)) launch->add(*opt, write, name);
        }
      } else if (value.isList()) {  // Tensor[][] (c10d's allgather_ outputs)
        for (const c10::IValue& inner : value.toListRef()) {
          if (inner.isTensorList()) visit_list(inner.toTensorList());
        }
      }
    }
    launch->commit();
  }
}

// -- scaled_dot_product_attention ---------------------------------------------------------------------

// torch's composite sdpa takes the math path on any device other than the CPU, which is not
// bit-equal to CPU's flash kernel.  So sdpa runs CPU's own sdpa on the same bytes, with a
// backward that reruns CPU's forward and backward (exactly what the CPU computes).
// CPU's sdpa on the device tensors' bytes, its output copied to device memory.
// CPU's sdpa draws its dropout from the CPU's default generator.  While it runs on device
// tensors, that generator holds the device generator's state (the device's random numbers, as
// every other op on the device draws them), and the device generator advances by what it drew.
// `replay` runs it from a state saved before (the backward reruns the forward: the same dropout
// mask as the forward's, not a new one); `start` receives the state it started from.
class DeviceRandomForCpuKernel {
 public:
  DeviceRandomForCpuKernel(c10::DeviceIndex index, const at::Tensor* replay, at::Tensor* start)
      : cpu_(at::detail::getDefaultCPUGenerator()),
        device_(default_generators()[index].get<SimGeneratorImpl>()->inner()),
        replay_(replay != nullptr) {
    std::lock_guard<std::mutex> cpu_lock(cpu_.mutex());
    saved_cpu_ = cpu_.get_state();
    if (replay != nullptr) {
      cpu_.set_state(*replay);
    } else {
      std::lock_guard<std::mutex> device_lock(device_.mutex());
      cpu_.set_state(device_.get_state());
    }
    if (start != nullptr) *start = cpu_.get_state();
  }
  ~DeviceRandomForCpuKernel() {
    std::lock_guard<std::mutex> cpu_lock(cpu_.mutex());
    if (!replay_) {
      std::lock_guard<std::mutex> device_lock(device_.mutex());
      device_.set_state(cpu_.get_state());
    }
    cpu_.set_state(saved_cpu_);
  }
  DeviceRandomForCpuKernel(const DeviceRandomForCpuKernel&) = delete;
  DeviceRandomForCpuKernel& operator=(const DeviceRandomForCpuKernel&) = delete;

 private:
  at::Generator cpu_;
  at::Generator device_;
  bool replay_;
  at::Tensor saved_cpu_;
};

at::Tensor sdpa_on_device_from(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& mask, double dropout_p,
                               bool is_causal, std::optional<double> scale, bool enable_gqa,
                               at::Tensor* random_start) {
  OpScope scope("aten::scaled_dot_product_attention");
  c10::DeviceIndex index = q.device().index();
  auto host = [](const at::Tensor& t) { return is_dev(t) ? cpu_alias(t) : t; };
  std::optional<at::Tensor> host_mask;
  if (mask.has_value()) host_mask = host(*mask);
  std::optional<DeviceRandomForCpuKernel> random;
  if (dropout_p > 0) random.emplace(index, nullptr, random_start);
  at::Tensor out = at::scaled_dot_product_attention(host(q), host(k), host(v), host_mask,
                                                    dropout_p, is_causal, scale, enable_gqa);
  at::Tensor result = to_device(out, index);
  if (san::on()) {
    san::Launch launch(index, "aten::scaled_dot_product_attention");
    launch.add(q, false, "query");
    launch.add(k, false, "key");
    launch.add(v, false, "value");
    if (mask.has_value()) launch.add(*mask, false, "attn_mask");
    launch.add(result, true, "result");
    launch.commit();
  }
  return result;
}

at::Tensor sdpa_on_device(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout_p,
                          bool is_causal, std::optional<double> scale, bool enable_gqa) {
  return sdpa_on_device_from(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, nullptr);
}

// The same as an opaque operator, offload_ref_sim::sdpa, with a Meta kernel: tracing
// (torch.compile's fake tensors) cannot enter CPU's kernel on device bytes, so a traced sdpa
// records this operator, which then runs CPU's kernel, bit-exact, when the graph runs.
at::Tensor sdpa_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  std::vector<int64_t> sizes = q.sizes().vec();
  sizes.back() = v.size(-1);
  return at::empty(sizes, q.options());
}

at::Tensor sdpa_opaque(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                       std::optional<double> scale, bool enable_gqa) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("offload_ref_sim::sdpa", "")
                       .typed<decltype(sdpa_meta)>();
  return op.call(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

struct SdpaFunction : public torch::autograd::Function<SdpaFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double dropout_p,
                            bool is_causal, std::optional<double> scale, bool enable_gqa) {
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["has_scale"] = scale.has_value();
    ctx->saved_data["scale"] = scale.value_or(0.0);
    ctx->saved_data["enable_gqa"] = enable_gqa;
    ctx->saved_data["has_mask"] = mask.has_value();
    if (mask.has_value()) {
      ctx->save_for_backward({q, k, v, *mask});
    } else {
      ctx->save_for_backward({q, k, v});
    }
    at::Tensor random_start;
    at::Tensor out = sdpa_on_device_from(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
                                         &random_start);
    if (random_start.defined()) ctx->saved_data["random_start"] = random_start;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    OpScope scope("aten::scaled_dot_product_attention (backward)");
    auto saved = ctx->get_saved_variables();
    bool has_mask = ctx->saved_data["has_mask"].toBool();
    c10::DeviceIndex index = saved[0].device().index();
    auto host = [](const at::Tensor& t) {
      return (is_dev(t) ? cpu_alias(t) : t).detach().requires_grad_(t.requires_grad());
    };
    at::Tensor q = host(saved[0]), k = host(saved[1]), v = host(saved[2]);
    std::optional<at::Tensor> mask;
    if (has_mask) mask = host(saved[3]);
    std::optional<double> scale;
    if (ctx->saved_data["has_scale"].toBool()) scale = ctx->saved_data["scale"].toDouble();
    torch::autograd::variable_list inputs;
    std::vector<int> positions;
    std::vector<at::Tensor> candidates = {q, k, v};
    if (has_mask) candidates.push_back(*mask);
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (candidates[i].requires_grad()) {
        inputs.push_back(candidates[i]);
        positions.push_back(static_cast<int>(i));
      }
    }
    torch::autograd::variable_list result(8);
    if (inputs.empty() || !grads[0].defined()) return result;
    at::AutoGradMode enable(true);
    std::optional<DeviceRandomForCpuKernel> random;  // the forward's dropout mask again
    if (ctx->saved_data.count("random_start")) {
      at::Tensor random_start = ctx->saved_data["random_start"].toTensor();
      random.emplace(index, &random_start, nullptr);
    }
    at::Tensor out = at::scaled_dot_product_attention(
        q, k, v, mask, ctx->saved_data["dropout_p"].toDouble(),
        ctx->saved_data["is_causal"].toBool(), scale, ctx->saved_data["enable_gqa"].toBool());
    at::Tensor grad_out = is_dev(grads[0]) ? cpu_alias(grads[0]) : grads[0];
    auto computed = torch::autograd::grad({out}, inputs, {grad_out});
    for (size_t j = 0; j < positions.size(); ++j) {
      result[positions[j]] = to_device(computed[j], index);
    }
    if (san::on()) {
      san::Launch launch(index, "aten::scaled_dot_product_attention (backward)");
      for (const auto& t : saved) launch.add(t, false, "saved");
      launch.add(grads[0], false, "grad_output");
      for (const auto& t : result) {
        if (t.defined()) launch.add(t, true, "result");
      }
      launch.commit();
    }
    return result;
  }
};

at::Tensor sdpa_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         std::optional<double> scale, bool enable_gqa) {
  Scan scan;
  // device checks as every other op (a host mask meets device queries: torch's error)
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (is_dev(*t) && !scan.device.has_value()) scan.device = t->device();
  }
  auto check = [&](const char* name, const at::Tensor& t) {
    if (!t.defined() || !scan.device.has_value()) return;
    if (t.device() != *scan.device) {
      std::ostringstream out;
      out << "Expected all tensors to be on the same device, but found at least two devices, "
          << *scan.device << " and " << t.device() << "! (when checking argument '" << name
          << "' of aten::scaled_dot_product_attention; hpu is offload-ref's simulated "
             "accelerator)";
      TORCH_CHECK(false, out.str());
    }
  };
  check("query", q);
  check("key", k);
  check("value", v);
  if (mask.has_value()) check("attn_mask", *mask);
  if (!scan.device.has_value()) {
    // no device tensor: CPU's own kernel
    at::AutoDispatchBelowAutograd guard;
    return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale,
                                            enable_gqa);
  }
  for (const at::Tensor* t : {&q, &k, &v}) {
    if (t->key_set().has(c10::DispatchKey::Python)) {
      // fake or functional tensors (tracing): the opaque operator, no autograd through it
      return sdpa_opaque(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
    }
  }
  return SdpaFunction::apply(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

std::vector<std::unique_ptr<torch::Library>>& libraries();

// `x.to("cpu", non_blocking=True)` of a device tensor lands in pinned memory, as on CUDA (torch's
// _to_copy pins the result for CUDA and PrivateUse1 only), so the copy is asynchronous to the host
// and the stream sanitizer checks that the host waits before it reads it.
at::Tensor to_copy(const at::Tensor& self, std::optional<c10::ScalarType> dtype,
                   std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                   std::optional<bool> pin_memory, bool non_blocking,
                   std::optional<c10::MemoryFormat> memory_format) {
  bool pin_out = non_blocking && is_dev(self) && device.has_value() && device->is_cpu() &&
                 (!layout.has_value() || *layout == c10::Layout::Strided);
  if (pin_out) pin_memory = true;
  return at::native::_to_copy(self, dtype, layout, device, pin_memory, non_blocking,
                              memory_format);
}

// Tensor.record_stream(s): the caching allocator waits for `s` before it reuses the block.
void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(is_dev(self), "record_stream: expected a tensor of offload-ref's simulated "
              "accelerator (hpu), got one on ", self.device());
  TORCH_CHECK(stream.device_type() == kDev, "record_stream: expected a stream of hpu, got one of ",
              stream.device());
  if (self.has_storage()) g_allocator.recordStream(self.storage().data_ptr(), stream);
}

// Note [Composites the CPU overrides]
//   An op with a CompositeImplicitAutograd kernel (a decomposition into other ops) and its own
//   CPU kernel runs the CPU kernel on the CPU, but on a device without a kernel of its own the
//   dispatcher prefers the decomposition to the fallback: `silu_backward` became sigmoid, mul
//   and add on hpu, 1 ulp away from CPU's fused kernel (every diffusers DiT's gradients
//   differed).  A GPU runs its own kernel there, so every such op (found in the dispatcher at
//   init, not listed by hand) runs CPU's kernel through the fallback; its derivative is its
//   own Autograd kernel, so only ops that have one are routed.
void route_composites_cpu_overrides(torch::Library& aten) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op.has_value()) continue;
    if (op->hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::Autograd) &&
        !op->hasKernelForDispatchKey(kKey)) {
      std::string qualified = name.name.substr(6);
      if (!name.overload_name.empty()) qualified += "." + name.overload_name;
      aten.impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    }
  }
}

// -- autocast -------------------------------------------------------------------------------------

// Note [Autocast]
//   torch.autocast(device_type="hpu") runs CUDA's autocast policy: the same op lists (torch
//   publishes them in ATen/autocast_mode.h for other backends to reuse): lower-precision ops
//   (mm, linear, matmul, convolutions, baddbmm, sdpa, ...) cast their floating-point hpu
//   arguments to the autocast dtype, fp32 ops (exp, log, softmax, layer_norm, losses, ...) to
//   float32, promote ops to the widest argument type; every other op runs un-cast (torch's
//   WrapFunction for device type HPU, so the casts are torch's own, including the weight cache).
//   The default dtype is torch's for hpu (bfloat16; CUDA's is float16): pass dtype= to choose.
at::Tensor binary_cross_entropy_refused(const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy (nn.BCELoss) is refused under autocast, "
              "as on CUDA: it is unsafe in lower precision; use binary_cross_entropy_with_logits "
              "(nn.BCEWithLogitsLoss), which autocasts to float32");
}

void register_autocast() {
  auto fallthrough = std::make_unique<torch::Library>(torch::Library::IMPL, "_",
                                                      c10::DispatchKey::AutocastHPU, __FILE__,
                                                      __LINE__);
  fallthrough->fallback(torch::CppFunction::makeFallthrough());
  libraries().push_back(std::move(fallthrough));

  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                              c10::DispatchKey::AutocastHPU, __FILE__, __LINE__);
  torch::Library& m = *lib;
  using at::IntArrayRef;
  using at::Scalar;
  using at::ScalarType;
  using at::Tensor;
#define SIMDEV_LOWER_PRECISION_FP(...) KERNEL(c10::DeviceType::HPU, __VA_ARGS__, lower_precision_fp)
#define SIMDEV_FP32(...) KERNEL(c10::DeviceType::HPU, __VA_ARGS__, fp32)
#define SIMDEV_FP32_SET_OPT_DTYPE(...) \
  KERNEL(c10::DeviceType::HPU, __VA_ARGS__, fp32_set_opt_dtype)
#define SIMDEV_PROMOTE(...) KERNEL(c10::DeviceType::HPU, __VA_ARGS__, promote)
#define SIMDEV_DIFFERENT_REDISPATCH(FUNC, NAME, SIGNATURE, REDISPATCH, POLICY) \
  KERNEL_DIFFERENT_REDISPATCH_SIGNATURE(c10::DeviceType::HPU, FUNC, NAME, SIGNATURE, REDISPATCH, \
                                        POLICY)
  AT_FORALL_LOWER_PRECISION_FP(SIMDEV_LOWER_PRECISION_FP)
  AT_FORALL_FP32(SIMDEV_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SIMDEV_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(SIMDEV_DIFFERENT_REDISPATCH)
  AT_FORALL_PROMOTE(SIMDEV_PROMOTE)
#undef SIMDEV_LOWER_PRECISION_FP
#undef SIMDEV_FP32
#undef SIMDEV_FP32_SET_OPT_DTYPE
#undef SIMDEV_PROMOTE
#undef SIMDEV_DIFFERENT_REDISPATCH
  m.impl("binary_cross_entropy", TORCH_FN(binary_cross_entropy_refused));
  libraries().push_back(std::move(lib));
}

// -- registration ---------------------------------------------------------------------------------

std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static std::vector<std::unique_ptr<torch::Library>> held;
  return held;
}

void register_ops() {
  auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kKey, __FILE__,
                                               __LINE__);
  aten->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten->impl("empty_strided", TORCH_FN(empty_strided));
  aten->impl("_copy_from", TORCH_FN(copy_from));
  aten->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  aten->impl("resize_", TORCH_FN(resize_));
  aten->impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  aten->impl("set_.source_Storage", TORCH_FN(set_source_storage));
  aten->impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  aten->impl("set_", TORCH_FN(set_empty));
  aten->impl("view", TORCH_FN(view));
  aten->impl("_reshape_alias", TORCH_FN(reshape_alias));
  aten->impl("as_strided", TORCH_FN(as_strided));
  aten->impl("unfold", TORCH_FN(unfold));
  aten->impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  aten->impl("_to_copy", TORCH_FN(to_copy));
  aten->impl("record_stream", TORCH_FN(record_stream));
  aten->impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  aten->impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
  // Composite kernels that are not CPU's (torch 2.13): run CPU's kernel through the fallback.
  for (const char* name :
       {"native_layer_norm", "native_group_norm", "addr", "addr.out", "_stack", "_stack.out",
        "any.dims", "all.dims", "any.dims_out", "all.dims_out", "linalg__powsum"}) {
    aten->impl(name, torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  route_composites_cpu_overrides(*aten);
  libraries().push_back(std::move(aten));

  for (auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    auto math_bits = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key,
                                                      __FILE__, __LINE__);
    math_bits->impl("_copy_from", TORCH_FN(copy_from_math_bits));
    libraries().push_back(std::move(math_bits));
  }

  register_autocast();

  auto sim = std::make_unique<torch::Library>(torch::Library::DEF, "offload_ref_sim",
                                              std::nullopt, __FILE__, __LINE__);
  sim->def("sdpa(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, "
           "bool is_causal, float? scale, bool enable_gqa) -> Tensor");
  libraries().push_back(std::move(sim));
  auto sim_device = std::make_unique<torch::Library>(torch::Library::IMPL, "offload_ref_sim",
                                                     kKey, __FILE__, __LINE__);
  sim_device->impl("sdpa", TORCH_FN(sdpa_on_device));
  libraries().push_back(std::move(sim_device));
  auto sim_meta = std::make_unique<torch::Library>(
      torch::Library::IMPL, "offload_ref_sim", c10::DispatchKey::Meta, __FILE__, __LINE__);
  sim_meta->impl("sdpa", TORCH_FN(sdpa_meta));
  libraries().push_back(std::move(sim_meta));

  auto autograd = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", c10::DispatchKey::AutogradHPU, __FILE__, __LINE__);
  autograd->impl("scaled_dot_product_attention", TORCH_FN(sdpa_autograd));
  libraries().push_back(std::move(autograd));

  auto host_watch = std::make_unique<torch::Library>(
      torch::Library::IMPL, "_", c10::DispatchKey::TESTING_ONLY_GenericMode, __FILE__, __LINE__);
  host_watch->fallback(torch::CppFunction::makeFromBoxedFunction<&san::host_watch>());
  libraries().push_back(std::move(host_watch));

  auto fallback_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey,
                                                       __FILE__, __LINE__);
  fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  libraries().push_back(std::move(fallback_lib));
}

std::string init(int64_t device_count) {
  if (g_initialized.load()) return "";
  if (c10::impl::hasDeviceGuardImpl(kDev)) {
    return "a device backend already owns torch's HPU device type (a real Habana plugin?)";
  }
  if (at::HPUHooksRegistry()->Has("HPUHooks")) {
    return "HPU hooks are already registered (a real Habana plugin?)";
  }
  TORCH_CHECK(device_count >= 1 && device_count <= kMaxDevices,
              "device_count must be in [1, ", kMaxDevices, "], got ", device_count);
  g_device_count = static_cast<int>(device_count);
  static c10::impl::DeviceGuardImplRegistrar guard_registrar(kDev, new SimGuardImpl());
  at::HPUHooksRegistry()->Register(
      "HPUHooks", [](at::HPUHooksArgs args) -> std::unique_ptr<at::HPUHooksInterface> {
        return std::make_unique<SimHooks>(args);
      });
  c10::SetAllocator(kDev, &g_allocator, /*priority=*/255);
  if (!at::detail::getHPUHooks().hasHPU()) {
    // torch creates its HPU hooks once, on first use: something asked for them (a
    // torch.accelerator call, a process group) before this registration.
    return "torch had already looked up its HPU hooks in this process before the simulated "
           "accelerator loaded (a torch.accelerator call, a process group, "
           "torch.random.fork_rng or importing diffusers came first); load it first: "
           "offload_ref.platform.simulated.load() at the start of the process";
  }
  register_ops();
  install_crash_handler();
  g_initialized = true;
  return "";
}

void set_capacity(int64_t device, int64_t capacity) {
  g_allocator.set_capacity(static_cast<c10::DeviceIndex>(device), capacity);
}

int64_t capacity(int64_t device) {
  return g_allocator.capacity(static_cast<c10::DeviceIndex>(device));
}

void manual_seed(uint64_t seed) {
  for (int i = 0; i < g_device_count.load(); ++i) {
    default_generators()[i].set_current_seed(seed);
  }
}

int64_t pinned_bytes() { return g_pinned.total(); }

c10::DeviceIndex checked_index(int64_t device) {
  TORCH_CHECK(device >= 0 && device < g_device_count.load(), "hpu:", device,
              " does not exist: offload-ref's simulated accelerator has ", g_device_count.load(),
              " devices (OFFLOAD_REF_SIM_DEVICES)");
  return static_cast<c10::DeviceIndex>(device);
}

// torch.hpu.get_rng_state / set_rng_state (torch.random.fork_rng saves and restores them).
at::Tensor get_rng_state(int64_t device) {
  auto& generator = default_generators()[checked_index(device)];
  std::lock_guard<std::mutex> lock(generator.mutex());
  return at::Tensor(generator.get_state());
}

void set_rng_state(int64_t device, const at::Tensor& state) {
  auto& generator = default_generators()[checked_index(device)];
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

uint64_t initial_seed(int64_t device) {
  return default_generators()[checked_index(device)].current_seed();
}

}  // namespace simdev

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init", &simdev::init, "register the simulated accelerator on torch's HPU key");
  m.def("set_capacity", &simdev::set_capacity);
  m.def("capacity", &simdev::capacity);
  m.def("manual_seed", &simdev::manual_seed);
  m.def("pinned_bytes", &simdev::pinned_bytes);
  m.def("get_rng_state", &simdev::get_rng_state);
  m.def("set_rng_state", &simdev::set_rng_state);
  m.def("initial_seed", &simdev::initial_seed);
  m.def("device_count", []() { return simdev::g_device_count.load(); });
  m.def("check_streams", &simdev::san::set_on, "turn the stream sanitizer on or off");
  m.def("checking_streams", &simdev::san::on);
  m.def("trace", [](bool enabled) {  // Note [Modeled timeline]
    std::lock_guard<std::recursive_mutex> lock(simdev::san::g_mu);
    simdev::san::g_trace.clear();
    simdev::san::g_tracing = enabled;
  });
  m.def("trace_entries", []() {
    std::vector<simdev::san::TraceEntry> entries;
    {
      std::lock_guard<std::recursive_mutex> lock(simdev::san::g_mu);
      entries.swap(simdev::san::g_trace);
    }
    py::list out;
    for (const auto& e : entries) {
      py::dict clock;
      for (const auto& [key, seq] : e.clock) clock[py::int_(key)] = seq;
      out.append(py::make_tuple(std::string(1, e.kind), e.stream, e.seq, e.op, e.copy, e.bytes,
                                e.flops, e.element_size, clock));
    }
    return out;
  });
  m.def("races", [](bool clear) {
    simdev::san::check_freed();
    simdev::san::verify_all();
    py::list out;
    if (simdev::san::g_races != nullptr) {
      for (const auto& race : *simdev::san::g_races) out.append(race);
      if (clear) {
        simdev::san::g_races->clear();
        simdev::san::g_race_keys.clear();
      }
    }
    return out;
  });
  m.def("set_tensor_namer", [](py::object namer) {
    if (simdev::san::g_namer == nullptr) simdev::san::g_namer = new py::object();
    *simdev::san::g_namer = std::move(namer);
  });
  m.def("cached_bytes", [](int64_t device) {
    return simdev::g_allocator.cached_bytes(static_cast<c10::DeviceIndex>(device));
  });
}
