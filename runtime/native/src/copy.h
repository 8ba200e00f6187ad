// Block gather/scatter between paged KV tensors and contiguous store buffers (host memory).
#pragma once
#include <cstdint>
#include <vector>

namespace ucm {

// Where one layer's (or one K/V half's) bytes of a block live: block b's bytes are `chunks` runs of
// `chunk_bytes`, the first at base + b * block_stride, the next ones `chunk_stride` apart.
// (A [2, num_blocks, ...] layout is 2 chunks; a [num_blocks, ...] one is 1.)
struct Segment {
  uintptr_t base;
  int64_t block_stride;
  int64_t chunks;
  int64_t chunk_stride;
  int64_t chunk_bytes;
};

// A block's payload is its segments' bytes, in order; payload i sits at buffer + i * row_stride.
int64_t payload_bytes(const std::vector<Segment>& segments);
void gather(const std::vector<Segment>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
            int64_t row_stride, int threads);
void scatter(const std::vector<Segment>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
             int64_t row_stride, int threads);
// memcpy split over threads: the limit gather/scatter are measured against.
void parallel_memcpy(uintptr_t dst, uintptr_t src, int64_t bytes, int threads);

}  // namespace ucm
