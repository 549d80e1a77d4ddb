# Finds LibTorch without running TorchConfig.cmake, whose CUDA branch needs a CUDA toolkit
# (nvcc) that CPU build machines do not have. Defines:
#   lorarun::torch   headers + libtorch/libtorch_cpu/libc10 (+ libtorch_cuda, libc10_cuda)
#   lorarun::nccl    headers needed to compile the NCCL process group (if all are found)
#   LORARUN_HAVE_NCCL, LORARUN_TORCH_ROOT
# Where LibTorch comes from, first match wins:
#   1. -DLIBTORCH_ROOT=… or a libtorch directory on CMAKE_PREFIX_PATH (a GPU box's own LibTorch)
#   2. the torch wheel in the project's .venv (scripts/setup installs it)

set(LORARUN_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH
    "Python whose torch wheel provides LibTorch when no LIBTORCH_ROOT is given")

find_path(LIBTORCH_ROOT NAMES include/torch/csrc/api/include/torch/torch.h
          PATH_SUFFIXES libtorch NO_CMAKE_SYSTEM_PATH NO_SYSTEM_ENVIRONMENT_PATH)
if(NOT LIBTORCH_ROOT)
  if(NOT EXISTS "${LORARUN_PYTHON}")
    message(FATAL_ERROR "LibTorch not found: run scripts/setup (installs torch==2.11.0 into .venv), "
                        "or pass -DLIBTORCH_ROOT=/path/to/libtorch")
  endif()
  execute_process(COMMAND "${LORARUN_PYTHON}" -c "import torch, os; print(os.path.dirname(torch.__file__))"
                  OUTPUT_VARIABLE _torch_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "'${LORARUN_PYTHON}' cannot import torch: run scripts/setup")
  endif()
  set(LIBTORCH_ROOT "${_torch_dir}" CACHE PATH "LibTorch root (include/, lib/)" FORCE)
endif()
set(LORARUN_TORCH_ROOT "${LIBTORCH_ROOT}")
message(STATUS "LibTorch: ${LORARUN_TORCH_ROOT}")

set(_tlib "${LORARUN_TORCH_ROOT}/lib")
add_library(lorarun::torch INTERFACE IMPORTED)
target_include_directories(lorarun::torch SYSTEM INTERFACE
  "${LORARUN_TORCH_ROOT}/include" "${LORARUN_TORCH_ROOT}/include/torch/csrc/api/include")
# Every LibTorch since 2.7 is built with the C++11 ABI; Gloo is compiled into libtorch_cpu.
target_compile_definitions(lorarun::torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1 USE_C10D_GLOO)
target_compile_options(lorarun::torch INTERFACE -Wno-interference-size)
# libtorch.so exports its own copy of std::filesystem (remove_all, permissions, …) which crashes
# when called from our code: libstdc++ comes first in the link line, and so in the loader's
# search order, so such calls reach the system's libstdc++.
target_link_libraries(lorarun::torch INTERFACE
  stdc++ "${_tlib}/libtorch.so" "${_tlib}/libtorch_cpu.so" "${_tlib}/libc10.so")

# CUDA builds: libtorch_cuda must be loaded even though we call nothing in it directly, so
# that its CUDA hooks register (torch::cuda::is_available). Its own dependencies (cudart,
# NCCL, cuBLAS, …) sit in NVIDIA's wheels next to torch; the linker needs to see them.
set(LORARUN_TORCH_CUDA OFF)
if(EXISTS "${_tlib}/libtorch_cuda.so")
  set(LORARUN_TORCH_CUDA ON)
  file(GLOB _nv_libdirs LIST_DIRECTORIES true "${LORARUN_TORCH_ROOT}/../nvidia/*/lib")
  set(_rpath_link "")
  foreach(d ${_nv_libdirs})
    string(APPEND _rpath_link ",-rpath-link,${d}")
  endforeach()
  target_link_libraries(lorarun::torch INTERFACE
    "-Wl,--no-as-needed" "${_tlib}/libtorch_cuda.so" "${_tlib}/libc10_cuda.so" "-Wl,--as-needed")
  if(_rpath_link)
    target_link_options(lorarun::torch INTERFACE "LINKER:${_rpath_link}")
  endif()
endif()

# NCCL process group: needs nccl.h and the CUDA runtime headers (with crt/ and cccl's nv/),
# from NVIDIA's wheels beside torch or from a CUDA toolkit.
set(LORARUN_HAVE_NCCL OFF)
if(LORARUN_TORCH_CUDA)
  find_package(CUDAToolkit QUIET)
  set(_nv "${LORARUN_TORCH_ROOT}/../nvidia")
  file(GLOB _cuda_hints LIST_DIRECTORIES true "${_nv}/cu*/include")
  set(_hints ${_cuda_hints} "${_nv}/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
  find_path(LORARUN_NCCL_INCLUDE nccl.h HINTS ${_hints} PATHS /usr/include /usr/local/cuda/include)
  find_path(LORARUN_CUDART_INCLUDE cuda_runtime.h HINTS ${_hints} PATHS /usr/local/cuda/include)
  find_path(LORARUN_CRT_INCLUDE crt/host_config.h HINTS ${_hints} PATHS /usr/local/cuda/include)
  find_path(LORARUN_CCCL_INCLUDE nv/target HINTS ${_hints} PATH_SUFFIXES cccl PATHS /usr/local/cuda/include)
  if(LORARUN_NCCL_INCLUDE AND LORARUN_CUDART_INCLUDE AND LORARUN_CRT_INCLUDE AND LORARUN_CCCL_INCLUDE)
    set(LORARUN_HAVE_NCCL ON)
    add_library(lorarun::nccl INTERFACE IMPORTED)
    target_include_directories(lorarun::nccl SYSTEM INTERFACE
      ${LORARUN_CUDART_INCLUDE} ${LORARUN_CRT_INCLUDE} ${LORARUN_CCCL_INCLUDE} ${LORARUN_NCCL_INCLUDE})
    target_compile_definitions(lorarun::nccl INTERFACE USE_CUDA USE_C10D_NCCL)
  endif()
endif()
message(STATUS "LibTorch CUDA build: ${LORARUN_TORCH_CUDA}; NCCL process group compiled: ${LORARUN_HAVE_NCCL}")

# fmt: LibTorch's headers include the fmt it bundles (v12), which shadows any system fmt
# (-isystem dirs come before /usr/include). One fmt for the whole project avoids mixing two
# ABIs in one binary, so everything, the launcher included, uses the bundled one, header-only.
set(_fmt_dir "${CMAKE_BINARY_DIR}/fmt-from-libtorch")
file(MAKE_DIRECTORY "${_fmt_dir}")
file(CREATE_LINK "${LORARUN_TORCH_ROOT}/include/fmt" "${_fmt_dir}/fmt" SYMBOLIC)
add_library(lorarun::fmt INTERFACE IMPORTED)
target_include_directories(lorarun::fmt SYSTEM INTERFACE "${_fmt_dir}")
target_compile_definitions(lorarun::fmt INTERFACE FMT_HEADER_ONLY)
