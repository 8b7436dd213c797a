// CUDA handler: validate the problem, pick a rung, launch it on XLA's stream.
//
// The execute stage neither synchronises with the host nor allocates, so the
// handler is safe to capture into a CUDA graph (the command-buffer trait).

#include "cuda/matmul.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <optional>
#include <string>
#include <string_view>

#include "cuda/kernels/register_blocked.cuh"
#include "cuda/kernels/simt_warptiled.cuh"
#include "cuda/kernels/smem_tiled.cuh"
#include "ffi_common.h"
#include "problem.h"

namespace jax_tiled::cuda {
namespace {

template <ffi::DataType T> struct StorageOf;
template <> struct StorageOf<ffi::DataType::F16> { using type = __half; };
template <> struct StorageOf<ffi::DataType::BF16> { using type = __nv_bfloat16; };
template <> struct StorageOf<ffi::DataType::F32> { using type = float; };
template <> struct StorageOf<ffi::DataType::F64> { using type = double; };
template <ffi::DataType T> using Storage = typename StorageOf<T>::type;

enum class Rung { kAuto, kSmem32, kSmem16, kSmemRacy, kRegisterBlocked, kWarpTiled };

std::optional<Rung> ParseKernel(std::string_view name) {
  if (name == "auto") return Rung::kAuto;
  if (name == "smem") return Rung::kSmem32;
  if (name == "regblock") return Rung::kRegisterBlocked;
  if (name == "warptile") return Rung::kWarpTiled;
  if (name == "smem16") return Rung::kSmem16;
  // Deliberately missing from kKernelNames: this is "smem" without its second
  // barrier, a known data race that the compute-sanitizer racecheck test runs
  // to prove the tool would catch one. Its results are not to be trusted, so
  // jax_tiled.kernels() never offers it and "auto" never picks it.
  if (name == "smem_racy_for_testing") return Rung::kSmemRacy;
  return std::nullopt;
}

MatmulDims ToDims(const MatmulProblem& p) {
  return {p.batch, p.m, p.n, p.k,
          p.a_batch_stride, p.b_batch_stride, p.out_batch_stride,
          p.lda(), p.ldb(), p.ldc(),
          p.transpose_a, p.transpose_b};
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("tiled_matmul: ") + what + ": " +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// Multiprocessors of the current device, read once per device: the launch
// path must not pay for a driver query on every call.
int MultiprocessorCount() {
  static std::atomic<int> cached[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  int count = cached[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      count = 132;
    cached[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// "auto": the fastest rung measured for the dtype and shape (NOTES.md).
// float64 would spill the warp-tiled rung's 64 double accumulators, and with
// fewer than 64 rows or columns its 64-wide tiles are mostly padding (an H200
// ran 16 x 8192 x 8192 at 2.0 TFLOP/s on it, 4.2 on smem16).
template <class In>
Rung ChooseRung(Rung requested, const MatmulDims& d) {
  if (requested != Rung::kAuto) return requested;
  if (std::is_same_v<In, double> || d.m < 64 || d.n < 64) return Rung::kSmem16;
  return Rung::kWarpTiled;
}

template <class In, class Out, class Acc>
cudaError_t Launch(Rung rung, const MatmulDims& d, const In* a, const In* b, Out* out,
                   cudaStream_t stream) {
  switch (ChooseRung<In>(rung, d)) {
    case Rung::kSmem32: return LaunchSmemTiled<32, In, Out, Acc>(d, a, b, out, stream);
    case Rung::kSmem16: return LaunchSmemTiled<16, In, Out, Acc>(d, a, b, out, stream);
    case Rung::kSmemRacy:
      return LaunchSmemTiled<32, In, Out, Acc, /*kSkipSecondSync=*/true>(d, a, b, out, stream);
    case Rung::kRegisterBlocked: return LaunchRegisterBlocked<In, Out, Acc>(d, a, b, out, stream);
    case Rung::kWarpTiled:
      return LaunchWarpTiled<In, Out, Acc>(d, a, b, out, stream, MultiprocessorCount());
    case Rung::kAuto: break;
  }
  return cudaErrorInvalidValue;
}

ffi::Error MatmulCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Result<ffi::AnyBuffer> out, bool transpose_a, bool transpose_b,
                      int32_t precision, std::string_view kernel) {
  auto problem = MakeMatmulProblem(a, b, *out, transpose_a, transpose_b, precision, kernel);
  if (problem.has_error()) return problem.error();
  const MatmulProblem& p = problem.value();
  const std::optional<Rung> rung = ParseKernel(p.kernel);
  if (!rung) return UnknownKernel("CUDA", p.kernel, kKernelNames);
  if (p.empty_output()) return ffi::Error::Success();
  if (p.k == 0) {  // an empty sum; 0.0 is all-zero bits in every supported dtype
    const cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("zero fill failed", err);
  }
  // The smem rung computes in true fp32 (or fp64) whatever the precision asks;
  // that satisfies DEFAULT and HIGH too, which only permit cheaper arithmetic.
  return VisitDtypes(p, [&](auto in_tag, auto out_tag) {
    using In = Storage<in_tag.value>;
    using Out = Storage<out_tag.value>;
    using Acc = Accumulator<in_tag.value, out_tag.value>;
    const cudaError_t err = Launch<In, Out, Acc>(
        *rung, ToDims(p), static_cast<const In*>(a.untyped_data()),
        static_cast<const In*>(b.untyped_data()), static_cast<Out*>(out->untyped_data()), stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("kernel launch failed", err);
  });
}

}  // namespace
}  // namespace jax_tiled::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxTiledMatmulCuda, jax_tiled::cuda::MatmulCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream: every launch goes here
        .Arg<xla::ffi::AnyBuffer>()     // a: (batch_a, m, k), or (batch_a, k, m) transposed
        .Arg<xla::ffi::AnyBuffer>()     // b: (batch_b, k, n), or (batch_b, n, k) transposed
        .Ret<xla::ffi::AnyBuffer>()     // out: (batch, m, n)
        .Attr<bool>("transpose_a")      // a is stored (batch_a, k, m)
        .Attr<bool>("transpose_b")      // b is stored (batch_b, n, k)
        .Attr<int32_t>("precision")     // 0 DEFAULT, 1 HIGH, 2 HIGHEST: smem is exact fp32 for all
        .Attr<std::string_view>("kernel"),  // "auto" or a name from kKernelNames
    {xla::ffi::Traits::kCmdBufferCompatible});
