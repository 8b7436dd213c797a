// nanobind module `jax_tiled._cpu`: the CPU FFI targets and kernel names.
#include <nanobind/nanobind.h>

#include "cpu/matmul.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.def("registrations", [] {
    nb::dict targets;
    targets["tiled_matmul_cpu"] = nb::capsule(reinterpret_cast<void*>(JaxTiledMatmulCpu));
    return targets;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def("kernels", [] { return nb::str(jax_tiled::cpu::kKernelNames); },
        "Comma-separated names of the kernels this module runs.");
}
