// The interface between the CPU handler (matmul.cc) and the kernels compiled
// once per instruction set (kernel_<isa>.cc, each with its own compiler flags).
//
// Kept free of XLA and standard-library templates on purpose: anything inline
// that an ISA translation unit instantiates is emitted there with that unit's
// flags, and the linker keeps one copy of it for the whole module, which could
// put AVX-512 instructions on the path of a machine without them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_tiled::cpu {

enum class Dtype : int32_t { kF16 = 0, kBF16 = 1, kF32 = 2, kF64 = 3 };

// A batched product out[b] = op(A[b]) @ op(B[b]), as MatmulProblem describes,
// with element strides already resolved from the transpose flags.
struct Operands {
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  Dtype in = Dtype::kF32, out_type = Dtype::kF32;
  int64_t m = 0, n = 0, k = 0;
  int64_t a_batch_stride = 0, b_batch_stride = 0, out_batch_stride = 0;
  int64_t a_row = 0, a_depth = 0;  // op(A)(i, p) is a[i * a_row + p * a_depth]
  int64_t b_col = 0, b_depth = 0;  // op(B)(p, j) is b[p * b_depth + j * b_col]
  int64_t ldc = 0;                 // out(i, j) is out[i * ldc + j]
};

// One output tile, computed over the whole depth by one thread: rows
// [i0, i0 + rows) and columns [j0, j0 + cols) of batch entry `batch`.
struct Tile { int64_t batch = 0, i0 = 0, rows = 0, j0 = 0, cols = 0; };

// The blocking of one accumulator type: register block mr x nr, depth slab kc,
// and nc, the columns of the packed B block that stays in L2.
struct Geometry { int64_t mr, nr, kc, nc; };

struct IsaKernels {
  const char* name;
  Geometry f32, f64;  // by accumulator type
  // Bytes of 64-byte-aligned scratch one thread needs for any tile of at most
  // rows x cols of this problem.
  size_t (*scratch_bytes)(const Operands& op, int64_t rows, int64_t cols);
  // Computes one tile, overwriting it: no state, so tiles run on any thread in
  // any order and the result does not depend on which.
  void (*run_tile)(const Operands& op, const Tile& tile, void* scratch);
};

const IsaKernels& PortableKernels();
#if defined(__x86_64__) || defined(_M_X64)
const IsaKernels& Avx2Kernels();
const IsaKernels& Avx512Kernels();
#endif
// Kernels that multiply bfloat16 as stored, where the compiler can build them
// (CMakeLists.txt defines the macros). They take bfloat16 inputs into a
// float32, bfloat16 or float16 result only; matmul.cc routes the rest.
#if defined(JAX_TILED_HAVE_AVX512_BF16)
const IsaKernels& Avx512Bf16Kernels();  // vdpbf16ps
#endif
#if defined(JAX_TILED_HAVE_AMX)
const IsaKernels& AmxKernels();  // AMX-BF16 tiles
#endif

}  // namespace jax_tiled::cpu
