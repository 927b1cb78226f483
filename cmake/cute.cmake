# CuTe / CUTLASS headers for the Hopper kernels (wgmma atoms), from the PyPI package nvidia-cutlass,
# pinned. Sets MLA_CUTE_INCLUDE_DIR (the folder holding cute/ and cutlass/) or leaves it empty.
#
# Order: -DMLA_CUTLASS_INCLUDE_DIR=...; then .deps/nvidia-cutlass-<version> in the source tree;
# then, with MLA_FETCH_CUTLASS (default ON), `pip install --no-deps --target` into that folder.
# Without the headers the build goes on without the Hopper kernels (the portable ones serve).
set(MLA_CUTLASS_VERSION "4.2.0.0")
set(MLA_CUTLASS_INCLUDE_DIR "" CACHE PATH
    "Folder with cute/ and cutlass/ (default: .deps/nvidia-cutlass-${MLA_CUTLASS_VERSION})")
option(MLA_FETCH_CUTLASS "pip-install nvidia-cutlass==${MLA_CUTLASS_VERSION} into .deps/ when missing" ON)

set(MLA_CUTE_INCLUDE_DIR "")
set(_mla_cutlass_target "${PROJECT_SOURCE_DIR}/.deps/nvidia-cutlass-${MLA_CUTLASS_VERSION}")
set(_mla_cutlass_headers "${_mla_cutlass_target}/cutlass_library/source/include")
if(MLA_CUTLASS_INCLUDE_DIR)
  set(_mla_cutlass_headers "${MLA_CUTLASS_INCLUDE_DIR}")
elseif(NOT EXISTS "${_mla_cutlass_headers}/cute/arch/mma_sm90_gmma.hpp" AND MLA_FETCH_CUTLASS)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    message(STATUS "mla: installing nvidia-cutlass==${MLA_CUTLASS_VERSION} headers into ${_mla_cutlass_target}")
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -m pip install --quiet --disable-pip-version-check --no-deps
              --target "${_mla_cutlass_target}" "nvidia-cutlass==${MLA_CUTLASS_VERSION}"
      RESULT_VARIABLE _mla_pip_rc OUTPUT_QUIET ERROR_VARIABLE _mla_pip_err)
    if(NOT _mla_pip_rc EQUAL 0)
      message(STATUS "mla: pip could not install nvidia-cutlass: ${_mla_pip_err}")
    endif()
  endif()
endif()
if(EXISTS "${_mla_cutlass_headers}/cute/arch/mma_sm90_gmma.hpp")
  set(MLA_CUTE_INCLUDE_DIR "${_mla_cutlass_headers}")
  message(STATUS "mla: CuTe headers in ${MLA_CUTE_INCLUDE_DIR}")
else()
  message(STATUS "mla: no CuTe headers (nvidia-cutlass==${MLA_CUTLASS_VERSION}); Hopper kernels left out")
endif()
