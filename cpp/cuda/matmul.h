// What the nanobind module needs of the CUDA side: the FFI handler, the
// kernel table's facts, and auto's choice and the refusals for a problem
// before buffers exist. Plain C++: module.cc includes no CUDA headers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_tiled::cuda {
// One kernel of the table, as the Python side sees it (kernel.h has the
// descriptor these come from).
struct KernelFacts {
  std::string name;
  int rung;               // its file's number, kernels/<rung>_<technique>.cu
  bool listed;            // offered by jax_tiled.kernels(); false: for the test suite only
  bool tensor_cores;      // computes on the tensor cores
  bool true_fp32;         // float32 in true fp32 (precision HIGHEST); else TF32 / 3xTF32
  int min_capability;     // major * 10 + minor
  bool hopper_only;       // sm_90a instructions: capability 9.0 exactly
  bool stack_slices;      // reads an operand given as a slice of a stack in place
  bool reads_transposes;  // reads an operand stored transposed as fast as one stored plainly
  std::vector<std::string> inputs, outputs;  // numpy dtype names
};

// Every kernel of the table, in ladder order; no GPU needed.
std::vector<KernelFacts> KernelTable();

// A problem as the lowering sees it, before buffers exist: contiguous
// operands a (batch_a, m, k) or (batch_a, k, m) when transposed, b (batch_b,
// k, n) or (batch_b, n, k); a batch of 1 broadcasts. laid_terms: as
// Product's.
struct ProblemShape {
  int64_t batch_a, batch_b, m, n, k;
  bool transpose_a, transpose_b;
  int laid_terms = 1;
};

// The GPU a problem is planned for, as the Python side knows it: its SMs and
// compute capability (major * 10 + minor), and per-block limits, where 0
// takes kernel.h's DeviceFacts default (an H100's, every sm_80+ GPU's).
struct GpuFacts {
  int multiprocessors, compute_capability;
  int shared_bytes_per_block = 0, max_threads_per_block = 0;
};

// What kernel="auto" runs, for explain: the kernel's name, why, and the plan
// its launcher runs ("128 x 256 tiles, 4 stages").
struct AutoChoice { std::string kernel, reason, plan; };

// AutoChoice for this problem from `dtype` inputs to an `out_dtype` result
// (numpy's names) at `precision` (the FFI attribute's code) on that GPU.
// Dtypes or a precision it does not know, and a product for which no kernel
// runs (an empty output, or K of 0: a zero fill), leave `kernel` empty and
// say so in `reason`.
AutoChoice ExplainAuto(std::string_view dtype, std::string_view out_dtype,
                       const ProblemShape& shape, int precision, const GpuFacts& gpu);

// A kernel's plan for a problem (kernel.h, LaunchPlan), as its launcher would
// run it on that GPU: Describe's words, for explain, and the tiling, for the
// benchmark's ladder report. `text` is empty where the kernel is unknown,
// refuses the problem, or would not run (nothing to compute).
struct PlanFacts {
  std::string text;
  int block_m = 0, block_n = 0, stages = 0, cluster_m = 1, split_k = 1, split_groups = 1;
  bool swap_ab = false;
  int persistent_blocks = 0;
  bool reads_whole_lines = false;
  bool reads_transposes = false;  // the kernel's for every product, or this plan's
};
PlanFacts KernelPlan(std::string_view kernel, std::string_view dtype, std::string_view out_dtype,
                     const ProblemShape& shape, int precision, const GpuFacts& gpu);

// Why `kernel` cannot run this problem, or "" if it can (kernel.h, Refusal).
std::string KernelRefusal(std::string_view kernel, std::string_view dtype,
                          std::string_view out_dtype, const ProblemShape& shape, int precision,
                          int compute_capability);
}  // namespace jax_tiled::cuda

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxTiledSplitPartsCuda);
