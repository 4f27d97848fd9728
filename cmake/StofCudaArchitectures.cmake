# The CUDA architectures the native libraries are built for (docs/installation.md "GPU architectures").
#
#   * An explicit choice wins: -DCMAKE_CUDA_ARCHITECTURES=... (scikit-build-core: -C cmake.define.CMAKE_CUDA_ARCHITECTURES=...
#     or SKBUILD_CMAKE_DEFINE), else the CUDAARCHS environment variable.  "native" there means the build machine's
#     GPUs as below, and is an error without one.
#   * Otherwise the build machine's GPUs (CMake's own detection while it checks the CUDA compiler): every Hopper
#     (9.0) as 90a, so that the wgmma kernels are built; GPUs older than sm_80 are left out (the kernels need
#     mma.sync on sm_80+).
#   * With no usable GPU: STOF_DEFAULT_CUDA_ARCHITECTURES, 80;86;89;90a (A100; A10 and RTX 30xx; L4 and RTX 40xx;
#     H100 and H200).
#
# Usage in the top-level CMakeLists.txt: include() before project(), stof_cuda_architectures_before_project(),
# project(... CUDA), stof_cuda_architectures_after_project().  Script mode tests the choice alone:
#   cmake -DEXPLICIT=<value or empty> -DNATIVE=<CMake's native list, e.g. 90-real> -P StofCudaArchitectures.cmake
# prints "<architectures>|<reason>".

if(CMAKE_SCRIPT_MODE_FILE)
  cmake_minimum_required(VERSION 3.24)  # the policies of the project build
endif()

set(STOF_DEFAULT_CUDA_ARCHITECTURES 80 86 89 90a)

# <out>: the architectures for the GPUs of a CMake native list ("86-real;90-real" or "86;90"), Hopper as 90a;
# <out>_OLD: the GPUs older than sm_80 it leaves out ("sm_75").
function(stof_cuda_archs_from_native out native_list)
  set(archs "")
  set(old "")
  foreach(a IN LISTS native_list)
    string(REGEX REPLACE "-(real|virtual)$" "" a "${a}")
    if(NOT a MATCHES "^([0-9]+)a?$")
      continue()
    endif()
    set(n "${CMAKE_MATCH_1}")
    if(n LESS 80)
      list(APPEND old "sm_${n}")
    elseif(n EQUAL 90)
      list(APPEND archs 90a)  # the wgmma and TMA kernels exist only in sm_90a code
    else()
      list(APPEND archs "${n}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES archs)
  list(REMOVE_DUPLICATES old)
  set(${out} "${archs}" PARENT_SCOPE)
  set(${out}_OLD "${old}" PARENT_SCOPE)
endfunction()

# <out>: the architectures to build; <out>_REASON: why (for the configure log).  user_archs: the user's value or "";
# native_list: CMake's CMAKE_CUDA_ARCHITECTURES_NATIVE (empty without a GPU).
function(stof_choose_cuda_architectures out user_archs native_list)
  stof_cuda_archs_from_native(mapped "${native_list}")
  set(gpus "")
  foreach(a IN LISTS native_list)
    string(REGEX REPLACE "-(real|virtual)$" "" a "${a}")
    list(APPEND gpus "sm_${a}")
  endforeach()
  string(REPLACE ";" ", " gpus "${gpus}")
  string(REPLACE ";" ", " old "${mapped_OLD}")
  if(NOT user_archs STREQUAL "" AND NOT user_archs STREQUAL "native")
    set(archs "${user_archs}")
    set(reason "explicit (CMAKE_CUDA_ARCHITECTURES or CUDAARCHS)")
  elseif(mapped)
    set(archs "${mapped}")
    set(reason "the GPUs of this machine (${gpus})")
    if(old)
      string(APPEND reason "; ${old} left out: the kernels need sm_80 or newer")
    endif()
  elseif(user_archs STREQUAL "native")
    if(old)
      message(FATAL_ERROR "CMAKE_CUDA_ARCHITECTURES=native: this machine's GPUs (${gpus}) are older than sm_80, "
                          "which the STOF kernels need")
    endif()
    message(FATAL_ERROR "CMAKE_CUDA_ARCHITECTURES=native: no CUDA GPU found on this machine; give the "
                        "architectures (e.g. -DCMAKE_CUDA_ARCHITECTURES=\"80;86;89;90a\")")
  else()
    set(archs "${STOF_DEFAULT_CUDA_ARCHITECTURES}")
    if(old)
      set(reason "the default list: this machine's GPUs (${gpus}) are older than sm_80, which the kernels need")
    else()
      set(reason "the default list: no CUDA GPU found on this machine")
    endif()
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
  set(${out}_REASON "${reason}" PARENT_SCOPE)
endfunction()

# Before project(): remember the user's choice and give CMake's compiler checks a valid list of our own when there
# is none (a normal variable: the cache keeps no value of ours, so that a later configure decides again).
macro(stof_cuda_architectures_before_project)
  if(DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(STOF_CUDA_ARCHITECTURES_EXPLICIT "${CMAKE_CUDA_ARCHITECTURES}")
  else()
    set(STOF_CUDA_ARCHITECTURES_EXPLICIT "$ENV{CUDAARCHS}")
  endif()
  if(STOF_CUDA_ARCHITECTURES_EXPLICIT STREQUAL "" OR STOF_CUDA_ARCHITECTURES_EXPLICIT STREQUAL "native")
    set(CMAKE_CUDA_ARCHITECTURES 80)  # only for the compiler checks; replaced after project()
  endif()
endmacro()

# After project(... CUDA): CMAKE_CUDA_ARCHITECTURES (a normal variable, which targets take) and STOF_CUDA_HAS_SM90A.
macro(stof_cuda_architectures_after_project)
  stof_choose_cuda_architectures(_stof_archs "${STOF_CUDA_ARCHITECTURES_EXPLICIT}" "${CMAKE_CUDA_ARCHITECTURES_NATIVE}")
  set(CMAKE_CUDA_ARCHITECTURES "${_stof_archs}")
  set(STOF_CUDA_HAS_SM90A OFF)
  foreach(_stof_a IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(_stof_a MATCHES "^90a(-real|-virtual)?$")
      set(STOF_CUDA_HAS_SM90A ON)
    endif()
  endforeach()
  message(STATUS "stof-trt: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}: ${_stof_archs_REASON}")
endmacro()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  stof_choose_cuda_architectures(archs "${EXPLICIT}" "${NATIVE}")
  message("${archs}|${archs_REASON}")
endif()
