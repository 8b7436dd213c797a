// nanobind module `jax_tiled._cuda`: the CUDA FFI targets and kernel names.
// Plain C++ with no CUDA headers: the kernels live in the nvcc-built library.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include "cuda/matmul.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.def("registrations", [] {
    nb::dict targets;
    targets["tiled_matmul_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxTiledMatmulCuda));
    return targets;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def("kernels", [] { return nb::str(jax_tiled::cuda::kKernelNames); },
        "Comma-separated names of the kernels this module runs.");
  m.def("explain_auto", &jax_tiled::cuda::ExplainAuto, nb::arg("dtype"), nb::arg("out_dtype"),
        nb::arg("batch"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("multiprocessors"),
        "'<rung>: <why>' for what kernel='auto' runs on this problem (no GPU needed).");
  m.def("kernel_dtype_mismatch", &jax_tiled::cuda::KernelDtypeMismatch, nb::arg("kernel"),
        nb::arg("dtype"), nb::arg("out_dtype"),
        "Why the kernel cannot run this dtype pair, or '' if it can.");
}
