// An emulation preset's split of a float32 operand into bfloat16 parts, laid
// along K chunk by chunk, in one pass over the operand (jax_tiled/_presets.py,
// Split and split_operand, define the layout and the rounding; this is the
// same arithmetic on the GPU, where XLA's fusions of it moved the bytes at
// half the memory's speed: NOTES.md, "BF16_BF16_F32_X3: chunk groups").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace jax_tiled::cuda {

// What each term of the layout takes from this operand (the handler's
// "terms" attribute): hi as it is (the hi x hi term, which keeps a non-finite
// x), hi with a non-finite x as zero (the other terms with hi), or lo.
enum class SplitPart : int32_t { kHi = 0, kFiniteHi = 1, kLo = 2 };
inline constexpr int kMaxSplitTerms = 4;

struct SplitLayout {
  int64_t rows;  // the operand's (batch x rows, cols), row-major
  int64_t cols;
  int64_t k;       // K: cols where k_minor, else the rows of one batch entry
  bool k_minor;    // K runs along a row (a, or b transposed)
  int64_t chunk;   // K per chunk
  int terms;       // products of parts laid in each chunk
  uint32_t parts;  // term t's SplitPart in bits 2t and 2t + 1 (no array: the
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
// every term's chunk in turn; the last, shorter chunk likewise.
__device__ inline int64_t LaidPosition(int64_t k, int t, const SplitLayout& s) {
  const int64_t whole = s.k - s.k % s.chunk;
  if (k < whole) {
    const int64_t c = k / s.chunk;
    return (c * s.terms + t) * s.chunk + (k - c * s.chunk);
  }
  const int64_t width = s.k - whole;
  return whole * s.terms + t * width + (k - whole);
}

// kVec neighbouring elements of a row a thread (2 where the columns are even:
// a pair never straddles a chunk, since chunks and rows are even), one
// 32-bit load and store of each term where kVec is 2.
template <int kVec>
__global__ void SplitIntoLaidParts(const float* __restrict__ x, uint16_t* __restrict__ out,
                                   SplitLayout s) {
  const int64_t groups = s.rows * s.cols / kVec;
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups;
       g += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = g * kVec, row = i / s.cols, col = i % s.cols;
    Bf16Parts parts[kVec];
    if constexpr (kVec == 2) {
      const float2 pair = *reinterpret_cast<const float2*>(x + i);
      parts[0] = SplitIntoBf16(pair.x), parts[1] = SplitIntoBf16(pair.y);
    } else {
      parts[0] = SplitIntoBf16(x[i]);
    }
    // k_minor: out is (rows, cols x terms); else (batch, K x terms, cols).
    const int64_t batch = s.k_minor ? 0 : row / s.k, k = s.k_minor ? col : row % s.k;
    for (int t = 0; t < s.terms; ++t) {
      const int64_t laid = LaidPosition(k, t, s);
      const int64_t at =
          s.k_minor ? row * s.cols * s.terms + laid : (batch * s.k * s.terms + laid) * s.cols + col;
      if constexpr (kVec == 2) {
        const uint32_t word =
            PartOf(parts[0], s.Part(t)) | (uint32_t{PartOf(parts[1], s.Part(t))} << 16);
        *reinterpret_cast<uint32_t*>(out + at) = word;
      } else {
        out[at] = PartOf(parts[0], s.Part(t));
      }
    }
  }
}

inline cudaError_t LaunchSplitIntoLaidParts(const float* x, uint16_t* out, const SplitLayout& s,
                                            int multiprocessors, cudaStream_t stream) {
  const bool pairs = s.cols % 2 == 0;
  const int64_t groups = s.rows * s.cols / (pairs ? 2 : 1);
  if (groups == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // A grid-stride loop over a few waves of blocks.
  const int64_t blocks =
      std::min<int64_t>((groups + kThreads - 1) / kThreads, int64_t{multiprocessors} * 16);
  if (pairs)
    SplitIntoLaidParts<2><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, out, s);
  else SplitIntoLaidParts<1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, out, s);
  return cudaGetLastError();
}

}  // namespace jax_tiled::cuda
