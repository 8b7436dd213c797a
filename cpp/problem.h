// MatmulProblem: the one place where FFI buffers and attributes become a
// validated batched matrix product. The CPU and CUDA handlers both start here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "precision.h"
#include "xla/ffi/api/ffi.h"

namespace jax_tiled {

namespace ffi = xla::ffi;

// out[b] = op(a[b]) @ op(b[b]) for b in [0, batch), all arrays row-major.
//   a: (batch_a, m, k), or (batch_a, k, m) when transpose_a
//   b: (batch_b, k, n), or (batch_b, n, k) when transpose_b
//   out: (batch, m, n)
// batch_a and batch_b are 1 or batch; a batch of 1 is broadcast through a zero
// batch stride. Every size and offset is 64-bit.
struct MatmulProblem {
  int64_t batch = 0, m = 0, n = 0, k = 0;
  int64_t a_batch_stride = 0, b_batch_stride = 0, out_batch_stride = 0;
  bool transpose_a = false, transpose_b = false;
  ffi::DataType in_type = ffi::DataType::INVALID;
  ffi::DataType out_type = ffi::DataType::INVALID;
  Precision precision = Precision::kDefault;
  std::string_view kernel;

  // A problem over contiguous row-major arrays with these sizes: operand
  // batches of 1 broadcast (stride 0).
  static MatmulProblem Contiguous(int64_t batch_a, int64_t batch_b, int64_t m, int64_t n, int64_t k,
                                  bool transpose_a, bool transpose_b) {
    MatmulProblem p;
    p.batch = batch_a == 0 || batch_b == 0 ? 0 : std::max(batch_a, batch_b);
    p.m = m, p.n = n, p.k = k;
    p.transpose_a = transpose_a, p.transpose_b = transpose_b;
    p.a_batch_stride = batch_a == 1 ? 0 : m * k;
    p.b_batch_stride = batch_b == 1 ? 0 : k * n;
    p.out_batch_stride = m * n;
    return p;
  }

  // Row strides (leading dimensions) of the stored, row-major matrices.
  int64_t lda() const { return transpose_a ? m : k; }
  int64_t ldb() const { return transpose_b ? k : n; }
  int64_t ldc() const { return n; }
  bool empty_output() const { return batch == 0 || m == 0 || n == 0; }
};

inline bool IsSupportedFloat(ffi::DataType t) {
  return t == ffi::DataType::F16 || t == ffi::DataType::BF16 || t == ffi::DataType::F32 ||
         t == ffi::DataType::F64;
}

inline const char* DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    default: return "an unsupported dtype";
  }
}

namespace detail {
inline std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  return s + (d.size() == 1 ? ",)" : ")");
}
inline ffi::Unexpected<ffi::Error> Invalid(const std::string& what) {
  return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument("tiled_matmul: " + what));
}
}  // namespace detail

inline ffi::ErrorOr<MatmulProblem> MakeMatmulProblem(const ffi::AnyBuffer& a,
                                                     const ffi::AnyBuffer& b,
                                                     const ffi::AnyBuffer& out, bool transpose_a,
                                                     bool transpose_b, Precision precision,
                                                     std::string_view kernel) {
  using detail::Dims;
  using detail::Invalid;
  auto ad = a.dimensions(), bd = b.dimensions(), od = out.dimensions();
  if (ad.size() != 3 || bd.size() != 3 || od.size() != 3)
    return Invalid("operands and result must have rank 3, got a" + Dims(ad) + ", b" + Dims(bd) +
                   ", out" + Dims(od));
  for (auto t : {a.element_type(), b.element_type(), out.element_type()})
    if (!IsSupportedFloat(t))
      return Invalid("dtypes must be float16, bfloat16, float32 or float64");
  if (a.element_type() != b.element_type())
    return Invalid(std::string("operand dtypes differ: ") + DataTypeName(a.element_type()) +
                   " and " + DataTypeName(b.element_type()));
  if (!PrecisionFromCode(static_cast<int32_t>(precision)))
    return Invalid("precision attribute must be 0, 1 or 2, got " +
                   std::to_string(static_cast<int32_t>(precision)));

  const int64_t batch = od[0];
  const int64_t m = transpose_a ? ad[2] : ad[1];
  const int64_t k = transpose_a ? ad[1] : ad[2];
  const int64_t n = transpose_b ? bd[1] : bd[2];
  const int64_t kb = transpose_b ? bd[2] : bd[1];
  if (kb != k)
    return Invalid("contracting dimensions differ: a" + Dims(ad) + " has " + std::to_string(k) +
                   ", b" + Dims(bd) + " has " + std::to_string(kb));
  if (od[1] != m || od[2] != n)
    return Invalid("result " + Dims(od) + " does not match a" + Dims(ad) + " @ b" + Dims(bd));
  auto batch_ok = [&](int64_t x) { return x == batch || x == 1; };
  if (!batch_ok(ad[0]) || !batch_ok(bd[0]))
    return Invalid("operand batches " + std::to_string(ad[0]) + " and " + std::to_string(bd[0]) +
                   " must each be 1 or the result's " + std::to_string(batch));
  MatmulProblem p = MatmulProblem::Contiguous(ad[0], bd[0], m, n, k, transpose_a, transpose_b);
  p.batch = batch;  // the result's: two broadcast operands may still meet an empty batch
  p.in_type = a.element_type();
  p.out_type = out.element_type();
  p.precision = precision;
  p.kernel = kernel;
  return p;
}

}  // namespace jax_tiled

// Handlers declare `.Attr<jax_tiled::Precision>("precision")`; the lowering
// passes an int32 (0 DEFAULT, 1 HIGH, 2 HIGHEST), which MakeMatmulProblem checks.
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_tiled::Precision);
