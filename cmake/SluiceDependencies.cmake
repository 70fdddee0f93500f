# Finds every third-party dependency once. Debian's -dev packages provide the config
# files; on machines without them, point CMAKE_PREFIX_PATH at an unpacked copy.

# libtorch: from the PyPI wheel (CMAKE_PREFIX_PATH = torch.utils.cmake_prefix_path,
# which scripts/setup.sh passes) or any libtorch >= 2.11 through Torch_DIR.
# A CUDA libtorch turns TORCH_CUDA_ARCH_LIST into -gencode flags in CMAKE_CUDA_FLAGS and
# forces CMAKE_CUDA_ARCHITECTURES off. Unset, it probes the GPU and, with none (CI), picks a
# list starting at sm_50, which nvcc 13 refuses. So sluice names its architectures here.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;8.6;8.9;9.0+PTX")
endif()
find_package(Torch 2.11 REQUIRED)
if(NOT TARGET torch)
  message(FATAL_ERROR "find_package(Torch) did not define the 'torch' target")
endif()

find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(mimalloc REQUIRED)
find_package(CLI11 REQUIRED)
if(SLUICE_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
endif()
if(SLUICE_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# CUDA: only when libtorch itself was built with CUDA and a compiler is present.
set(SLUICE_HAS_CUDA OFF)
set(_sluice_torch_cuda OFF)
if(TARGET torch_cuda OR TARGET c10_cuda OR "${TORCH_LIBRARIES}" MATCHES "c10_cuda")
  set(_sluice_torch_cuda ON)
endif()
if(NOT SLUICE_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(_sluice_torch_cuda AND CMAKE_CUDA_COMPILER)
    set(SLUICE_HAS_CUDA ON)
  elseif(SLUICE_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SLUICE_WITH_CUDA=ON but libtorch has CUDA=${_sluice_torch_cuda} and nvcc='${CMAKE_CUDA_COMPILER}'")
  endif()
endif()
if(SLUICE_HAS_CUDA)
  # Only reached when torch did not force it off (it does whenever it adds its -gencode flags).
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80-real 86-real 89-real 90-real 90-virtual)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()
message(STATUS "sluice: torch ${Torch_VERSION}, CUDA sources ${SLUICE_HAS_CUDA}")
