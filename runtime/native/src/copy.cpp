#include "copy.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace ucm {
namespace {

// Runs fn(begin, end) over [0, n) split into up to `threads` contiguous ranges.
template <typename Fn>
void parallel_for(int64_t n, int threads, Fn fn) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  const int64_t step = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const int64_t begin = t * step, end = std::min(n, begin + step);
    if (begin < end) pool.emplace_back(fn, begin, end);
  }
  fn(0, std::min(n, step));
  for (auto& th : pool) th.join();
}

template <bool ToBuffer>
void move_blocks(const std::vector<Segment>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
                 int64_t row_stride, int threads) {
  if (row_stride < payload_bytes(segments)) throw std::invalid_argument("row_stride is smaller than a payload");
  parallel_for(static_cast<int64_t>(blocks.size()), threads, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* row = reinterpret_cast<char*>(buffer + i * row_stride);
      for (const Segment& s : segments) {
        const char* block = reinterpret_cast<const char*>(s.base + blocks[i] * s.block_stride);
        for (int64_t c = 0; c < s.chunks; ++c) {
          char* paged = const_cast<char*>(block + c * s.chunk_stride);
          if (ToBuffer)
            std::memcpy(row, paged, s.chunk_bytes);
          else
            std::memcpy(paged, row, s.chunk_bytes);
          row += s.chunk_bytes;
        }
      }
    }
  });
}

}  // namespace

int64_t payload_bytes(const std::vector<Segment>& segments) {
  int64_t total = 0;
  for (const Segment& s : segments) total += s.chunks * s.chunk_bytes;
  return total;
}

void gather(const std::vector<Segment>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
            int64_t row_stride, int threads) {
  move_blocks<true>(segments, blocks, buffer, row_stride, threads);
}

void scatter(const std::vector<Segment>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
             int64_t row_stride, int threads) {
  move_blocks<false>(segments, blocks, buffer, row_stride, threads);
}

void parallel_memcpy(uintptr_t dst, uintptr_t src, int64_t bytes, int threads) {
  const int64_t pieces = std::max<int64_t>(1, threads);
  const int64_t step = (bytes + pieces - 1) / pieces;
  parallel_for(pieces, threads, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t off = p * step, n = std::min(step, bytes - off);
      if (n > 0) std::memcpy(reinterpret_cast<char*>(dst + off), reinterpret_cast<const char*>(src + off), n);
    }
  });
}

}  // namespace ucm
