#include "cuda/auto.h"

#include <cstdint>
#include <string>

namespace jax_tiled::cuda {
namespace {

const KernelDescriptor& Kernel(const char* name) { return *FindKernel(name); }

bool IsSixteenBit(Dtype t) { return t == Dtype::kF16 || t == Dtype::kBF16; }

// A product too small for the Hopper kernel's 128-wide tiles to pay: mma's
// tiles of C (64 x 64 or 32 x 32 here) take at most half the SMs, all at once, and a row
// of A (a column of B) is at most 1 KB, where mma's pipeline is short. There
// wgmma runs one 128 x 128 tile per SM or splits K across a cluster, whose
// reduction costs more than the product: 256^3 bfloat16 took 8.5 us on
// wgmma, 5.7 on mma (NOTES.md, "Small products"). DEFAULT and 16-bit only:
// 3xTF32 was not measured.
constexpr int64_t kSmallRowBytes = 1024;

// The cheap tests first: a large product, on every launch, pays for no
// refusal and no plan of mma's.
bool SmallForMma(const Product& p, const KernelDescriptor& mma, const DeviceFacts& device) {
  const MatmulDims& d = p.dims;
  const int64_t row_bytes = d.k * (IsSixteenBit(p.in_type) ? 2 : 4);
  if (p.SplitsTf32() || row_bytes > kSmallRowBytes || Refusal(mma, p, device.compute_capability))
    return false;
  const LaunchPlan plan = mma.plan(p, device);
  const int64_t tiles = d.batch * ((d.m + plan.block_m - 1) / plan.block_m) *
                        ((d.n + plan.block_n - 1) / plan.block_n);
  return tiles <= device.multiprocessors / 2;
}

// Whether warptile's plan runs a product of few rows on its thin blocks:
// blocks of fewer than 64 rows, where 64-row ones would compute rows that are
// not there, and at least 64 columns, where a 128-wide block is not mostly
// padding.
bool OnThinBlocks(const Product& p, const LaunchPlan& warptile_plan) {
  return warptile_plan.block_m < 64 && p.dims.n >= 64;
}

// "16-bit inputs", or how float32 runs on the tensor cores at this precision.
std::string TensorCoreInputs(const Product& p) {
  if (IsSixteenBit(p.in_type)) return "16-bit inputs";
  return std::string("float32 at precision ") +
         (p.SplitsTf32()
              ? "HIGH: 3xTF32 and lo x lo (four TF32 products of split operands, close to fp32)"
              : "DEFAULT: one TF32 pass, as XLA's own");
}

// Why the Hopper kernel cannot take a product the tensor cores compute.
std::string WhyNotWgmma(const Product& p, const DeviceFacts& device) {
  const MatmulDims& d = p.dims;
  if (device.compute_capability != 90) return "wgmma needs a Hopper GPU";
  if (p.SplitsTf32() && d.transpose_a && !d.transpose_b)
    return "with a stored (k, m) and b stored (k, n), wgmma's 3xTF32 would need B rewritten "
           "both K-major and into hi and lo parts, which is not built";
  return "the TMA copy engine needs rows and batches that start at multiples of 16 bytes "
         "(a's rows are " +
         std::to_string(d.lda) + " elements, b's " + std::to_string(d.ldb) + ")";
}

}  // namespace

KernelChoice ChooseAuto(const Product& p, const DeviceFacts& device, std::string* why) {
  // Statics: the table is searched once, not on every call.
  static const KernelDescriptor &smem16 = Kernel(names::kSmem16),
                                &warptile = Kernel(names::kWarptile),
                                &pipelined = Kernel(names::kPipelined), &mma = Kernel(names::kMma),
                                &wgmma = Kernel(names::kWgmma);
  const auto choose = [&](const KernelDescriptor& kernel, auto&& reason) {
    if (why) *why = reason();
    return KernelChoice{&kernel, kernel.plan(p, device)};
  };
  // One row, or one column as the transposed product's row (warptile's plan
  // of 1-row blocks): the product reads its matrix once, 2 FLOPs an element.
  const auto on_row_blocks = [&](const char* why_there) {
    return choose(warptile, [&] {
      return std::string(p.dims.m == 1 ? "one row"
                                       : "one column, as the transposed product's row") +
             ": warptile's row blocks, each output's sum in double (" + why_there + ")";
    });
  };
  const int cc = device.compute_capability;
  const bool tf32 = p.in_type == Dtype::kF32 && p.precision != Precision::kHighest && cc >= 80;
  // float32 at HIGH of one row or one column, or of at most 32 rows, runs as
  // at HIGHEST. One row or column: the product reads its matrix once, so
  // exact products summed in double cost no more than 3xTF32, whose float32
  // sums over K were 1.5-3.2x jnp HIGHEST's error there (HIGH's bound is
  // HIGHEST's; NOTES.md, "HIGH's one row or column on the row blocks"). At
  // most 32 rows (warptile's thin blocks), on a Hopper GPU: wgmma's 3xTF32
  // lands them on N padded to 64, so at most half its four TF32 products'
  // work is on rows that exist, about fp32's own SIMT rate, where reading
  // the matrix once bounds the product either way (NOTES.md, "HIGH of few
  // rows on the thin blocks").
  if (p.SplitsTf32() && p.laid_terms == 1 && p.out_type != Dtype::kF64) {
    const LaunchPlan simt = warptile.plan(p, device);
    if (simt.block_m == 1)
      return on_row_blocks(
          "float32 at HIGH: the matrix read once bounds the product, and sums in double are "
          "as exact as HIGHEST's where 3xTF32's float32 sums over K were not");
    if (cc == 90 && OnThinBlocks(p, simt))
      return choose(warptile, [&] {
        const std::string rows = std::to_string(simt.block_m);
        return "float32 at HIGH of at most " + rows + " rows: warptile's blocks of " + rows +
               " rows in exact fp32, as at HIGHEST, where wgmma's 3xTF32 would pad them to 64 "
               "and do four TF32 products: reading the matrix once bounds both";
      });
  }
  if ((IsSixteenBit(p.in_type) || tf32) && p.out_type != Dtype::kF64) {
    if (cc == 90 && SmallForMma(p, mma, device))
      return choose(mma, [&] {
        return TensorCoreInputs(p) +
               ", a small product: mma.sync's tiles take at most half the SMs and K is short, "
               "where wgmma's 128-wide tiles would leave one SM a tile or split K across a "
               "cluster, whose reduction costs more than the product";
      });
    // One column (more rows than one on the row blocks) of 16-bit operands
    // as given (not an emulation preset's parts laid along K), on a Hopper
    // GPU, where the alternative is wgmma's C^T of the column padded to 8:
    // on one H200 8192 x 8192 x 1 ran in 48 us on the row blocks against 60
    // (its matrix stored (k, m): 60 against 131; NOTES.md, "Row blocks'
    // parts of K by the blocks an SM holds"). One row stays on wgmma, which
    // read it faster there.
    if (cc == 90 && IsSixteenBit(p.in_type) && p.laid_terms == 1 && p.dims.m > 1 &&
        warptile.plan(p, device).block_m == 1)
      return on_row_blocks(
          "the matrix read once bounds the product, not the tensor cores; wgmma's C^T "
          "would spend 64 of its rows on one");
    if (!Refusal(wgmma, p, cc))
      return choose(wgmma, [&] {
        const LaunchPlan plan = wgmma.plan(p, device);
        // TF32 wgmma reads shared memory K-major only: an MN-major A (stored
        // (k, m), or b stored (k, n) swapped onto A) goes through registers,
        // as does an A that 3xTF32 splits in the kernel or, read once, on
        // chip (WgmmaOperands::kAFromRegisters).
        const bool a_through_registers =
            p.SplitsTf32() ? plan.tf32_split_in_kernel || plan.a_split_in_registers
                           : tf32 && (plan.swap_ab || p.dims.transpose_a);
        return TensorCoreInputs(p) +
               " on a Hopper GPU, operands the TMA copy engine can read: "
               "warp-specialised wgmma" +
               (a_through_registers ? ", A through registers"
                : p.SplitsTf32()    ? ", both operands' TF32 parts read from shared memory"
                : tf32 ? ", both operands from shared memory, rounded to TF32 as they land"
                       : "") +
               (tf32 && (plan.swap_ab || plan.transposes_b) ? " (TF32 reads B K-major only)"
                : plan.swap_ab ? " (a few rows: they land on wgmma's N, 64 wide, where "
                                 "its M would be mostly padding)"
                               : "");
      });
    return choose(mma, [&] {
      return TensorCoreInputs(p) + ": mma.sync tensor cores, since " + WhyNotWgmma(p, device);
    });
  }
  if (p.in_type == Dtype::kF64)
    return choose(smem16, [] {
      return "float64: warptile would spill its 64 double accumulators per thread";
    });
  // warptile's plan, planned once for the choices below. Its planner runs
  // products of few rows on thin blocks (float32's on its own mainloop where
  // it takes them, K's parts by a model of the waves: the plan's
  // why_this_width).
  const LaunchPlan own = warptile.plan(p, device);
  if (own.block_m == 1)
    return on_row_blocks(
        "the product reads its matrix once, and its FMAs in double cost nothing beside "
        "that; a float32 chain over K was twice jnp's error");
  if (OnThinBlocks(p, own))
    return choose(warptile, [&] {
      const std::string rows = std::to_string(own.block_m);
      return "at most " + rows + " rows: warptile's blocks of " + rows +
             " rows, where its 64-row ones would compute rows that are not there" +
             (own.why_this_width ? "; float32's own mainloop, K's parts by a model of the waves"
                                 : "");
    });
  if (p.dims.m < 64 || p.dims.n < 64)
    return choose(smem16, [] {
      return "fewer than 64 rows or columns: warptile's 64-wide tiles would be mostly padding";
    });
  // warptile's planner takes 128 x 128 blocks once they fill every SM twice,
  // and its float32 mainloop's blocks where a model of the waves (its plan's
  // why_this_width) has them first; else 64 x 64 blocks, which pipelined
  // runs faster.
  const std::string sms = std::to_string(device.multiprocessors);
  if (own.block_m != 64 || own.block_n != 64)
    return choose(warptile, [&] {
      return (own.why_this_width
                  ? std::to_string(own.block_m) + " x " + std::to_string(own.block_n) +
                        " blocks on float32's own mainloop, K in parts where it "
                        "pays: a model of the waves has them finish before 64 x "
                        "64 blocks would"
                  : "128 x 128 blocks of 8 warps fill the " + sms + " SMs at least twice") +
             "; there the register-staged copies beat pipelined's cp.async";
    });
  const auto small = [&] {
    return "64 x 64 blocks of 2 warps, since 128 x 128 blocks would not fill the " + sms +
           " SMs twice";
  };
  if (!Refusal(pipelined, p, cc))
    return choose(pipelined, [&] {
      return small() + "; with few warps per SM the 4-stage cp.async pipeline hides latency best";
    });
  return choose(warptile, [&] {
    return small() + "; " + DtypeName(p.in_type) + " -> " + DtypeName(p.out_type) +
           " needs warptile's converting copies";
  });
}

}  // namespace jax_tiled::cuda
