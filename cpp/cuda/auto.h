// kernel="auto": which kernel and plan run a product. A policy over the
// descriptors of kernel.h; the thresholds rest on the measurements in
// NOTES.md ("What auto's thresholds rest on").
#pragma once

#include <string>

#include "cuda/kernel.h"

namespace jax_tiled::cuda {

struct KernelChoice {
  const KernelDescriptor* kernel;
  LaunchPlan plan;  // what the launcher runs and explain prints
};

// The reason, for explain, is written only when `why` is given, so the
// launch path builds no strings.
KernelChoice ChooseAuto(const Product& product, const DeviceFacts& device,
                        std::string* why = nullptr);

}  // namespace jax_tiled::cuda
