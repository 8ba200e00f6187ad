// Whole-file block reads and writes, many files in parallel, optionally with O_DIRECT.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ucm {

// For each i: read file paths[i] (at most sizes[i] bytes) into buffers[i], or write sizes[i]
// bytes from buffers[i] to paths[i] (created or truncated). Returns per file the bytes moved, or
// -errno. With `direct`, I/O bypasses the page cache (O_DIRECT) through aligned bounce buffers
// where a buffer or size is unaligned; filesystems that refuse O_DIRECT (tmpfs) get buffered I/O.
std::vector<int64_t> read_files(const std::vector<std::string>& paths, const std::vector<uintptr_t>& buffers,
                                const std::vector<int64_t>& sizes, bool direct, int threads);
std::vector<int64_t> write_files(const std::vector<std::string>& paths, const std::vector<uintptr_t>& buffers,
                                 const std::vector<int64_t>& sizes, bool direct, int threads);

}  // namespace ucm
