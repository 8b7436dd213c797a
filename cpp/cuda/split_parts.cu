// The FFI handler `tiled_split_parts_cuda`: a float32 operand (batch x rows,
// cols) as bfloat16 parts laid along K (blocks/split_parts.cuh), for an
// emulation preset's product of parts on one device (jax_tiled/_lowering.py,
// _lower_split). Stateless; safe to capture into a CUDA graph.

#include "cuda/blocks/split_parts.cuh"

#include <cuda_runtime.h>

#include <string>

#include "cuda/matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_tiled::cuda {
namespace {

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("tiled_split_parts: " + what);
}

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string text = "(";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + ")";
}

ffi::Error SplitPartsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                          bool k_minor, ffi::Span<const int32_t> terms, int32_t chunk) {
  if (x.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::BF16)
    return Invalid("takes float32 into bfloat16");
  const auto in_dims = x.dimensions(), out_dims = out->dimensions();
  if (in_dims.size() != 3 || out_dims.size() != 3)
    return Invalid("takes (batch, rows, cols) operands, got " + Dims(in_dims) + " into " +
                   Dims(out_dims));
  if (terms.size() < 1 || terms.size() > static_cast<size_t>(kMaxSplitTerms))
    return Invalid("takes 1 to " + std::to_string(kMaxSplitTerms) + " terms, got " +
                   std::to_string(terms.size()));
  if (chunk < 1 || (chunk & (chunk - 1)))
    return Invalid("chunk must be a power of two, got " + std::to_string(chunk));
  const int64_t count = static_cast<int64_t>(terms.size());
  const int64_t batch = in_dims[0], rows = in_dims[1], cols = in_dims[2];
  if (out_dims[0] != batch || out_dims[1] != (k_minor ? rows : rows * count) ||
      out_dims[2] != (k_minor ? cols * count : cols))
    return Invalid("the result of " + Dims(in_dims) + " with " + std::to_string(count) +
                   " terms laid along " + (k_minor ? "its rows" : "its columns") + " cannot be " +
                   Dims(out_dims));
  int chunk_shift = 0;
  while ((1 << chunk_shift) < chunk) ++chunk_shift;
  SplitLayout s{
      batch * rows, cols, k_minor ? cols : rows, k_minor, chunk_shift, static_cast<int>(count), 0};
  for (int t = 0; t < s.terms; ++t) {
    if (terms[t] < 0 || terms[t] > static_cast<int32_t>(SplitPart::kLo))
      return Invalid("unknown part code " + std::to_string(terms[t]));
    s.parts |= static_cast<uint32_t>(terms[t]) << (2 * t);
  }
  const cudaError_t err =
      LaunchSplitIntoLaidParts(static_cast<const float*>(x.untyped_data()),
                               static_cast<uint16_t*>(out->untyped_data()), s, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("tiled_split_parts: launch failed: ") +
                                cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_tiled::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTiledSplitPartsCuda, jax_tiled::cuda::SplitPartsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x: (batch, rows, cols) float32
                                  .Ret<xla::ffi::AnyBuffer>()  // its parts laid along K, bfloat16
                                  .Attr<bool>("k_minor")       // K runs along x's rows
                                  .Attr<xla::ffi::Span<const int32_t>>("terms")  // SplitPart each
                                  .Attr<int32_t>("chunk"),                       // K per chunk
                              {xla::ffi::Traits::kCmdBufferCompatible});
