# Detection of the optional parts, and the summary printed at the end of the
# configure. Each part records ON/OFF and, when OFF, how to turn it on.

set(CUDAGEN_PARTS "")

function(cudagen_part NAME FOUND HOW)
  if(FOUND)
    set(CUDAGEN_HAVE_${NAME} ON PARENT_SCOPE)
    set(CUDAGEN_PART_STATUS_${NAME} "on" PARENT_SCOPE)
  else()
    set(CUDAGEN_HAVE_${NAME} OFF PARENT_SCOPE)
    set(CUDAGEN_PART_STATUS_${NAME} "OFF: ${HOW}" PARENT_SCOPE)
    if(CUDAGEN_REQUIRE_ALL)
      message(FATAL_ERROR "cudagen: part '${NAME}' cannot be built and CUDAGEN_REQUIRE_ALL is set: ${HOW}")
    endif()
  endif()
  set(CUDAGEN_PARTS ${CUDAGEN_PARTS} ${NAME} PARENT_SCOPE)
endfunction()

# libFuzzer: the graph reader's fuzz target is built with clang and its sanitizers.
find_program(CUDAGEN_CLANGXX NAMES clang++-19 clang++)
set(_fuzz_ok OFF)
if(CUDAGEN_CLANGXX)
  execute_process(COMMAND ${CUDAGEN_CLANGXX} -print-file-name=libclang_rt.fuzzer-x86_64.a
                  OUTPUT_VARIABLE _fuzzer_rt OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(EXISTS "${_fuzzer_rt}")
    set(_fuzz_ok ON)
  endif()
endif()
cudagen_part(FUZZ ${_fuzz_ok} "install clang-19 and libclang-rt-19-dev (apt-get install clang-19 libclang-rt-19-dev)")

# Clang LibTooling (the template indexer).
# (No version in the call: Clang's version file accepts only an exact 19.x.y.)
find_package(Clang CONFIG QUIET PATHS /usr/lib/llvm-19/lib/cmake/clang NO_DEFAULT_PATH)
set(_libtooling_ok OFF)
if(Clang_FOUND AND LLVM_VERSION_MAJOR EQUAL 19)
  set(_libtooling_ok ON)
endif()
cudagen_part(LIBTOOLING ${_libtooling_ok}
             "install libclang-19-dev libclang-cpp19-dev llvm-19-dev (apt-get install ...)")

# NVRTC and the CUDA toolkit (JIT compile; no driver needed to compile).
if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
find_package(CUDAToolkit QUIET)
set(_nvrtc_ok OFF)
if(CUDAToolkit_FOUND AND TARGET CUDA::nvrtc)
  set(_nvrtc_ok ON)
endif()
cudagen_part(NVRTC ${_nvrtc_ok} "install the CUDA toolkit at /usr/local/cuda, or pass -DCUDAToolkit_ROOT=DIR")

# The host emulator's fibers (Boost.Context fcontext).
find_package(Boost QUIET COMPONENTS context)
cudagen_part(EMULATOR "${Boost_CONTEXT_FOUND}" "install libboost-context-dev (apt-get install libboost-context-dev)")

# cuobjdump, for the SASS checks of the generated kernels (tests/emulation/
# toolchains_test.cpp). The CUDA toolkit here has none; the PyPI wheels
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm do: scripts/dev.sh installs
# them into .cache/tools-venv.
find_program(CUDAGEN_CUOBJDUMP cuobjdump HINTS ${CUDAToolkit_ROOT}/bin)
if(NOT CUDAGEN_CUOBJDUMP)
  file(GLOB _wheel_cuobjdump ${PROJECT_SOURCE_DIR}/.cache/tools-venv/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump)
  if(_wheel_cuobjdump)
    list(GET _wheel_cuobjdump 0 _first)
    set(CUDAGEN_CUOBJDUMP ${_first} CACHE FILEPATH "cuobjdump" FORCE)
  endif()
endif()
# cuobjdump runs nvdisasm, which must lie beside it (the tests put its folder first on PATH).
set(_sass_ok OFF)
if(CUDAGEN_CUOBJDUMP)
  get_filename_component(_sass_dir ${CUDAGEN_CUOBJDUMP} DIRECTORY)
  if(EXISTS ${_sass_dir}/nvdisasm)
    set(_sass_ok ON)
  endif()
endif()
cudagen_part(SASS ${_sass_ok}
             "install cuobjdump and nvdisasm: python3 -m venv .cache/tools-venv && .cache/tools-venv/bin/pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (scripts/dev.sh does)")

# CuTe's headers (CUTLASS, from the PyPI wheel nvidia-cutlass; tests only): the
# independent oracle the Hopper mainloop's layouts and descriptors are checked
# against (tests/cute_oracle). They need CUDA's libcu++ (the toolkit's cccl).
file(GLOB _cute_include ${PROJECT_SOURCE_DIR}/.cache/tools-venv/lib/python3*/site-packages/cutlass_library/source/include)
set(_cute_ok OFF)
if(_cute_include AND CUDAToolkit_FOUND)
  list(GET _cute_include 0 CUDAGEN_CUTE_INCLUDE)
  if(EXISTS ${CUDAGEN_CUTE_INCLUDE}/cute/tensor.hpp)
    set(_cute_ok ON)
  endif()
endif()
cudagen_part(CUTE ${_cute_ok}
             "install CuTe's headers: python3 -m venv .cache/tools-venv && .cache/tools-venv/bin/pip install --no-deps nvidia-cutlass==4.2.0.0 (scripts/dev.sh does)")

# A pinned PyTorch 2.x from PyPI (tests only), beside Debian's 1.13, with torchvision and
# transformers: f16 training against torch.autocast and torch.amp.GradScaler, which 1.13 lacks on
# the CPU, the frontend on torch.export, and the model list. scripts/dev.sh installs them into
# .cache/torch2-venv.
set(CUDAGEN_TORCH2_VERSION 2.6.0)
file(GLOB _torch2 ${PROJECT_SOURCE_DIR}/.cache/torch2-venv/lib/python3*/site-packages/torch-${CUDAGEN_TORCH2_VERSION}*.dist-info)
file(GLOB _transformers ${PROJECT_SOURCE_DIR}/.cache/torch2-venv/lib/python3*/site-packages/transformers-*.dist-info)
set(_torch2_ok OFF)
if(_torch2 AND _transformers AND EXISTS ${PROJECT_SOURCE_DIR}/.cache/torch2-venv/bin/python)
  set(_torch2_ok ON)
  set(CUDAGEN_TORCH2_PYTHON ${PROJECT_SOURCE_DIR}/.cache/torch2-venv/bin/python)
endif()
cudagen_part(TORCH2 ${_torch2_ok}
             "install PyTorch ${CUDAGEN_TORCH2_VERSION}: python3 -m venv .cache/torch2-venv && .cache/torch2-venv/bin/pip install torch==${CUDAGEN_TORCH2_VERSION} torchvision==0.21.0 transformers==4.47.1 numpy (scripts/dev.sh does)")

# transformers beside Debian's PyTorch 1.13 (tests only): the model list's transformers models on
# the torch.fx path. scripts/dev.sh installs it into .cache/torch1-venv, which sees the system's
# packages (python3-torch, python3-torchvision).
file(GLOB _transformers1 ${PROJECT_SOURCE_DIR}/.cache/torch1-venv/lib/python3*/site-packages/transformers-*.dist-info)
set(_torch1_ok OFF)
if(_transformers1 AND EXISTS ${PROJECT_SOURCE_DIR}/.cache/torch1-venv/bin/python)
  set(_torch1_ok ON)
  set(CUDAGEN_TORCH1_PYTHON ${PROJECT_SOURCE_DIR}/.cache/torch1-venv/bin/python)
endif()
cudagen_part(TORCH1_TRANSFORMERS ${_torch1_ok}
             "install transformers beside Debian's PyTorch: /usr/bin/python3 -m venv --system-site-packages .cache/torch1-venv && .cache/torch1-venv/bin/pip install transformers==4.47.1 (scripts/dev.sh does)")

function(cudagen_report_parts)
  message(STATUS "cudagen parts:")
  foreach(part ${CUDAGEN_PARTS})
    message(STATUS "  ${part}: ${CUDAGEN_PART_STATUS_${part}}")
  endforeach()
endfunction()
