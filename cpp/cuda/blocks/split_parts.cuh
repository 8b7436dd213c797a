// An emulation preset's split of a float32 operand into bfloat16 parts, laid
// along K chunk by chunk, in one pass over the operand (jax_tiled/_presets.py,
// Split and split_operand, define the layout and the rounding; this is the
// same arithmetic on the GPU, where XLA's fusions of it moved the bytes at
// half the memory's speed: NOTES.md, "BF16_BF16_F32_X3: chunk groups").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace jax_tiled::cuda {

// What each term of the layout takes from this operand (the handler's
// "terms" attribute): hi as it is (the hi x hi term, which keeps a non-finite
// x), hi with a non-finite x as zero (the other terms with hi), or lo.
enum class SplitPart : int32_t { kHi = 0, kFiniteHi = 1, kLo = 2 };
inline constexpr int kMaxSplitTerms = 4;

struct SplitLayout {
  int64_t rows;  // the operand's (batch x rows, cols), row-major
  int64_t cols;
  int64_t k;        // K: cols where k_minor, else the rows of one batch entry
  bool k_minor;     // K runs along a row (a, or b transposed)
  int chunk_shift;  // K per chunk: 1 << chunk_shift
  int terms;        // products of parts laid in each chunk
  uint32_t parts;   // term t's SplitPart in bits 2t and 2t + 1 (no array: the
                    // kernel would index it in local memory)
  __host__ __device__ SplitPart Part(int t) const {
    return static_cast<SplitPart>((parts >> (2 * t)) & 3u);
  }
};

// bfloat16's bits of x's parts, as _presets._round_part makes them: hi to
// nearest even (a finite x past bfloat16's largest to the largest), lo the
// rest to nearest (toward zero past the largest); a non-finite x keeps hi and
// has lo zero.
struct Bf16Parts { uint16_t hi, finite_hi, lo; };

__device__ inline Bf16Parts SplitIntoBf16(float x) {
  const uint32_t u = __float_as_uint(x);
  const bool finite = (u & 0x7F800000u) != 0x7F800000u;
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  if ((r & 0x7FFFu) >= 0x7F80u) r = ((u >> 16) & 0x8000u) | 0x7F7Fu;
  const uint32_t v = __float_as_uint(x - __uint_as_float(r << 16));
  const bool past_largest = (u & 0x7FFFFFFFu) > 0x7F7F0000u;
  const uint32_t lo = past_largest ? v >> 16 : (v + 0x7FFFu + ((v >> 16) & 1u)) >> 16;
  // A non-finite x as hi: its top bits, NaN kept quiet.
  const uint32_t special = (u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u);
  return {static_cast<uint16_t>(finite ? r : special), static_cast<uint16_t>(finite ? r : 0u),
          static_cast<uint16_t>(finite ? lo : 0u)};
}

__device__ inline uint16_t PartOf(const Bf16Parts& p, SplitPart which) {
  return which == SplitPart::kHi ? p.hi : which == SplitPart::kFiniteHi ? p.finite_hi : p.lo;
}

// Where element k of K lands along the laid K for term t: whole chunks hold
// every term's chunk in turn; the last, shorter chunk likewise. Chunks are a
// power of two wide (the handler checks), so no division.
__device__ inline int64_t LaidPosition(int64_t k, int t, const SplitLayout& s) {
  const int64_t chunk = int64_t{1} << s.chunk_shift, whole = s.k & ~(chunk - 1);
  if (k < whole) {
    const int64_t c = k >> s.chunk_shift;
    return ((c * s.terms + t) << s.chunk_shift) + (k - (c << s.chunk_shift));
  }
  return whole * s.terms + t * (s.k - whole) + (k - whole);
}

// kVec floats from x (16-byte loads where kVec >= 4), read once: past L1.
template <int kVec>
__device__ __forceinline__ void LoadFloats(const float* x, float (&v)[kVec]) {
  if constexpr (kVec >= 4) {
#pragma unroll
    for (int i = 0; i < kVec; i += 4) {
      const float4 q = __ldcs(reinterpret_cast<const float4*>(x + i));
      v[i] = q.x, v[i + 1] = q.y, v[i + 2] = q.z, v[i + 3] = q.w;
    }
  } else if constexpr (kVec == 2) {
    const float2 q = __ldcs(reinterpret_cast<const float2*>(x));
    v[0] = q.x, v[1] = q.y;
  } else {
    v[0] = __ldcs(x);
  }
}

// kVec bfloat16 bits to out in one store (16 bytes at kVec = 8).
template <int kVec>
__device__ __forceinline__ void StoreHalves(uint16_t* out, const uint16_t (&h)[kVec]) {
  using Word = std::conditional_t<
      kVec == 8, uint4,
      std::conditional_t<kVec == 4, uint2, std::conditional_t<kVec == 2, uint32_t, uint16_t>>>;
  Word word;
  memcpy(&word, h, sizeof(word));
  *reinterpret_cast<Word*>(out) = word;
}

// Rows a thread takes at a time: their loads are all issued before the first
// row's parts are stored, so that a thread keeps kSplitRows x kVec x 4 bytes
// in flight, and its index arithmetic is shared by kSplitRows x kVec
// elements (the version before did it for every four: NOTES.md, "A split of
// our own").
inline constexpr int kSplitRows = 4;

// A thread takes kVec neighbouring columns (kVec divides the columns and,
// where K runs along a row, the chunk: a group never straddles a chunk, as
// chunks and the last chunk's width are multiples of it) of kSplitRows rows
// at a time; threadIdx.x walks the columns, threadIdx.y and the grid's y the
// rows (grid-stride), so that narrow operands still fill the blocks.
template <int kVec>
__global__ void SplitIntoLaidParts(const float* __restrict__ x, uint16_t* __restrict__ out,
                                   SplitLayout s) {
  const int64_t col = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (col >= s.cols) return;
  // k_minor: out is (rows, cols x terms), and where this thread's columns land
  // in a row is the same for every row.
  // (The term loops run to kMaxSplitTerms, so that this array's indices are
  // constants and it stays in registers.)
  int64_t laid_in_row[kMaxSplitTerms] = {};
#pragma unroll
  for (int t = 0; t < kMaxSplitTerms; ++t)
    if (s.k_minor && t < s.terms) laid_in_row[t] = LaidPosition(col, t, s);
  const int64_t stride = int64_t{gridDim.y} * blockDim.y * kSplitRows;
  for (int64_t first = (int64_t{blockIdx.y} * blockDim.y + threadIdx.y) * kSplitRows;
       first < s.rows; first += stride) {
    float values[kSplitRows][kVec];
#pragma unroll
    for (int r = 0; r < kSplitRows; ++r)
      if (first + r < s.rows) LoadFloats<kVec>(x + (first + r) * s.cols + col, values[r]);
    // Else out is (batch, K x terms, cols): row first + r is element k of K in
    // its batch entry, found by one division for the group.
    int64_t batch = 0, k = 0;
    if (!s.k_minor) batch = first / s.k, k = first - batch * s.k;
#pragma unroll
    for (int r = 0; r < kSplitRows; ++r, ++k) {
      if (first + r >= s.rows) break;
      while (k >= s.k) k -= s.k, ++batch;  // K shorter than the group: more than one step
      Bf16Parts parts[kVec];
#pragma unroll
      for (int v = 0; v < kVec; ++v) parts[v] = SplitIntoBf16(values[r][v]);
#pragma unroll
      for (int t = 0; t < kMaxSplitTerms; ++t) {
        if (t >= s.terms) break;
        const int64_t at = s.k_minor
                               ? (first + r) * s.cols * s.terms + laid_in_row[t]
                               : (batch * s.k * s.terms + LaidPosition(k, t, s)) * s.cols + col;
        uint16_t halves[kVec];
#pragma unroll
        for (int v = 0; v < kVec; ++v) halves[v] = PartOf(parts[v], s.Part(t));
        StoreHalves<kVec>(out + at, halves);
      }
    }
  }
}

inline cudaError_t LaunchSplitIntoLaidParts(const float* x, uint16_t* out, const SplitLayout& s,
                                            cudaStream_t stream) {
  if (s.rows == 0 || s.cols == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // kVec divides the columns and, where K runs along a row, the chunk: a
  // thread's group then lies in one chunk.
  const int64_t chunk = int64_t{1} << s.chunk_shift;
  const auto divides = [&](int v) { return s.cols % v == 0 && (!s.k_minor || chunk % v == 0); };
  const int vec = divides(8) ? 8 : divides(4) ? 4 : divides(2) ? 2 : 1;
  // As many threads along a row as its groups (a power of two, at least a
  // warp), the rest of the block along the rows.
  const int64_t groups = s.cols / vec;
  int across = 32;
  while (across < groups && across < kThreads) across *= 2;
  const dim3 block(across, kThreads / across);
  const int64_t row_groups = (s.rows + kSplitRows - 1) / kSplitRows;
  const dim3 grid(
      static_cast<unsigned>((groups + across - 1) / across),
      static_cast<unsigned>(std::min<int64_t>((row_groups + block.y - 1) / block.y, 65535)));
  if (vec == 8) SplitIntoLaidParts<8><<<grid, block, 0, stream>>>(x, out, s);
  else if (vec == 4) SplitIntoLaidParts<4><<<grid, block, 0, stream>>>(x, out, s);
  else if (vec == 2) SplitIntoLaidParts<2><<<grid, block, 0, stream>>>(x, out, s);
  else SplitIntoLaidParts<1><<<grid, block, 0, stream>>>(x, out, s);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
