// Rung 4, "mma": tensor cores through warp-wide mma.sync (sm_80+, also runs
// on sm_90), bfloat16 or float16 inputs accumulated in float32, fed by rung
// 3's multi-stage cp.async pipeline.
//
// What it fixes in rung 3 (see NOTES.md): there, every multiply-add was an
// FFMA issued by one thread, and the loop ran out of issue slots (FFMA 71% of
// issued instructions, 0.8 issued per scheduler per cycle) at about 0.75x of
// jnp.matmul. One mma.sync.m16n8k16 does 16 x 8 x 16 multiply-adds for the
// warp in one issued instruction, so arithmetic stops being issue-bound;
// what remains is feeding the tensor cores, which ldmatrix does by loading
// four 8 x 8 fragments per instruction straight into the registers mma wants.
//
// Shared tiles keep each operand's global layout, so every operand arrives in
// 16-byte cp.async copies with no transpose on the way in: a K-major tile
// ([x][k]: A plain, B transposed) is read by plain ldmatrix, an MN-major one
// ([k][x]: A transposed, B plain) by ldmatrix.trans, which transposes each
// 8 x 8 fragment as it loads it. The two layouts are template parameters of
// the kernel, so the loop holds no layout branches. Rows are padded by 8
// elements to an odd number of 16-byte units (80, 144 or 272 bytes), so the
// 8 rows of a fragment fall in 8 distinct groups of 4 banks: each ldmatrix
// phase is conflict-free.
//
// cp.async needs 16-byte aligned rows. An operand whose rows are not (odd ld,
// offset base or batch stride) is copied by bounds-checked element loads into
// registers and one 16-byte shared store per chunk, synchronously, through
// the same stages and barriers; that is a correctness path, not a fast one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/kernels/async_copy.cuh"
#include "cuda/kernels/common.cuh"

namespace jax_tiled::cuda {

// Block shape in warps, each warp's output tile, the K slab depth, the slabs
// resident in shared memory, and how many blocks must fit on one SM.
template <int kWarpsM_, int kWarpsN_, int kWarpM_, int kWarpN_, int kSlab_, int kStages_,
          int kMinBlocks_>
struct MmaConfig {
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr int kWarpM = kWarpM_, kWarpN = kWarpN_;
  static constexpr int kSlab = kSlab_, kStages = kStages_, kMinBlocks = kMinBlocks_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kBlockM = kWarpsM * kWarpM, kBlockN = kWarpsN * kWarpN;
  static constexpr int kTilesM = kWarpM / 16, kTilesN = kWarpN / 8;  // mma tiles per warp
  // One ldmatrix.x4 loads a 16 x 16 piece: one m16 tile of A, or two n8 tiles of B.
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tiles are whole 16 x 16 pieces");
  static_assert(kSlab % 16 == 0, "a slab is whole k16 steps");
  static_assert(kStages >= 2, "a pipeline needs a slab to fill while one is read");
};

// One operand's K slab in shared memory, in its global layout: K-major
// ([kX][kSlab]) or MN-major ([kSlab][kX]), x being the operand's free axis
// (M for A, N for B). Elements are 2 bytes.
template <int kX_, int kSlab_, bool kKMajor_>
struct MmaTile {
  static constexpr int kX = kX_, kSlab = kSlab_;
  static constexpr bool kKMajor = kKMajor_;
  static constexpr int kRows = kKMajor ? kX : kSlab;
  static constexpr int kPitch = (kKMajor ? kSlab : kX) + 8;  // elements per padded row
  static constexpr int kBytes = kRows * kPitch * 2;
  static_assert(kPitch * 2 % 32 == 16, "rows must be an odd number of 16-byte units");

  // Byte offset of the 16-byte row that `lane` hands to ldmatrix.x4 for the
  // 16 x 16 piece at free-axis offset x0, k = 0. Matrix q = lane / 8 of the
  // four covers free-axis half x_half and k half k_half of the piece; its
  // lanes give its 8 rows, lane % 8 being the row.
  __device__ __forceinline__ static int FragmentOffset(int lane, int x0, int x_half, int k_half) {
    const int x = x0 + x_half * 8, k = k_half * 8;
    return kKMajor ? ((x + lane % 8) * kPitch + k) * 2 : ((k + lane % 8) * kPitch + x) * 2;
  }

  // Bytes from the piece at (x0, k = 0) to the piece 16 * x16 further along
  // the free axis and 16 * k16 along K.
  __host__ __device__ static constexpr int PieceStep(int x16, int k16) {
    return kKMajor ? (x16 * 16 * kPitch + k16 * 16) * 2 : (k16 * 16 * kPitch + x16 * 16) * 2;
  }
};

// Loads four 8 x 8 b16 matrices; lanes 8q..8q+7 address the rows of matrix q,
// which lands in r[q]. Plain: lane l holds elements (l / 4, 2 (l % 4) + {0, 1})
// of each matrix as stored. .trans: it holds (2 (l % 4) + {0, 1}, l / 4), i.e.
// the same position of the transposed matrix.
template <bool kTrans>
__device__ __forceinline__ void LoadMatrices(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                             uint32_t& r3, uint32_t address) {
  // volatile: the compiler cannot see that cp.async wrote what this reads,
  // so it must not move the load across the barriers.
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address));
  }
}

// c += a (16 x 16, row-major) * b (16 x 8, column-major), float accumulators.
// With g = lane / 4, t = lane % 4, each register holding two consecutive k
// (or columns): a0 (row g, k 2t), a1 (row g + 8, k 2t), a2 (row g, k 2t + 8),
// a3 (row g + 8, k 2t + 8); b0 (k 2t, col g), b1 (k 2t + 8, col g);
// c0, c1 (row g, cols 2t, 2t + 1), c2, c3 (row g + 8, same cols).
template <class In>
__device__ __forceinline__ void Mma16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1) {
  if constexpr (std::is_same_v<In, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<In, __nv_bfloat16>, "mma.sync takes float16 or bfloat16");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The first `elems` (0..8) of src, zero-padded to 8, as one 16-byte shared
// store: the fallback for rows cp.async cannot copy (not 16-byte aligned).
template <class In>
__device__ __forceinline__ void CopyChunkSync(unsigned char* dst, const In* src, int elems) {
  static_assert(sizeof(In) == 2, "chunks are 8 two-byte elements");
  const auto* bits = reinterpret_cast<const unsigned short*>(src);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t lo = 2 * e < elems ? bits[2 * e] : 0u;
    const uint32_t hi = 2 * e + 1 < elems ? bits[2 * e + 1] : 0u;
    w[e] = lo | hi << 16;  // element 2e at the lower address
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Issues one operand's K slabs, in order, into MmaTile stages. The stored
// matrix has element (x, k) at Tile::kKMajor ? base[x * ld + k] : base[k * ld + x].
// A thread copies kCopies 16-byte chunks per slab, all in the same column of
// the stored tile, kRowStep rows apart, so it keeps one running pointer and
// the few facts about the matrix edge that do not change along K.
template <class In, class Tile, int kThreads, bool kVector>
class MmaSlabCopier {
  static constexpr int kChunksPerRow = (Tile::kKMajor ? Tile::kSlab : Tile::kX) / 8;
  static constexpr int kCopies = Tile::kRows * kChunksPerRow / kThreads;
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static_assert(kThreads % kChunksPerRow == 0 && kCopies * kRowStep == Tile::kRows,
                "slab must split evenly over the threads");

 public:
  __device__ __forceinline__ MmaSlabCopier(const In* base, int64_t ld, int64_t x_limit,
                                           int64_t x0) {
    const int row = threadIdx.x / kChunksPerRow, col = threadIdx.x % kChunksPerRow * 8;
    dst_ = (row * Tile::kPitch + col) * 2;
    if constexpr (Tile::kKMajor) {  // row = x, col = k
      const int64_t x_left = x_limit - x0 - row;
#pragma unroll
      for (int i = 0; i < kCopies; ++i)
        x_inside_ |= static_cast<unsigned>(x_left > i * kRowStep) << i;
      src_ = base + (x0 + row) * ld + col;
      first_k_ = col;
    } else {  // row = k, col = x; the elements of x inside do not change along K
      x_elems_ = static_cast<int>(min(max(x_limit - x0 - col, int64_t{0}), int64_t{8}));
      src_ = base + row * ld + x0 + col;
      first_k_ = row;
    }
  }

  // Copies the next slab into `tile`. k_left (> 0): K from the slab's first k
  // to the matrix edge. A copy of nothing gets `safe` (the operand's 16-byte
  // aligned first element) as its source, so no address outside the matrix
  // is ever handed to cp.async.
  __device__ __forceinline__ void IssueNext(unsigned char* tile, int64_t k_left, int64_t ld,
                                            const In* safe) {
    // K from this thread's first k to the edge, capped so it fits an int;
    // > -kSlab since k_left > 0.
    constexpr int kCap = Tile::kKMajor ? 8 : Tile::kSlab;
    const int room = static_cast<int>(min(k_left - first_k_, int64_t{kCap}));
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      int elems;  // of the chunk's 8, inside the matrix
      if constexpr (Tile::kKMajor) elems = (x_inside_ >> i & 1) ? max(room, 0) : 0;
      else elems = room > i * kRowStep ? x_elems_ : 0;
      const In* src = src_ + i * kRowStep * ld;
      unsigned char* dst = tile + dst_ + i * kRowStep * Tile::kPitch * 2;
      if constexpr (kVector) CopyAsync<16>(dst, elems > 0 ? src : safe, elems * 2);
      else CopyChunkSync(dst, src, elems);
    }
    if constexpr (Tile::kKMajor) src_ += Tile::kSlab;  // along the rows
    else src_ += Tile::kSlab * ld;                      // down the rows
  }

 private:
  const In* src_;          // this thread's first chunk of the next slab
  int dst_;                // its byte offset within a stage's tile
  int first_k_;            // its first k within a slab
  unsigned x_inside_ = 0;  // K-major: bit i, copy i's row is inside the matrix
  int x_elems_ = 0;        // MN-major: elements of its chunks inside the matrix
};

// acc += the warp's share of one slab. Per k16 step, one ldmatrix.x4 per m16
// tile of A and per pair of n8 tiles of B, then kTilesM x kTilesN mma.
// a_frag and b_frag: this lane's ldmatrix rows for the warp's first pieces.
template <class Cfg, class TileA, class TileB, class In>
__device__ __forceinline__ void MmaSlab(float (&acc)[Cfg::kTilesM][Cfg::kTilesN][4],
                                        uint32_t a_frag, uint32_t b_frag) {
#pragma unroll
  for (int s = 0; s < Cfg::kSlab / 16; ++s) {
    uint32_t af[Cfg::kTilesM][4], bf[Cfg::kTilesN][2];
#pragma unroll
    for (int i = 0; i < Cfg::kTilesM; ++i)
      LoadMatrices<!TileA::kKMajor>(af[i][0], af[i][1], af[i][2], af[i][3],
                                    a_frag + TileA::PieceStep(i, s));
#pragma unroll
    for (int j = 0; j < Cfg::kTilesN; j += 2)
      LoadMatrices<!TileB::kKMajor>(bf[j][0], bf[j][1], bf[j + 1][0], bf[j + 1][1],
                                    b_frag + TileB::PieceStep(j / 2, s));
#pragma unroll
    for (int i = 0; i < Cfg::kTilesM; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::kTilesN; ++j) Mma16x8x16<In>(acc[i][j], af[i], bf[j][0], bf[j][1]);
  }
}

// Two adjacent outputs as one store; p is 2-element aligned.
template <class Out>
__device__ __forceinline__ void StorePair(Out* p, float v0, float v1) {
  if constexpr (std::is_same_v<Out, __half>) {
    *reinterpret_cast<__half2*>(p) =
        __halves2half2(FromAccumulator<__half>(v0), FromAccumulator<__half>(v1));
  } else if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __halves2bfloat162(
        FromAccumulator<__nv_bfloat16>(v0), FromAccumulator<__nv_bfloat16>(v1));
  } else {
    static_assert(std::is_same_v<Out, float>, "mma results are float, bfloat16 or float16");
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  }
}

// Writes the warp's accumulators (the c layout of Mma16x8x16) to `out`, the
// output matrix of this batch, clipped to it. pairs: every row of out starts
// 2-element aligned, so the two columns a lane holds (2t, 2t + 1: even) can
// be stored at once when both are inside.
template <class Cfg, class Out>
__device__ __forceinline__ void StoreWarpTile(const float (&acc)[Cfg::kTilesM][Cfg::kTilesN][4],
                                              Out* out, const MatmulDims& dims, int64_t row0,
                                              int64_t col0, bool pairs) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < Cfg::kTilesM; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // c0, c1 at row g; c2, c3 at row g + 8
      const int64_t row = row0 + i * 16 + h * 8 + lane / 4;
      if (row >= dims.m) continue;
      Out* out_row = out + row * dims.ldc;
#pragma unroll
      for (int j = 0; j < Cfg::kTilesN; ++j) {
        const int64_t col = col0 + j * 8 + lane % 4 * 2;
        const float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
        if (pairs && col + 1 < dims.n) {
          StorePair(out_row + col, v0, v1);
        } else {
          if (col < dims.n) out_row[col] = FromAccumulator<Out>(v0);
          if (col + 1 < dims.n) out_row[col + 1] = FromAccumulator<Out>(v1);
        }
      }
    }
  }
}

template <class Cfg, bool kAKMajor, bool kBKMajor>
__host__ __device__ constexpr int MmaStageBytes() {
  return MmaTile<Cfg::kBlockM, Cfg::kSlab, kAKMajor>::kBytes +
         MmaTile<Cfg::kBlockN, Cfg::kSlab, kBKMajor>::kBytes;
}

// kAKMajor: A stored (m, k), i.e. not transposed; kBKMajor: B stored (n, k),
// i.e. transposed. kVector: both operands' rows are 16-byte aligned.
// Dynamic shared memory: kStages x (A tile, B tile).
template <class Cfg, bool kAKMajor, bool kBKMajor, bool kVector, class In, class Out>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    MmaSyncMatmul(MatmulDims dims, const In* __restrict__ a, const In* __restrict__ b,
                  Out* __restrict__ out, bool pair_stores) {
  using TileA = MmaTile<Cfg::kBlockM, Cfg::kSlab, kAKMajor>;
  using TileB = MmaTile<Cfg::kBlockN, Cfg::kSlab, kBKMajor>;
  constexpr int kStageBytes = MmaStageBytes<Cfg, kAKMajor, kBKMajor>();
  extern __shared__ __align__(16) unsigned char stages[];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / Cfg::kWarpsN * Cfg::kWarpM, warp_n = warp % Cfg::kWarpsN * Cfg::kWarpN;
  const int q = lane / 8;  // the ldmatrix.x4 matrix this lane addresses a row of
  // A: matrices q = 0..3 are a0..a3 = (m 0-7, k 0-7), (m 8-15, k 0-7),
  // (m 0-7, k 8-15), (m 8-15, k 8-15): m half q % 2, k half q / 2. K-major,
  // plain ldmatrix gives lane l (m g, k 2t..2t+1) of each; MN-major ([k][m]),
  // .trans gives (k 2t..2t+1, m g) as stored, the same elements.
  const uint32_t a_frag =
      SharedAddress(stages) + TileA::FragmentOffset(lane, warp_m, q % 2, q / 2);
  // B: matrices q = 0..3 are b0, b1 of n tile j, b0, b1 of n tile j + 1 =
  // (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): n half
  // q / 2, k half q % 2. K-major ([n][k]), plain gives lane l (n g, k 2t..2t+1)
  // = b's (k 2t..2t+1, col g); MN-major ([k][n]), .trans gives the same.
  const uint32_t b_frag = SharedAddress(stages) + TileA::kBytes +
                          TileB::FragmentOffset(lane, warp_n, q / 2, q % 2);

  const TileOrder<Cfg::kBlockM, Cfg::kBlockN> order(dims);
  const int64_t slabs = (dims.k + Cfg::kSlab - 1) / Cfg::kSlab;

  for (int64_t tile = blockIdx.x; tile < order.count; tile += gridDim.x) {
    int64_t batch, row0, col0;
    order.Locate(tile, batch, row0, col0);
    MmaSlabCopier<In, TileA, Cfg::kThreads, kVector> copy_a(a + batch * dims.a_batch_stride,
                                                            dims.lda, dims.m, row0);
    MmaSlabCopier<In, TileB, Cfg::kThreads, kVector> copy_b(b + batch * dims.b_batch_stride,
                                                            dims.ldb, dims.n, col0);
    auto issue = [&](int64_t slab, int stage) {
      // Every thread commits a group per slab, empty past the last one,
      // so the wait below always counts the same number of groups.
      if (slab < slabs) {  // slabs are issued in order
        const int64_t k_left = dims.k - slab * Cfg::kSlab;
        unsigned char* at = stages + stage * kStageBytes;
        copy_a.IssueNext(at, k_left, dims.lda, a);
        copy_b.IssueNext(at + TileA::kBytes, k_left, dims.ldb, b);
      }
      CommitCopies();
    };

    float acc[Cfg::kTilesM][Cfg::kTilesN][4] = {};
#pragma unroll
    for (int s = 0; s < Cfg::kStages - 1; ++s) issue(s, s);
    int read = 0;  // slab % kStages, without 64-bit division
    for (int64_t slab = 0; slab < slabs; ++slab) {
      WaitCopies<Cfg::kStages - 2>();  // this thread's copies of `slab` have landed
      // Everyone's copies of `slab` are visible, and everyone is done
      // reading slab - 1, whose stage the next issue overwrites.
      __syncthreads();
      issue(slab + Cfg::kStages - 1, read == 0 ? Cfg::kStages - 1 : read - 1);
      MmaSlab<Cfg, TileA, TileB, In>(acc, a_frag + read * kStageBytes,
                                     b_frag + read * kStageBytes);
      read = read == Cfg::kStages - 1 ? 0 : read + 1;
    }
    StoreWarpTile<Cfg>(acc, out + batch * dims.out_batch_stride, dims, row0 + warp_m,
                       col0 + warp_n, pair_stores);
    __syncthreads();  // the next tile's first copies overwrite stages still being read
  }
}

// 128 x 128 blocks of 2 x 2 warps of 64 x 64, four 32-deep slabs resident
// (80 KB at most, two blocks per SM on A100 and H100); 64 x 64 blocks of 2 x 2
// warps of 32 x 32 (40 KB) when the large ones would not fill the GPU twice.
using MmaLarge = MmaConfig<2, 2, 64, 64, 32, 4, 2>;
using MmaSmall = MmaConfig<2, 2, 32, 32, 32, 4, 4>;

inline bool MmaUsesLargeBlocks(const MatmulDims& dims, int multiprocessors) {
  return TileOrder<MmaLarge::kBlockM, MmaLarge::kBlockN>(dims).count >= 2 * multiprocessors;
}

// Whether every stored row of an operand that the kernel reads starts 16-byte
// aligned, so its slabs can move as 8-element cp.async copies. The stride
// between rows (or batches) is never applied when there is only one.
template <class In>
bool ChunkAligned(const In* p, int64_t ld, int64_t rows, int64_t batch_stride, int64_t batch) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (rows == 1 || ld % 8 == 0) &&
         (batch == 1 || batch_stride % 8 == 0);
}

// Calls f(std::true_type{}) or f(std::false_type{}): a run-time flag picks a
// template instantiation.
template <class F>
cudaError_t WithMmaFlag(bool flag, F&& f) {
  return flag ? f(std::true_type{}) : f(std::false_type{});
}

template <class Cfg, bool kAKMajor, bool kBKMajor, bool kVector, class In, class Out>
cudaError_t LaunchMmaSyncWith(const MatmulDims& dims, const In* a, const In* b, Out* out,
                              cudaStream_t stream, bool pair_stores) {
  constexpr auto kKernel = &MmaSyncMatmul<Cfg, kAKMajor, kBKMajor, kVector, In, Out>;
  constexpr int kBytes = Cfg::kStages * MmaStageBytes<Cfg, kAKMajor, kBKMajor>();
  if (const cudaError_t err = AllowSharedMemory<kKernel>(kBytes); err != cudaSuccess) return err;
  const dim3 grid = TileOrder<Cfg::kBlockM, Cfg::kBlockN>(dims).Grid();
  kKernel<<<grid, Cfg::kThreads, kBytes, stream>>>(dims, a, b, out, pair_stores);
  return cudaGetLastError();
}

// In: __half or __nv_bfloat16. Out: __half, __nv_bfloat16 or float.
// Accumulates in float. Needs sm_80+; k > 0 and a non-empty output.
template <class In, class Out>
cudaError_t LaunchMmaSync(const MatmulDims& dims, const In* a, const In* b, Out* out,
                          cudaStream_t stream, int multiprocessors) {
  const bool vector =
      ChunkAligned(a, dims.lda, dims.transpose_a ? dims.k : dims.m, dims.a_batch_stride,
                   dims.batch) &&
      ChunkAligned(b, dims.ldb, dims.transpose_b ? dims.n : dims.k, dims.b_batch_stride,
                   dims.batch);
  const bool pairs = reinterpret_cast<uintptr_t>(out) % (2 * sizeof(Out)) == 0 &&
                     (dims.m == 1 || dims.ldc % 2 == 0) &&
                     (dims.batch == 1 || dims.out_batch_stride % 2 == 0);
  return WithMmaFlag(MmaUsesLargeBlocks(dims, multiprocessors), [&](auto large) {
    using Cfg = std::conditional_t<decltype(large)::value, MmaLarge, MmaSmall>;
    return WithMmaFlag(!dims.transpose_a, [&](auto a_k_major) {
      return WithMmaFlag(dims.transpose_b, [&](auto b_k_major) {
        return WithMmaFlag(vector, [&](auto vector_copies) {
          return LaunchMmaSyncWith<Cfg, decltype(a_k_major)::value, decltype(b_k_major)::value,
                                   decltype(vector_copies)::value>(dims, a, b, out, stream,
                                                                   pairs);
        });
      });
    });
  });
}

}  // namespace jax_tiled::cuda
