// nanobind module `jax_tiled._cuda`: the CUDA FFI targets and the kernel table.
// Plain C++ with no CUDA headers: the kernels live in the nvcc-built library.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include "cuda/matmul.h"

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.def(
      "registrations",
      [] {
        nb::dict targets;
        targets["tiled_matmul_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxTiledMatmulCuda));
        targets["tiled_split_parts_cuda"] =
            nb::capsule(reinterpret_cast<void*>(JaxTiledSplitPartsCuda));
        return targets;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def(
      "kernel_table",
      [] {
        nb::list table;
        for (const jax_tiled::cuda::KernelFacts& k : jax_tiled::cuda::KernelTable()) {
          nb::dict row;
          row["name"] = k.name;
          row["rung"] = k.rung;
          row["listed"] = k.listed;
          row["tensor_cores"] = k.tensor_cores;
          row["true_fp32"] = k.true_fp32;
          row["min_capability"] = k.min_capability;
          row["hopper_only"] = k.hopper_only;
          row["stack_slices"] = k.stack_slices;
          row["reads_transposes"] = k.reads_transposes;
          row["inputs"] = k.inputs;
          row["outputs"] = k.outputs;
          table.append(row);
        }
        return table;
      },
      "The kernel table in ladder order, a dict of facts per kernel (no GPU needed).");
  // Problems arrive as (batch_a, batch_b, m, n, k, transpose_a, transpose_b), then
  // the precision as the FFI attribute codes it (0 DEFAULT, 1 HIGH, 2 HIGHEST),
  // then the GPU: its SMs, compute capability, and per-block limits (0: an
  // H100's, which every sm_80+ GPU has).
  using jax_tiled::cuda::GpuFacts;
  using jax_tiled::cuda::ProblemShape;
  m.def(
      "explain_auto",
      [](std::string_view dtype, std::string_view out_dtype, int64_t batch_a, int64_t batch_b,
         int64_t m, int64_t n, int64_t k, bool transpose_a, bool transpose_b, int precision,
         int multiprocessors, int compute_capability, int shared_bytes_per_block,
         int max_threads_per_block, int laid_terms) {
        const jax_tiled::cuda::AutoChoice choice = jax_tiled::cuda::ExplainAuto(
            dtype, out_dtype,
            ProblemShape{batch_a, batch_b, m, n, k, transpose_a, transpose_b, laid_terms},
            precision,
            GpuFacts{multiprocessors, compute_capability, shared_bytes_per_block,
                     max_threads_per_block});
        return nb::make_tuple(choice.kernel, choice.reason, choice.plan);
      },
      nb::arg("dtype"), nb::arg("out_dtype"), nb::arg("batch_a"), nb::arg("batch_b"), nb::arg("m"),
      nb::arg("n"), nb::arg("k"), nb::arg("transpose_a"), nb::arg("transpose_b"),
      nb::arg("precision"), nb::arg("multiprocessors"), nb::arg("compute_capability"),
      nb::arg("shared_bytes_per_block") = 0, nb::arg("max_threads_per_block") = 0,
      nb::arg("laid_terms") = 1,
      "(kernel, why, plan) for what kernel='auto' runs on this problem (no GPU needed).");
  m.def(
      "kernel_plan",
      [](std::string_view kernel, std::string_view dtype, std::string_view out_dtype,
         int64_t batch_a, int64_t batch_b, int64_t m, int64_t n, int64_t k, bool transpose_a,
         bool transpose_b, int precision, int multiprocessors, int compute_capability,
         int shared_bytes_per_block, int max_threads_per_block, int laid_terms) -> nb::object {
        const jax_tiled::cuda::PlanFacts plan = jax_tiled::cuda::KernelPlan(
            kernel, dtype, out_dtype,
            ProblemShape{batch_a, batch_b, m, n, k, transpose_a, transpose_b, laid_terms},
            precision,
            GpuFacts{multiprocessors, compute_capability, shared_bytes_per_block,
                     max_threads_per_block});
        if (plan.text.empty()) return nb::none();
        nb::dict facts;
        facts["text"] = plan.text;
        facts["block_m"] = plan.block_m;
        facts["block_n"] = plan.block_n;
        facts["stages"] = plan.stages;
        facts["cluster_m"] = plan.cluster_m;
        facts["split_k"] = plan.split_k;
        facts["split_groups"] = plan.split_groups;
        facts["swap_ab"] = plan.swap_ab;
        facts["persistent_blocks"] = plan.persistent_blocks;
        facts["reads_whole_lines"] = plan.reads_whole_lines;
        facts["reads_transposes"] = plan.reads_transposes;
        return facts;
      },
      nb::arg("kernel"), nb::arg("dtype"), nb::arg("out_dtype"), nb::arg("batch_a"),
      nb::arg("batch_b"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("transpose_a"),
      nb::arg("transpose_b"), nb::arg("precision"), nb::arg("multiprocessors"),
      nb::arg("compute_capability"), nb::arg("shared_bytes_per_block") = 0,
      nb::arg("max_threads_per_block") = 0, nb::arg("laid_terms") = 1,
      "The plan the kernel runs this problem with, a dict of its fields and its words\n"
      "('text'), or None where the kernel is unknown or refuses it (no GPU needed).");
  m.def(
      "kernel_refusal",
      [](std::string_view kernel, std::string_view dtype, std::string_view out_dtype,
         int64_t batch_a, int64_t batch_b, int64_t m, int64_t n, int64_t k, bool transpose_a,
         bool transpose_b, int precision, int compute_capability) {
        return jax_tiled::cuda::KernelRefusal(
            kernel, dtype, out_dtype,
            ProblemShape{batch_a, batch_b, m, n, k, transpose_a, transpose_b}, precision,
            compute_capability);
      },
      nb::arg("kernel"), nb::arg("dtype"), nb::arg("out_dtype"), nb::arg("batch_a"),
      nb::arg("batch_b"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("transpose_a"),
      nb::arg("transpose_b"), nb::arg("precision"), nb::arg("compute_capability"),
      "Why the kernel cannot run this problem, or '' if it can.");
}
