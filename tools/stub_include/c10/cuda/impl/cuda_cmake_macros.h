// Stand-in for the header a CUDA build of torch generates and the CPU wheel lacks; used only by
// tools/check_cuda.sh to syntax-check the *_cuda.cpp bindings against the CPU wheel's headers.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
