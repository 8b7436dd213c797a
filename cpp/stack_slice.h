// StackSlice: an operand read in place as one slice of a stacked array.
//
// `ws[i]` in a `lax.scan` over stacked weights is a dynamic slice, which XLA
// would copy before a custom call; the lowering passes the stack and the
// scalar `i` instead (jax_tiled/_lowering.py, `_stacked_source`). The index
// lives in the operands' memory (device memory on a GPU, where a kernel
// reads it), so the host never waits for it, and a CUDA graph replays the
// call for any step. Plain C++ for the CPU side; kernels call Offset() on the
// device.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_TILED_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAX_TILED_HOST_DEVICE inline
#endif

namespace jax_tiled {

struct StackSlice {
  const int32_t* index = nullptr;  // null: the operand is the buffer as given
  int64_t count = 1;               // slices in the stack
  int64_t stride = 0;              // elements from one slice to the next

  JAX_TILED_HOST_DEVICE bool stacked() const { return index != nullptr; }

  // The chosen slice: the index clamped to [0, count), as XLA clamps a
  // dynamic slice's start. Reads the index: call it where the index lives.
  JAX_TILED_HOST_DEVICE int64_t Chosen() const {
    if (index == nullptr) return 0;
    const int64_t i = *index;
    return i < 0 ? 0 : i >= count ? count - 1 : i;
  }

  // Elements from the stack's start to the chosen slice.
  JAX_TILED_HOST_DEVICE int64_t Offset() const { return stride * Chosen(); }
};

}  // namespace jax_tiled
