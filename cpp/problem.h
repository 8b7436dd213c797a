// MatmulProblem: the one place where FFI buffers and attributes become a
// validated batched matrix product. The CPU and CUDA handlers both start here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "precision.h"
#include "stack_slice.h"
#include "xla/ffi/api/ffi.h"

namespace jax_tiled {

namespace ffi = xla::ffi;

// out[b] = op(a[b]) @ op(b[b]) for b in [0, batch), all arrays row-major.
//   a: (batch_a, m, k), or (batch_a, k, m) when transpose_a
//   b: (batch_b, k, n), or (batch_b, n, k) when transpose_b
//   out: (batch, m, n)
// batch_a and batch_b are 1 or batch; a batch of 1 is broadcast through a zero
// batch stride. Either operand may be one slice of a stack (count, batch_x,
// rows, cols), chosen by an index the kernel reads (stack_slice.h). Every
// size and offset is 64-bit.
struct MatmulProblem {
  int64_t batch = 0, m = 0, n = 0, k = 0;
  int64_t a_batch_stride = 0, b_batch_stride = 0, out_batch_stride = 0;
  StackSlice a_stack, b_stack;
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

// A stacked operand's (count, batch, rows, cols) as the (batch, rows, cols)
// of its slices, with the stack and its index (the next of `indices`, an
// int32 scalar); a rank-3 operand as itself.
struct OperandView {
  ffi::AnyBuffer::Dimensions dims;
  StackSlice stack;
};

inline ffi::ErrorOr<OperandView> ViewOperand(const char* name, const ffi::AnyBuffer& x,
                                             const ffi::RemainingArgs& indices, size_t* next) {
  using detail::Dims;
  using detail::Invalid;
  const ffi::AnyBuffer::Dimensions d = x.dimensions();
  if (d.size() == 3) return OperandView{d, {}};
  if (d.size() != 4)
    return Invalid(std::string(name) + " must have rank 3, or 4 as a stack of slices, got " + name +
                   Dims(d));
  auto index = indices.get<ffi::AnyBuffer>((*next)++);
  if (index.has_error())
    return Invalid(std::string("the stack ") + name + Dims(d) + " has no index argument");
  if (index->element_type() != ffi::DataType::S32 || index->dimensions().size() != 0)
    return Invalid(std::string("the index of the stack ") + name + Dims(d) +
                   " must be an int32 scalar, got shape " + Dims(index->dimensions()));
  if (d[0] < 1) return Invalid(std::string("the stack ") + name + Dims(d) + " is empty");
  StackSlice stack;
  stack.index = static_cast<const int32_t*>(index->untyped_data());
  stack.count = d[0];
  stack.stride = d[1] * d[2] * d[3];
  return OperandView{d.last(3), stack};
}

// `indices` are the handler's remaining arguments: one int32 scalar per
// stacked (rank-4) operand, a's first.
inline ffi::ErrorOr<MatmulProblem> MakeMatmulProblem(const ffi::AnyBuffer& a,
                                                     const ffi::AnyBuffer& b,
                                                     const ffi::AnyBuffer& out,
                                                     const ffi::RemainingArgs& indices,
                                                     bool transpose_a, bool transpose_b,
                                                     Precision precision, std::string_view kernel) {
  using detail::Dims;
  using detail::Invalid;
  size_t next_index = 0;
  const auto a_view = ViewOperand("a", a, indices, &next_index);
  if (a_view.has_error()) return ffi::Unexpected<ffi::Error>(a_view.error());
  const auto b_view = ViewOperand("b", b, indices, &next_index);
  if (b_view.has_error()) return ffi::Unexpected<ffi::Error>(b_view.error());
  if (next_index != indices.size())
    return Invalid(std::to_string(indices.size()) + " index arguments for " +
                   std::to_string(next_index) + " stacked operands");
  auto ad = a_view->dims, bd = b_view->dims, od = out.dimensions();
  if (od.size() != 3) return Invalid("the result must have rank 3, got out" + Dims(od));
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
  p.a_stack = a_view->stack;
  p.b_stack = b_view->stack;
  return p;
}

}  // namespace jax_tiled

// Handlers declare `.Attr<jax_tiled::Precision>("precision")`; the lowering
// passes an int32 (0 DEFAULT, 1 HIGH, 2 HIGHEST), which MakeMatmulProblem checks.
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_tiled::Precision);
