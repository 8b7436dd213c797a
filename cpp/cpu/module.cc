// nanobind module `jax_tiled._cpu`: the CPU FFI targets and the kernel table.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

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
        row["stack_slices"] = true;      // the handler offsets the operand's pointer
        row["reads_transposes"] = true;  // packing reads every layout (cpu/NOTES.md)
        row["inputs"] = every_float;
        row["outputs"] = every_float;
        // The ways it multiplies bfloat16 inputs (into a non-float64 result),
        // preferred first, and those this machine runs (JAX_TILED_CPU_BF16).
        nb::list paths, here;
        for (const auto& path : jax_tiled::cpu::Bf16PathTable()) {
          paths.append(path.name);
          if (path.runs_here) here.append(path.name);
        }
        row["bf16_paths"] = nb::tuple(paths);
        row["bf16_paths_here"] = nb::tuple(here);
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
  m.def(
      "bf16_path",
      [] {
        std::string error;
        std::string path = jax_tiled::cpu::Bf16PathNow(&error);
        if (path.empty()) throw std::invalid_argument(error);
        return path;
      },
      "The path a bfloat16 product takes now, as the handler decides it; ValueError if\n"
      "JAX_TILED_CPU_BF16 names none that runs here.");
}
