# sluice_add_library(NAME SOURCES... [DEPS targets...])
# One static (PIC) library per folder. The first library built owns the precompiled
# torch header; the others reuse it so torch's headers are parsed once per build.
set(SLUICE_PCH_OWNER "" CACHE INTERNAL "")

set(SLUICE_WARNINGS -Wall -Wextra -Wno-unused-parameter)
# Sanitizer flags (SLUICE_SANITIZE) are GCC/Clang driver flags: they go to C and C++
# compiles and to the host link only, never to nvcc (which refuses -fsanitize=...): a
# sanitizer build with CUDA sources compiles its .cu files without instrumentation.
set(SLUICE_SAN_FLAGS "")
if(SLUICE_SANITIZE)
  string(REPLACE ";" "," _san "${SLUICE_SANITIZE}")
  set(SLUICE_SAN_FLAGS -fsanitize=${_san} -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
endif()

function(sluice_apply_common target)
  # Inside a generator expression a bare ',' separates arguments (-fsanitize=address,undefined
  # would reach the link as "address undefined"): $<COMMA> keeps it.
  string(REPLACE "," "$<COMMA>" _san "${SLUICE_SAN_FLAGS}")
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${SLUICE_WARNINGS}>"
    "$<$<COMPILE_LANGUAGE:C,CXX>:${_san}>")
  get_target_property(_type ${target} TYPE)
  if(SLUICE_SAN_FLAGS AND NOT _type STREQUAL "STATIC_LIBRARY")
    # HOST_LINK: the link by the host compiler driver (a device-link step, if any, gets none).
    target_link_options(${target} PRIVATE "$<HOST_LINK:${_san}>")
  endif()
  if(SLUICE_USE_PCH)
    if(SLUICE_PCH_OWNER STREQUAL "")
      set(SLUICE_PCH_OWNER ${target} CACHE INTERNAL "")
      target_precompile_headers(${target} PRIVATE
        $<$<COMPILE_LANGUAGE:CXX>:<ATen/ATen.h$<ANGLE-R>>
        $<$<COMPILE_LANGUAGE:CXX>:<torch/nn/module.h$<ANGLE-R>>
        $<$<COMPILE_LANGUAGE:CXX>:<torch/nn/pimpl.h$<ANGLE-R>>
        <string> <vector> <memory> <unordered_map> <map> <mutex> <optional> <functional>)
    else()
      target_precompile_headers(${target} REUSE_FROM ${SLUICE_PCH_OWNER})
    endif()
  endif()
endfunction()

function(sluice_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  add_library(sluice::${name} ALIAS ${name})
  # The tree's root for "offload/...", "cache/..."; include/ for the public records
  # ("sluice/stats.hpp"), which every layer reports in.
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include/sluice> $<INSTALL_INTERFACE:include>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  sluice_apply_common(${name})
  set_property(GLOBAL APPEND PROPERTY SLUICE_EXPORTED_TARGETS ${name})
endfunction()

# sluice_add_executable(NAME SOURCES... [DEPS targets...])
function(sluice_add_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  # Compile with -fPIC like the libraries (not -fPIE) so the shared torch PCH stays valid.
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(${name} PRIVATE -fPIC)
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  sluice_apply_common(${name})
endfunction()
