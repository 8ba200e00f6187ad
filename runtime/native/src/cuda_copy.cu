// Gather/scatter of KV blocks between device paged tensors and a (pinned host or device) buffer in
// one kernel launch: the "SM copy" approach. Many small blocks cost one launch instead of one
// cudaMemcpyAsync each. Threads of a CUDA block copy one (block, segment chunk) with 16-byte
// accesses when both sides allow it.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda_copy.h"

namespace {

struct DeviceSegment {
  uintptr_t base;
  int64_t block_stride;
  int64_t chunks;
  int64_t chunk_stride;
  int64_t chunk_bytes;
  int64_t row_offset;  // where this segment's bytes start inside a payload row
};

template <bool ToBuffer>
__global__ void move_kernel(const DeviceSegment* segments, int num_segments, const int64_t* blocks,
                            char* buffer, int64_t row_stride) {
  // grid.x: payload rows (request blocks); grid.y: segment chunks, flattened.
  const int64_t row = blockIdx.x;
  int64_t unit = blockIdx.y;
  int s = 0;
  while (s < num_segments && unit >= segments[s].chunks) unit -= segments[s++].chunks;
  if (s >= num_segments) return;
  const DeviceSegment seg = segments[s];
  char* paged = reinterpret_cast<char*>(seg.base + blocks[row] * seg.block_stride + unit * seg.chunk_stride);
  char* flat = buffer + row * row_stride + seg.row_offset + unit * seg.chunk_bytes;
  char* dst = ToBuffer ? flat : paged;
  const char* src = ToBuffer ? paged : flat;
  const bool wide = (reinterpret_cast<uintptr_t>(dst) % 16 == 0) && (reinterpret_cast<uintptr_t>(src) % 16 == 0) &&
                    (seg.chunk_bytes % 16 == 0);
  if (wide) {
    const int64_t n = seg.chunk_bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
  } else {
    for (int64_t i = threadIdx.x; i < seg.chunk_bytes; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

extern "C" int ucm_cuda_move(const UcmCudaSegment* segments, int num_segments, const int64_t* blocks, int64_t num_blocks,
                             void* buffer, int64_t row_stride, int to_buffer, void* stream) {
  if (num_blocks == 0 || num_segments == 0) return 0;
  std::vector<DeviceSegment> host(num_segments);
  int64_t offset = 0, units = 0;
  for (int i = 0; i < num_segments; ++i) {
    host[i] = {segments[i].base, segments[i].block_stride, segments[i].chunks, segments[i].chunk_stride,
               segments[i].chunk_bytes, offset};
    offset += segments[i].chunks * segments[i].chunk_bytes;
    units += segments[i].chunks;
  }
  auto s = static_cast<cudaStream_t>(stream);
  DeviceSegment* d_segments = nullptr;
  int64_t* d_blocks = nullptr;
  cudaError_t err = cudaMallocAsync(&d_segments, sizeof(DeviceSegment) * num_segments, s);
  if (err == cudaSuccess) err = cudaMallocAsync(&d_blocks, sizeof(int64_t) * num_blocks, s);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(d_segments, host.data(), sizeof(DeviceSegment) * num_segments, cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(d_blocks, blocks, sizeof(int64_t) * num_blocks, cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) {
    dim3 grid(static_cast<unsigned>(num_blocks), static_cast<unsigned>(units));
    if (to_buffer)
      move_kernel<true><<<grid, 256, 0, s>>>(d_segments, num_segments, d_blocks, static_cast<char*>(buffer), row_stride);
    else
      move_kernel<false><<<grid, 256, 0, s>>>(d_segments, num_segments, d_blocks, static_cast<char*>(buffer), row_stride);
    err = cudaGetLastError();
  }
  if (d_segments) cudaFreeAsync(d_segments, s);
  if (d_blocks) cudaFreeAsync(d_blocks, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  return static_cast<int>(err);
}

extern "C" const char* ucm_cuda_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
