// nanobind module `jax_tiled._cpu`: the CPU FFI targets and the kernel table.
#include <nanobind/nanobind.h>

#include "cpu/matmul.h"
#include "cuda/kernel_names.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.def(
      "registrations",
      [] {
        nb::dict targets;
        targets["tiled_matmul_cpu"] = nb::capsule(reinterpret_cast<void*>(JaxTiledMatmulCpu));
        return targets;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def(
      "kernel_table",
      [] {
        const nb::tuple every_float = nb::make_tuple("float16", "bfloat16", "float32", "float64");
        nb::dict row;
        row["name"] = jax_tiled::cpu::kKernelName;
        row["listed"] = true;
        row["tensor_cores"] = false;
        row["true_fp32"] = true;
        row["min_capability"] = 0;
        row["hopper_only"] = false;
        row["inputs"] = every_float;
        row["outputs"] = every_float;
        nb::list table;
        table.append(row);
        return table;
      },
      "The kernel table, a dict of facts per kernel, as the CUDA module's.");
  m.def(
      "cuda_kernel_names",
      [] {
        nb::list names;
        for (const char* name : jax_tiled::cuda::names::kLadder) names.append(name);
        return names;
      },
      "Every kernel of the CUDA ladder by name, whether or not the CUDA module is built.");
}
