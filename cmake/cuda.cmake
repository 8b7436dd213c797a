# The CUDA module: built when nvcc is found (AUTO), required (ON) or skipped (OFF).

if(JAX_TILED_CUDA STREQUAL "OFF")
  message(STATUS "CUDA module: off (JAX_TILED_CUDA=OFF)")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(JAX_TILED_CUDA STREQUAL "ON")
    message(FATAL_ERROR "JAX_TILED_CUDA=ON but no CUDA compiler (nvcc) was found. "
                        "Put nvcc on PATH or set CMAKE_CUDA_COMPILER, or build with JAX_TILED_CUDA=OFF.")
  endif()
  message(STATUS "CUDA module: skipped (no nvcc found; JAX_TILED_CUDA=AUTO)")
  return()
endif()

# Ampere (mma.sync, cp.async) and Hopper with its arch-specific features
# (wgmma, setmaxnreg) unless the user or CUDAARCHS says otherwise.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES 80 90a)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
message(STATUS "CUDA module: on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")

# Kernels and the FFI handler are compiled by nvcc into a static library; the
# nanobind module itself is plain C++ and only hands out the handler symbols.
# Every kernel of the ladder is a cpp/cuda/kernels/<n>_<technique>.cu file.
file(GLOB JAX_TILED_KERNEL_SOURCES CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/cpp/cuda/kernels/*.cu")

# The tensor-core kernels' launchers, instantiated once per input type in
# generated units (kernel.h, JAX_TILED_PER_INPUT_LAUNCHER).
set(JAX_TILED_PER_INPUT_LAUNCHERS
  "5_mma_sync_pipelined:LaunchMmaFor"
  "6_wgmma_tma_warp_specialized:LaunchWgmmaFor")
set(JAX_TILED_INSTANCE_SOURCES)
foreach(entry IN LISTS JAX_TILED_PER_INPUT_LAUNCHERS)
  string(REPLACE ":" ";" parts "${entry}")
  list(GET parts 0 KERNEL)
  list(GET parts 1 LAUNCHER)
  foreach(pair "f16:__half" "bf16:__nv_bfloat16" "f32:float")
    string(REPLACE ":" ";" pair "${pair}")
    list(GET pair 0 suffix)
    list(GET pair 1 INPUT)
    set(unit "${CMAKE_CURRENT_BINARY_DIR}/instances/${KERNEL}_${suffix}.cu")
    configure_file("${PROJECT_SOURCE_DIR}/cmake/instance.cu.in" "${unit}" @ONLY)
    list(APPEND JAX_TILED_INSTANCE_SOURCES "${unit}")
  endforeach()
endforeach()

add_library(jax_tiled_cuda_kernels STATIC
  cpp/cuda/handler.cu cpp/cuda/split_parts.cu cpp/cuda/kernel_table.cu cpp/cuda/auto.cu
  ${JAX_TILED_KERNEL_SOURCES} ${JAX_TILED_INSTANCE_SOURCES})
target_include_directories(jax_tiled_cuda_kernels PRIVATE cpp)
target_include_directories(jax_tiled_cuda_kernels SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
set_target_properties(jax_tiled_cuda_kernels PROPERTIES
  POSITION_INDEPENDENT_CODE ON CUDA_SEPARABLE_COMPILATION OFF)
target_compile_options(jax_tiled_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr>)

nanobind_add_module(_cuda NB_STATIC cpp/cuda/module.cc)
target_include_directories(_cuda PRIVATE cpp)
target_include_directories(_cuda SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
# Static cudart: the module imports on machines without a GPU driver (CI), and
# the runtime resolves libcuda only when a kernel is first launched.
target_link_libraries(_cuda PRIVATE jax_tiled_cuda_kernels CUDA::cudart_static)
install(TARGETS _cuda LIBRARY DESTINATION .)
