// C interface of the CUDA kernels (cuda_copy.cu), called by the module when built with CUDA.
#pragma once
#include <cstdint>

extern "C" {
struct UcmCudaSegment {
  uintptr_t base;
  int64_t block_stride;
  int64_t chunks;
  int64_t chunk_stride;
  int64_t chunk_bytes;
};
// Returns a cudaError_t (0: success). The buffer may be pinned host memory or device memory.
int ucm_cuda_move(const UcmCudaSegment* segments, int num_segments, const int64_t* blocks, int64_t num_blocks,
                  void* buffer, int64_t row_stride, int to_buffer, void* stream);
const char* ucm_cuda_error(int code);
}
