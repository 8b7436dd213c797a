// CPU handler and its cache-blocked kernel.
//
// The classic GotoBLAS/BLIS structure: the output is cut into MC x NC tiles that
// threads take independently. For each KC-deep slab, a tile packs its block of A
// into MR-row panels and its block of B into NR-column panels (converting to the
// accumulator type, applying transposes and zero-padding edges as it goes), then
// a register-blocked MR x NR micro-kernel sweeps the panels. The B micro-panel
// stays in L1 across the sweep, the A block in L2. Because packing absorbs every
// layout and dtype difference, one micro-kernel per accumulator type serves all
// 16 dtype pairs, both transposes and every edge.

#include "cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "ffi_common.h"
#include "problem.h"

namespace jax_tiled::cpu {
namespace {

// ---- 16-bit float storage and conversions ------------------------------------

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

template <ffi::DataType T> struct StorageOf;
template <> struct StorageOf<ffi::DataType::F16> { using type = Half; };
template <> struct StorageOf<ffi::DataType::BF16> { using type = BFloat16; };
template <> struct StorageOf<ffi::DataType::F32> { using type = float; };
template <> struct StorageOf<ffi::DataType::F64> { using type = double; };
template <ffi::DataType T> using Storage = typename StorageOf<T>::type;

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float ToFloat(BFloat16 x) { return BitsToFloat(uint32_t{x.bits} << 16); }

inline float ToFloat(Half x) {
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1f;
  const uint32_t mantissa = x.bits & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest even, as the hardware conversions do.
inline BFloat16 ToBFloat16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1);
  return {static_cast<uint16_t>(u >> 16)};
}

inline Half ToHalf(float f) {
  uint32_t u = FloatToBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t h;
  if (u >= 0x47800000u) {  // >= 2^16: infinity, or NaN (kept quiet)
    h = (u > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // below 2^-14: subnormal half or zero
    // Adding 0.5 aligns the 10 result bits at the bottom of the mantissa and
    // lets the float adder do the round-to-nearest-even.
    h = FloatToBits(BitsToFloat(u) + 0.5f) - FloatToBits(0.5f);
  } else {
    const uint32_t odd = (u >> 13) & 1;
    h = (u + 0xc8000fffu + odd) >> 13;  // rebias exponent (-112 << 23), round
  }
  return {static_cast<uint16_t>(h | sign)};
}

template <class Acc, class T> inline Acc Load(T x) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) return ToFloat(x);
  else return static_cast<Acc>(x);
}

template <class T, class Acc> inline T Store(Acc x) {
  if constexpr (std::is_same_v<T, Half>) return ToHalf(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, BFloat16>) return ToBFloat16(static_cast<float>(x));
  else return static_cast<T>(x);
}

// ---- Micro- and macro-kernel ----------------------------------------------------

// Acc out[MR][NR] += Apanel (kc x MR, MR contiguous) * Bpanel (kc x NR, NR contiguous).
// The accumulators are MR * NR / W vector registers of W lanes.
template <class Acc, int MR, int NR, int VectorBytes>
__attribute__((always_inline)) inline void MicroKernel(int64_t kc, const Acc* __restrict a,
                                                       const Acc* __restrict b,
                                                       Acc* __restrict c, int64_t ldc) {
  constexpr int kLanes = VectorBytes / static_cast<int>(sizeof(Acc));
  constexpr int kVectors = NR / kLanes;
  static_assert(NR % kLanes == 0, "NR must be a whole number of vectors");
  typedef Acc Vec __attribute__((vector_size(VectorBytes), aligned(VectorBytes)));

  Vec acc[MR][kVectors];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) acc[i][v] = Vec{};

  for (int64_t p = 0; p < kc; ++p) {
    Vec bv[kVectors];
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v)
      bv[v] = *reinterpret_cast<const Vec*>(b + p * NR + v * kLanes);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const Acc ai = a[p * MR + i];
#pragma GCC unroll 8
      for (int v = 0; v < kVectors; ++v) acc[i][v] += ai * bv[v];
    }
  }

#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) {
      Vec cv;
      std::memcpy(&cv, c + i * ldc + v * kLanes, sizeof(Vec));
      cv += acc[i][v];
      std::memcpy(c + i * ldc + v * kLanes, &cv, sizeof(Vec));
    }
}

// Sweeps every (MR x NR) micro-tile of a packed (mc x kc) A block and (kc x nc)
// B block into the accumulator tile c (row stride ldc), mc and nc already padded.
template <class Acc, int MR, int NR, int VectorBytes>
__attribute__((always_inline)) inline void MacroKernelBody(int64_t mc, int64_t nc, int64_t kc,
                                                           const Acc* apack, const Acc* bpack,
                                                           Acc* c, int64_t ldc) {
  for (int64_t i = 0; i < mc; i += MR)
    for (int64_t j = 0; j < nc; j += NR)
      MicroKernel<Acc, MR, NR, VectorBytes>(kc, apack + i * kc, bpack + j * kc, c + i * ldc + j,
                                            ldc);
}

// One compiled copy per instruction set; the right one is picked at run time.
template <class Acc, int MR, int NR>
__attribute__((target("avx512f"))) void MacroKernelAvx512(int64_t mc, int64_t nc, int64_t kc,
                                                          const Acc* a, const Acc* b, Acc* c,
                                                          int64_t ldc) {
  MacroKernelBody<Acc, MR, NR, 64>(mc, nc, kc, a, b, c, ldc);
}
template <class Acc, int MR, int NR>
__attribute__((target("avx2,fma"))) void MacroKernelAvx2(int64_t mc, int64_t nc, int64_t kc,
                                                         const Acc* a, const Acc* b, Acc* c,
                                                         int64_t ldc) {
  MacroKernelBody<Acc, MR, NR, 32>(mc, nc, kc, a, b, c, ldc);
}
template <class Acc, int MR, int NR>
void MacroKernelBaseline(int64_t mc, int64_t nc, int64_t kc, const Acc* a, const Acc* b, Acc* c,
                         int64_t ldc) {
  MacroKernelBody<Acc, MR, NR, 16>(mc, nc, kc, a, b, c, ldc);
}

// Register block (mr x nr), cache blocks (mc x nc output tile, kc-deep slabs)
// and the macro-kernel compiled for them.
template <class Acc>
struct Blocking {
  int64_t mr, nr, mc, nc, kc;
  void (*macro_kernel)(int64_t, int64_t, int64_t, const Acc*, const Acc*, Acc*, int64_t);
};

// Accumulators take 24 of 32 registers with AVX-512 and 12 of 16 with AVX2:
// enough independent FMA chains to cover the FMA latency on both ports. The
// A micro-panel (kc x mr, 6-12 KiB) stays in L1 while B micro-panels stream
// from the L2-resident B block (kc x nc, 256 KiB). Tiles are tall (mc up to
// 384 rows, A block 384 KiB, accumulator tile 384 KiB, all in a 2 MiB L2)
// because each tile packs its own B block: re-packing B once per 96 rows cost
// a fifth of the run time at 1024^3.
template <class Acc>
const Blocking<Acc>& ChooseBlocking() {
  constexpr int64_t kLanes512 = 64 / sizeof(Acc), kLanes256 = 32 / sizeof(Acc),
                    kLanes128 = 16 / sizeof(Acc);
  constexpr int64_t kc = 1024 / sizeof(Acc);
  static const Blocking<Acc> blocking = [] {
    if (__builtin_cpu_supports("avx512f"))
      return Blocking<Acc>{12, 2 * kLanes512, 384, 256, kc,
                           MacroKernelAvx512<Acc, 12, 2 * kLanes512>};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return Blocking<Acc>{6, 2 * kLanes256, 384, 256, kc, MacroKernelAvx2<Acc, 6, 2 * kLanes256>};
    return Blocking<Acc>{6, 2 * kLanes128, 384, 256, kc, MacroKernelBaseline<Acc, 6, 2 * kLanes128>};
  }();
  return blocking;
}

// ---- Packing ------------------------------------------------------------------------

// Packs rows [0, rows) x depth [0, depth) of a strided matrix x (element (r, p)
// at x[r * row_stride + p * depth_stride]) into panels of `width` rows, each
// stored depth-major: dst[(r / width) * depth * width + p * width + r % width].
// Rows past `rows` up to the next multiple of width are zero.
template <class Acc, class In>
void PackPanels(const In* x, int64_t row_stride, int64_t depth_stride, int64_t rows,
                int64_t depth, int64_t width, Acc* dst) {
  const int64_t padded = (rows + width - 1) / width * width;
  for (int64_t r0 = 0; r0 < padded; r0 += width) {
    Acc* panel = dst + r0 * depth;
    const int64_t live = std::min(width, rows - r0);
    // Writes stream through the panel in order; the reads walk `width` rows
    // side by side, each of which stays in cache across consecutive p.
    for (int64_t p = 0; p < depth; ++p) {
      const In* src = x + r0 * row_stride + p * depth_stride;
      for (int64_t r = 0; r < live; ++r) panel[p * width + r] = Load<Acc>(src[r * row_stride]);
      for (int64_t r = live; r < width; ++r) panel[p * width + r] = Acc{0};
    }
  }
}

// Per-thread scratch that grows to the largest tile seen and is reused.
struct AlignedFree { void operator()(void* p) const { std::free(p); } };
template <class Acc>
Acc* ThreadScratch(size_t count) {
  thread_local std::unique_ptr<void, AlignedFree> buffer;
  thread_local size_t capacity = 0;
  const size_t bytes = (count * sizeof(Acc) + 63) / 64 * 64;
  if (bytes > capacity) {
    buffer.reset(std::aligned_alloc(64, bytes));
    capacity = buffer ? bytes : 0;
  }
  return static_cast<Acc*>(buffer.get());
}

// ---- Parallel loop over the XLA intra-op thread pool --------------------------------

// Runs body(i) for i in [0, n). The calling thread takes work too, and only
// waits for items already running on other threads, so it cannot deadlock if
// the pool's threads are all busy (the caller may itself be one of them).
// Late tasks find no work and touch only the shared counters, never `body`.
template <class Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Body& body) {
  // The caller is one of the workers: asking the pool for all of its threads
  // as well would put more workers than cores on the tiles.
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
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

// ---- The blocked product ----------------------------------------------------------

template <class In, class Out, class Acc>
void BlockedMatmul(ffi::ThreadPool& pool, const MatmulProblem& p, const In* a, const In* b,
                   Out* out) {
  if (p.empty_output()) return;
  if (p.k == 0) {  // an empty sum
    std::fill(out, out + p.batch * p.out_batch_stride, Store<Out>(Acc{0}));
    return;
  }
  const Blocking<Acc>& blk = ChooseBlocking<Acc>();
  // Rows per tile: at most blk.mc, split evenly, so that no thread is left with
  // a sliver of a tile at the bottom edge.
  const int64_t tiles_m = (p.m + blk.mc - 1) / blk.mc;
  const int64_t tile_rows = ((p.m + tiles_m - 1) / tiles_m + blk.mr - 1) / blk.mr * blk.mr;
  const int64_t tiles_n = (p.n + blk.nc - 1) / blk.nc;
  // Element strides of op(A) (rows m, depth k) and op(B)^T (rows n, depth k).
  const int64_t a_row = p.transpose_a ? 1 : p.lda(), a_depth = p.transpose_a ? p.lda() : 1;
  const int64_t b_row = p.transpose_b ? p.ldb() : 1, b_depth = p.transpose_b ? 1 : p.ldb();

  ParallelFor(pool, p.batch * tiles_m * tiles_n, [&](int64_t tile) {
    const int64_t batch = tile / (tiles_m * tiles_n);
    const int64_t i0 = (tile % tiles_m) * tile_rows;
    const int64_t j0 = (tile / tiles_m % tiles_n) * blk.nc;
    const int64_t mc = std::min(tile_rows, p.m - i0), nc = std::min(blk.nc, p.n - j0);
    const int64_t mc_padded = (mc + blk.mr - 1) / blk.mr * blk.mr;
    const int64_t nc_padded = (nc + blk.nr - 1) / blk.nr * blk.nr;

    Acc* scratch = ThreadScratch<Acc>(mc_padded * nc_padded + (mc_padded + nc_padded) * blk.kc);
    Acc* c = scratch;
    Acc* apack = c + mc_padded * nc_padded;
    Acc* bpack = apack + mc_padded * blk.kc;
    std::fill(c, c + mc_padded * nc_padded, Acc{0});

    const In* a_tile = a + batch * p.a_batch_stride + i0 * a_row;
    const In* b_tile = b + batch * p.b_batch_stride + j0 * b_row;
    for (int64_t k0 = 0; k0 < p.k; k0 += blk.kc) {
      const int64_t kc = std::min(blk.kc, p.k - k0);
      PackPanels(a_tile + k0 * a_depth, a_row, a_depth, mc, kc, blk.mr, apack);
      PackPanels(b_tile + k0 * b_depth, b_row, b_depth, nc, kc, blk.nr, bpack);
      blk.macro_kernel(mc_padded, nc_padded, kc, apack, bpack, c, nc_padded);
    }

    Out* out_tile = out + batch * p.out_batch_stride + i0 * p.ldc() + j0;
    for (int64_t i = 0; i < mc; ++i)
      for (int64_t j = 0; j < nc; ++j) out_tile[i * p.ldc() + j] = Store<Out>(c[i * nc_padded + j]);
  });
}

ffi::Error MatmulCpu(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                     ffi::Result<ffi::AnyBuffer> out, bool transpose_a, bool transpose_b,
                     int32_t precision, std::string_view kernel) {
  auto problem = MakeMatmulProblem(a, b, *out, transpose_a, transpose_b, precision, kernel);
  if (problem.has_error()) return problem.error();
  const MatmulProblem& p = problem.value();
  if (p.kernel != "auto" && p.kernel != "blocked") return UnknownKernel("CPU", p.kernel, kKernelNames);
  return VisitDtypes(p, [&](auto in_tag, auto out_tag) {
    using In = Storage<in_tag.value>;
    using Out = Storage<out_tag.value>;
    using Acc = Accumulator<in_tag.value, out_tag.value>;
    BlockedMatmul<In, Out, Acc>(pool, p, static_cast<const In*>(a.untyped_data()),
                                static_cast<const In*>(b.untyped_data()),
                                static_cast<Out*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_tiled::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxTiledMatmulCpu, jax_tiled::cpu::MatmulCpu,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()    // XLA's intra-op pool: threads for output tiles
        .Arg<xla::ffi::AnyBuffer>()     // a: (batch_a, m, k), or (batch_a, k, m) transposed
        .Arg<xla::ffi::AnyBuffer>()     // b: (batch_b, k, n), or (batch_b, n, k) transposed
        .Ret<xla::ffi::AnyBuffer>()     // out: (batch, m, n)
        .Attr<bool>("transpose_a")      // a is stored (batch_a, k, m)
        .Attr<bool>("transpose_b")      // b is stored (batch_b, n, k)
        .Attr<int32_t>("precision")     // 0 DEFAULT, 1 HIGH, 2 HIGHEST: all exact fp32 here
        .Attr<std::string_view>("kernel"));  // "auto" or a name from kKernelNames
