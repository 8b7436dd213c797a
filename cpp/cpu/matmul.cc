// CPU handler: validates the problem, picks the kernel compiled for this
// machine's vector width, cuts the output into tiles and runs them on XLA's
// intra-op thread pool. The kernel itself is in kernel_impl.h.

#include "cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/kernel.h"
#include "ffi_common.h"
#include "problem.h"

namespace jax_tiled::cpu {

// ---- bfloat16 paths ---------------------------------------------------------------------

namespace {

#if defined(__x86_64__) || defined(_M_X64)
// CPUID leaf 7, sub-leaf `sub`: {eax, ebx, ecx, edx}, zeros where absent.
struct CpuidRegs { unsigned eax = 0, ebx = 0, ecx = 0, edx = 0; };
CpuidRegs Leaf7(unsigned sub) {
  CpuidRegs r;
  if (!__get_cpuid_count(7, sub, &r.eax, &r.ebx, &r.ecx, &r.edx)) r = CpuidRegs{};
  return r;
}

// The register state the OS saves (XCR0), or 0 where XGETBV is unavailable.
uint64_t SavedStateMask() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return 0;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

// AVX-512F and BW (the packs) with the OS saving the zmm registers, which
// __builtin_cpu_supports checks.
bool HasAvx512Bw() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

[[maybe_unused]] bool CanRunAvx512Bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  return HasAvx512Bw() && (Leaf7(1).eax & (1u << 5));  // AVX512_BF16
#else
  return false;
#endif
}

// AMX needs the CPU's AMX-TILE and AMX-BF16, the OS saving the tile state
// (XCR0 bits 17 and 18), and, on Linux, the process's permission to use it,
// which the kernel grants on request (arch_prctl ARCH_REQ_XCOMP_PERM, Linux
// 5.16 and later; an older kernel, or a container that forbids it, refuses,
// and the next path runs instead). Asked once, for the whole process.
[[maybe_unused]] bool CanRunAmx() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
  static const bool ok = [] {
    const unsigned edx = Leaf7(0).edx;
    const bool cpu = (edx & (1u << 22)) && (edx & (1u << 24));  // AMX-BF16, AMX-TILE
    constexpr uint64_t kTileState = (uint64_t{1} << 17) | (uint64_t{1} << 18);
    if (!cpu || (SavedStateMask() & kTileState) != kTileState || !HasAvx512Bw()) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Whether the CPU is AMD's. vdpbf16ps does two products per lane where an FMA
// does one, but not at the FMA's rate everywhere: on the Intel Xeon of the
// development machine (AMX and AVX512_BF16) it issues once per ~3 cycles
// against the FMA's two per cycle, so there it is 0.6-1.0x the float32 path
// (NOTES.md, "bfloat16"), while AMD's Zen 4 and Zen 5 run it at the FMA's
// rate. "auto" takes it on AMD only; JAX_TILED_CPU_BF16 forces it anywhere.
[[maybe_unused]] bool IsAmd() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
#else
  return false;
#endif
}

bool Always() { return true; }

struct Bf16Path {
  const char* name;
  const IsaKernels* (*kernels)();  // nullptr: the FMA kernel, converting to float32
  bool (*runs_here)();             // the CPU has it and the OS lets this process use it
  bool (*auto_takes)();            // where it runs, "auto" takes it (else the next)
};

// The paths compiled into this build, preferred first; the last runs anywhere.
const std::vector<Bf16Path>& Bf16Paths() {
  static const std::vector<Bf16Path> paths = [] {
    std::vector<Bf16Path> p;
#if defined(JAX_TILED_HAVE_AMX)
    p.push_back({"amx", [] { return &AmxKernels(); }, &CanRunAmx, &Always});
#endif
#if defined(JAX_TILED_HAVE_AVX512_BF16)
    p.push_back({"avx512_bf16", [] { return &Avx512Bf16Kernels(); }, &CanRunAvx512Bf16, &IsAmd});
#endif
    p.push_back({kBf16Fallback, nullptr, &Always, &Always});
    return p;
  }();
  return paths;
}

std::string PathNames() {
  std::string names;
  for (const Bf16Path& path : Bf16Paths())
    names += std::string(names.empty() ? "" : ", ") + path.name;
  return names;
}

// The path that JAX_TILED_CPU_BF16 asks for, read on every call so that a
// process (a test) can switch paths: unset, empty or "auto" takes the first
// path that runs here and that auto takes; a name takes that path, and a name
// this build lacks or this machine cannot run is an error rather than a
// silent substitute.
const Bf16Path* ChooseBf16Path(std::string* error) {
  const char* env = std::getenv(kBf16PathVariable);
  const std::string asked = env == nullptr ? "" : env;
  for (const Bf16Path& path : Bf16Paths()) {
    if (asked.empty() || asked == "auto") {
      if (path.runs_here() && path.auto_takes()) return &path;
    } else if (asked == path.name) {
      if (path.runs_here()) return &path;
      *error = std::string(kBf16PathVariable) + "=" + asked + ": this CPU (or OS) cannot run it";
      return nullptr;
    }
  }
  *error = std::string(kBf16PathVariable) + "=" + asked +
           " is not a bfloat16 path of this build; " + "use auto or one of: " + PathNames();
  return nullptr;
}

}  // namespace

std::vector<Bf16PathFacts> Bf16PathTable() {
  std::vector<Bf16PathFacts> table;
  for (const Bf16Path& path : Bf16Paths()) table.push_back({path.name, path.runs_here()});
  return table;
}

std::string Bf16PathNow(std::string* error) {
  const Bf16Path* path = ChooseBf16Path(error);
  return path == nullptr ? "" : path->name;
}

namespace {

// The widest kernel this machine runs. __builtin_cpu_supports also checks
// that the OS saves the vector registers (XCR0), not only that the core has them.
const IsaKernels& ChooseKernels() {
  static const IsaKernels& kernels = []() -> const IsaKernels& {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    const bool fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (fma && __builtin_cpu_supports("avx512f")) return Avx512Kernels();
    if (fma) return Avx2Kernels();
#endif
    return PortableKernels();
  }();
  return kernels;
}

// Per-thread scratch that grows to the largest tile seen and is reused.
struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
void* ThreadScratch(size_t bytes) {
  thread_local std::unique_ptr<void, AlignedFree> buffer;
  thread_local size_t capacity = 0;
  bytes = (bytes + 63) / 64 * 64;
  if (bytes > capacity) {
    buffer.reset(std::aligned_alloc(64, bytes));
    capacity = buffer ? bytes : 0;
  }
  return buffer.get();
}

// ---- Parallel loop over the XLA intra-op thread pool --------------------------------

// Runs body(i) for i in [0, n) on at most `workers` threads (the pool's
// size or fewer). The calling thread takes work too, and only
// waits for items already running on other threads, so it cannot deadlock if
// the pool's threads are all busy (the caller may itself be one of them).
// Late tasks find no work and touch only the shared counters, never `body`.
template <class Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t workers, int64_t n, const Body& body) {
  // The caller is one of the workers: asking the pool for all of its threads
  // as well would put more workers than cores on the tiles.
  const int64_t helpers = std::min<int64_t>(workers - 1, n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, n, &body] {
    for (int64_t i; (i = shared->next.fetch_add(1)) < n;) {
      body(i);
      if (shared->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->all_done.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->done.load() == n; });
}

// ---- Tiles ---------------------------------------------------------------------------

// Tiles as large as kMaxTile a side, because a tile packs its rows of A once
// per slab for all of its columns and its B blocks once for all of its rows:
// packing costs about 1/cols + 1/rows of the multiply-adds. They are split
// further only until every thread of the pool has one, the longer side first
// (ties split rows: packing B is a plain copy, packing A a transpose).
constexpr int64_t kMaxTile = 1024;

// Threads worth waking for a product: each must get at least this many
// multiply-adds (half as many in float64, whose vectors hold half the lanes),
// about 100 microseconds of a core's work. Waking a pool thread costs tens
// of microseconds, and inside a lax.scan it is paid on every step; the
// measurements behind the threshold are in NOTES.md ("Small products: how
// many threads to wake").
constexpr int64_t kMinMultiplyAddsPerThread = 6'000'000;

int64_t UsefulThreads(const MatmulProblem& p, bool f64, int64_t pool_threads) {
  const double multiply_adds = static_cast<double>(p.batch) * p.m * p.n * p.k;
  const double per_thread = f64 ? kMinMultiplyAddsPerThread / 2 : kMinMultiplyAddsPerThread;
  return std::clamp<int64_t>(static_cast<int64_t>(multiply_adds / per_thread), 1,
                             std::max<int64_t>(pool_threads, 1));
}

struct TileGrid {
  int64_t tiles_m, tiles_n, rows, cols;
  int64_t count(int64_t batch) const { return batch * tiles_m * tiles_n; }
};

TileGrid ChooseTiles(const MatmulProblem& p, const Geometry& g, int64_t threads) {
  auto split = [](int64_t extent, int64_t parts, int64_t unit) {
    return ((extent + parts - 1) / parts + unit - 1) / unit * unit;
  };
  TileGrid t{(p.m + kMaxTile - 1) / kMaxTile, (p.n + kMaxTile - 1) / kMaxTile, 0, 0};
  for (;;) {
    t.rows = split(p.m, t.tiles_m, g.mr);
    t.cols = split(p.n, t.tiles_n, g.nr);
    if (t.count(p.batch) >= threads) break;
    if (t.rows >= t.cols && t.rows > g.mr) ++t.tiles_m;
    else if (t.cols > g.nr) ++t.tiles_n;
    else if (t.rows > g.mr) ++t.tiles_m;
    else break;
  }
  // Rounding tile sizes up may leave trailing tiles empty: drop them.
  t.tiles_m = (p.m + t.rows - 1) / t.rows;
  t.tiles_n = (p.n + t.cols - 1) / t.cols;
  return t;
}

Dtype ToDtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return Dtype::kF16;
    case ffi::DataType::BF16: return Dtype::kBF16;
    case ffi::DataType::F64: return Dtype::kF64;
    default: return Dtype::kF32;  // MakeMatmulProblem admits only these four
  }
}

ffi::Error MatmulCpu(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::RemainingArgs stack_indices, ffi::Result<ffi::AnyBuffer> out,
                     bool transpose_a, bool transpose_b, Precision precision,
                     std::string_view kernel) {
  auto problem =
      MakeMatmulProblem(a, b, *out, stack_indices, transpose_a, transpose_b, precision, kernel);
  if (problem.has_error()) return problem.error();
  const MatmulProblem& p = problem.value();
  if (p.kernel != "auto" && p.kernel != kKernelName)
    return UnknownKernel("CPU", p.kernel, kKernelName);
  if (p.empty_output()) return ffi::Error::Success();
  if (p.k == 0) {  // an empty sum: zeros (all-zero bits in every supported dtype)
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }

  Operands op;
  // A stacked operand's slice, its index read here: CPU buffers are host memory.
  const size_t in_bytes = ffi::ByteWidth(p.in_type);
  op.a = static_cast<const char*>(a.untyped_data()) + p.a_stack.Offset() * in_bytes;
  op.b = static_cast<const char*>(b.untyped_data()) + p.b_stack.Offset() * in_bytes;
  op.out = out->untyped_data();
  op.in = ToDtype(p.in_type), op.out_type = ToDtype(p.out_type);
  op.m = p.m, op.n = p.n, op.k = p.k;
  op.a_batch_stride = p.a_batch_stride, op.b_batch_stride = p.b_batch_stride;
  op.out_batch_stride = p.out_batch_stride;
  op.a_row = p.transpose_a ? 1 : p.lda(), op.a_depth = p.transpose_a ? p.lda() : 1;
  op.b_col = p.transpose_b ? p.ldb() : 1, op.b_depth = p.transpose_b ? 1 : p.ldb();
  op.ldc = p.ldc();

  const bool f64 = op.in == Dtype::kF64 || op.out_type == Dtype::kF64;
  const IsaKernels* kernels = &ChooseKernels();
  if (op.in == Dtype::kBF16 && !f64) {
    std::string error;
    const Bf16Path* path = ChooseBf16Path(&error);
    if (path == nullptr) return ffi::Error::InvalidArgument("tiled_matmul: " + error);
    if (path->kernels != nullptr) kernels = path->kernels();
  }
  const IsaKernels& isa = *kernels;
  const int64_t threads = UsefulThreads(p, f64, pool.num_threads());
  const TileGrid grid = ChooseTiles(p, f64 ? isa.f64 : isa.f32, threads);
  const size_t scratch_bytes = isa.scratch_bytes(op, grid.rows, grid.cols);
  std::atomic<bool> out_of_memory{false};
  ParallelFor(pool, threads, grid.count(p.batch), [&](int64_t index) {
    Tile tile;
    tile.batch = index / (grid.tiles_m * grid.tiles_n);
    const int64_t ti = index % grid.tiles_m, tj = index / grid.tiles_m % grid.tiles_n;
    tile.i0 = ti * grid.rows, tile.j0 = tj * grid.cols;
    tile.rows = std::min(grid.rows, p.m - tile.i0);
    tile.cols = std::min(grid.cols, p.n - tile.j0);
    void* scratch = ThreadScratch(scratch_bytes);
    if (scratch == nullptr) {
      out_of_memory = true;
      return;
    }
    isa.run_tile(op, tile, scratch);
  });
  if (out_of_memory)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "tiled_matmul: could not allocate CPU kernel scratch");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_tiled::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxTiledMatmulCpu, jax_tiled::cpu::MatmulCpu,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()  // XLA's intra-op pool: threads for output tiles
        .Arg<xla::ffi::AnyBuffer>()   // a: (batch_a, m, k), or (batch_a, k, m) transposed
        .Arg<xla::ffi::AnyBuffer>()   // b: (batch_b, k, n), or (batch_b, n, k) transposed
        .RemainingArgs()              // int32 index of each operand given as a stack (L, ...)
        .Ret<xla::ffi::AnyBuffer>()   // out: (batch, m, n)
        .Attr<bool>("transpose_a")    // a is stored (batch_a, k, m)
        .Attr<bool>("transpose_b")    // b is stored (batch_b, n, k)
        .Attr<jax_tiled::Precision>("precision")  // every precision: exact fp32 here
        .Attr<std::string_view>("kernel"));       // "auto" or kKernelName
