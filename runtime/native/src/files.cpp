#include "files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

namespace ucm {
namespace {

constexpr int64_t kAlign = 4096;

int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
bool aligned(uintptr_t p) { return p % kAlign == 0; }

struct Bounce {
  char* data = nullptr;
  int64_t size = 0;
  ~Bounce() { std::free(data); }
  char* get(int64_t n) {
    if (n > size) {
      std::free(data);
      data = nullptr;
      if (posix_memalign(reinterpret_cast<void**>(&data), kAlign, n) != 0) return nullptr;
      size = n;
    }
    return data;
  }
};

int open_file(const std::string& path, int flags, bool direct, bool* used_direct) {
  *used_direct = false;
  if (direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      *used_direct = true;
      return fd;
    }
    if (errno != EINVAL) return -errno;  // EINVAL: this filesystem has no O_DIRECT
  }
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  return fd >= 0 ? fd : -errno;
}

int64_t read_all(int fd, char* dst, int64_t n) {
  int64_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, dst + done, n - done, done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    done += r;
  }
  return done;
}

int64_t write_all(int fd, const char* src, int64_t n) {
  int64_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd, src + done, n - done, done);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    done += w;
  }
  return done;
}

int64_t read_one(const std::string& path, char* dst, int64_t size, bool direct, Bounce& bounce) {
  bool used_direct;
  int fd = open_file(path, O_RDONLY, direct, &used_direct);
  if (fd < 0) return fd;
  int64_t got;
  if (used_direct && !(aligned(reinterpret_cast<uintptr_t>(dst)) && size % kAlign == 0)) {
    // O_DIRECT needs aligned memory and lengths: read whole pages into the bounce buffer.
    char* b = bounce.get(round_up(size));
    got = b ? read_all(fd, b, round_up(size)) : -ENOMEM;
    if (got > 0) std::memcpy(dst, b, std::min(got, size));
    got = std::min(got, size);
  } else {
    got = read_all(fd, dst, size);
  }
  ::close(fd);
  return got;
}

int64_t write_one(const std::string& path, const char* src, int64_t size, bool direct, Bounce& bounce) {
  bool used_direct;
  int fd = open_file(path, O_WRONLY | O_CREAT | O_TRUNC, direct, &used_direct);
  if (fd < 0) return fd;
  int64_t put;
  if (used_direct && !(aligned(reinterpret_cast<uintptr_t>(src)) && size % kAlign == 0)) {
    // Write whole pages from an aligned copy, then cut the file to its real length.
    char* b = bounce.get(round_up(size));
    if (b == nullptr) {
      put = -ENOMEM;
    } else {
      std::memcpy(b, src, size);
      std::memset(b + size, 0, round_up(size) - size);
      put = write_all(fd, b, round_up(size));
      if (put >= 0) put = ::ftruncate(fd, size) == 0 ? size : -errno;
    }
  } else {
    put = write_all(fd, src, size);
  }
  if (::close(fd) != 0 && put >= 0) put = -errno;
  return put;
}

template <typename Fn>
std::vector<int64_t> each_file(size_t n, int threads, Fn fn) {
  std::vector<int64_t> results(n, 0);
  std::atomic<size_t> next{0};
  auto work = [&]() {
    Bounce bounce;
    for (size_t i = next++; i < n; i = next++) results[i] = fn(i, bounce);
  };
  const int count = static_cast<int>(std::max<size_t>(1, std::min<size_t>(threads, n)));
  std::vector<std::thread> pool;
  for (int t = 1; t < count; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return results;
}

}  // namespace

std::vector<int64_t> read_files(const std::vector<std::string>& paths, const std::vector<uintptr_t>& buffers,
                                const std::vector<int64_t>& sizes, bool direct, int threads) {
  return each_file(paths.size(), threads, [&](size_t i, Bounce& b) {
    return read_one(paths[i], reinterpret_cast<char*>(buffers[i]), sizes[i], direct, b);
  });
}

std::vector<int64_t> write_files(const std::vector<std::string>& paths, const std::vector<uintptr_t>& buffers,
                                 const std::vector<int64_t>& sizes, bool direct, int threads) {
  return each_file(paths.size(), threads, [&](size_t i, Bounce& b) {
    return write_one(paths[i], reinterpret_cast<const char*>(buffers[i]), sizes[i], direct, b);
  });
}

}  // namespace ucm
