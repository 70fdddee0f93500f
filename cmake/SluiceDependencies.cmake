# Finds every third-party dependency once. Debian's -dev packages provide the config
# files; on machines without them, point CMAKE_PREFIX_PATH at an unpacked copy.

# libtorch: from the PyPI wheel (CMAKE_PREFIX_PATH = torch.utils.cmake_prefix_path,
# which scripts/setup.sh passes; under pip, the torch of the Python that runs the build) or
# any libtorch through Torch_DIR. Supported: torch 2.7.1 to 2.15.x, the range frontends pin
# (InvokeAI 6.14: 2.7.1 for CUDA, 2.10 for ROCm; ComfyUI: the newest). What differs between
# them stays in runtime/torch_compat.cpp (Note [torch compat]).
set(SLUICE_TORCH_OLDEST 2.7.1)
set(SLUICE_TORCH_NEWER_THAN_SUPPORTED 2.16)
# Each refusal is one line short enough that CMake prints it unwrapped; where the torch
# came from is the status line before it.
function(sluice_check_torch_version version where)
  if(version VERSION_LESS SLUICE_TORCH_OLDEST OR NOT version VERSION_LESS SLUICE_TORCH_NEWER_THAN_SUPPORTED)
    message(STATUS "sluice: torch ${version} from ${where}")
    message(FATAL_ERROR "sluice: found torch ${version}; sluice builds against torch ${SLUICE_TORCH_OLDEST} to 2.15.x")
  endif()
endfunction()
if(_sluice_pip AND NOT Torch_DIR)
  # pip install --no-build-isolation: the environment's own torch, checked before CMake
  # reads its package (whose errors for an unsupported torch say nothing about the range).
  execute_process(COMMAND "${Python_EXECUTABLE}" -W ignore -c
                          "import torch, torch.utils; print(torch.__version__.split('+')[0]); print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _sluice_torch_out RESULT_VARIABLE _sluice_torch_rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _sluice_torch_rc EQUAL 0)
    message(STATUS "sluice: no torch imports in ${Python_EXECUTABLE}")
    message(FATAL_ERROR "sluice: no torch in this Python; install torch ${SLUICE_TORCH_OLDEST} to 2.15.x first")
  endif()
  string(REPLACE "\n" ";" _sluice_torch_out "${_sluice_torch_out}")
  list(GET _sluice_torch_out 0 _sluice_torch_found)
  list(GET _sluice_torch_out 1 _sluice_torch_prefix)
  sluice_check_torch_version("${_sluice_torch_found}" "${Python_EXECUTABLE}")
  list(PREPEND CMAKE_PREFIX_PATH "${_sluice_torch_prefix}")
endif()
# A CUDA libtorch turns TORCH_CUDA_ARCH_LIST into -gencode flags in CMAKE_CUDA_FLAGS and
# forces CMAKE_CUDA_ARCHITECTURES off. Unset, it probes the GPU and, with none (CI), picks a
# list starting at sm_50, which nvcc 13 refuses. So sluice names its architectures here.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;8.6;8.9;9.0+PTX")
endif()
# torch 2.7's package looks for NVTX3 in its own source tree unless told to take the CUDA
# toolkit's, then falls back to libnvToolsExt, which CUDA 12.9 and later no longer ship.
if(NOT DEFINED USE_SYSTEM_NVTX)
  set(USE_SYSTEM_NVTX ON)
endif()
find_package(Torch REQUIRED)
sluice_check_torch_version("${Torch_VERSION}" "${Torch_DIR}")
# A torch wheel's CUDA libraries come from the nvidia-* wheels beside it, found at run time
# through libtorch's own RPATH. Linking an executable, ld looks for them in the -rpath
# folders first, where a CUDA toolkit's older copies (libnccl.so.2 in /usr/local/cuda/lib)
# lack symbols the wheel's libtorch_cuda needs (torch 2.15): point it at the wheels' first.
file(GLOB _sluice_wheel_cuda_libs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
foreach(_dir IN LISTS _sluice_wheel_cuda_libs)
  if(IS_DIRECTORY "${_dir}")
    add_link_options("LINKER:-rpath-link,${_dir}")
  endif()
endforeach()
if(NOT TARGET torch)
  message(FATAL_ERROR "find_package(Torch) did not define the 'torch' target")
endif()

find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(mimalloc REQUIRED)
if(SLUICE_BUILD_CLI OR SLUICE_BUILD_TESTS OR SLUICE_BUILD_BENCH)
  find_package(CLI11 REQUIRED)  # the flags of the sluice command and of the benchmarks
endif()
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
  # A torch wheel names the CUDA it was built with (torch/version.py); torch's CMake package
  # found the toolkit on the machine. sluice's kernels and torch must share one CUDA
  # runtime: with another major version (torch 2.7.1's CUDA 12 beside a CUDA 13 toolkit)
  # the process would load both, so the CUDA sources stay out (AUTO) or the build stops (ON).
  set(_sluice_torch_cuda_major "")
  if(EXISTS "${TORCH_INSTALL_PREFIX}/version.py")
    file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _sluice_cuda_line REGEX "^cuda")
    if(_sluice_cuda_line MATCHES "'([0-9]+)\\.[0-9]+'")
      set(_sluice_torch_cuda_major ${CMAKE_MATCH_1})
    endif()
  endif()
  set(_sluice_cuda_mismatch OFF)
  if(_sluice_torch_cuda_major AND CUDAToolkit_VERSION_MAJOR AND NOT _sluice_torch_cuda_major EQUAL CUDAToolkit_VERSION_MAJOR)
    set(_sluice_cuda_mismatch ON)
  endif()
  if(_sluice_torch_cuda AND CMAKE_CUDA_COMPILER AND NOT _sluice_cuda_mismatch)
    set(SLUICE_HAS_CUDA ON)
  elseif(_sluice_cuda_mismatch)
    set(_sluice_why "torch was built with CUDA ${_sluice_torch_cuda_major}, the toolkit here is CUDA ${CUDAToolkit_VERSION}")
    if(SLUICE_WITH_CUDA STREQUAL "ON")
      message(FATAL_ERROR "SLUICE_WITH_CUDA=ON but ${_sluice_why}")
    endif()
    message(STATUS "sluice: no CUDA sources: ${_sluice_why}")
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
