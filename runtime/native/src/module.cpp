// Python bindings: the work runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "copy.h"
#ifdef UCM_WITH_CUDA
#include "cuda_copy.h"
#endif

namespace nb = nanobind;
using SegmentTuple = std::tuple<uintptr_t, int64_t, int64_t, int64_t, int64_t>;
using MoveFn = void (*)(const std::vector<ucm::Segment>&, const std::vector<int64_t>&, uintptr_t, int64_t, int);

static std::vector<ucm::Segment> segments_of(const std::vector<SegmentTuple>& in) {
  std::vector<ucm::Segment> out;
  out.reserve(in.size());
  for (const auto& [base, block_stride, chunks, chunk_stride, chunk_bytes] : in) {
    if (chunks < 1 || chunk_bytes < 1) throw std::invalid_argument("a segment needs chunks >= 1 and chunk_bytes >= 1");
    out.push_back({base, block_stride, chunks, chunk_stride, chunk_bytes});
  }
  return out;
}

NB_MODULE(ucm_native, m) {
  m.doc() = "UCM's native transfer layer";
  auto def_move = [&m](const char* name, MoveFn move, const char* doc) {
    m.def(
        name,
        [move](const std::vector<SegmentTuple>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
               int64_t row_stride, int threads) {
          auto segs = segments_of(segments);
          nb::gil_scoped_release release;
          move(segs, blocks, buffer, row_stride, threads);
        },
        nb::arg("segments"), nb::arg("blocks"), nb::arg("buffer"), nb::arg("row_stride"), nb::arg("threads") = 1, doc);
  };
  def_move("gather", ucm::gather, "Copy each block's segments, in order, into row i of the buffer.");
  def_move("scatter", ucm::scatter, "Copy row i of the buffer back into block i's segments.");
  m.def(
      "memcpy",
      [](uintptr_t dst, uintptr_t src, int64_t bytes, int threads) {
        nb::gil_scoped_release release;
        ucm::parallel_memcpy(dst, src, bytes, threads);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("bytes"), nb::arg("threads") = 1);
#ifdef UCM_WITH_CUDA
  m.attr("cuda") = true;
  m.def(
      "cuda_move",
      [](const std::vector<SegmentTuple>& segments, const std::vector<int64_t>& blocks, uintptr_t buffer,
         int64_t row_stride, bool to_buffer, uintptr_t stream) {
        std::vector<UcmCudaSegment> segs;
        for (const auto& s : segments_of(segments))
          segs.push_back({s.base, s.block_stride, s.chunks, s.chunk_stride, s.chunk_bytes});
        int err;
        {
          nb::gil_scoped_release release;
          err = ucm_cuda_move(segs.data(), static_cast<int>(segs.size()), blocks.data(),
                              static_cast<int64_t>(blocks.size()), reinterpret_cast<void*>(buffer), row_stride,
                              to_buffer, reinterpret_cast<void*>(stream));
        }
        if (err != 0) throw std::runtime_error(std::string("ucm_native.cuda_move: ") + ucm_cuda_error(err));
      },
      nb::arg("segments"), nb::arg("blocks"), nb::arg("buffer"), nb::arg("row_stride"), nb::arg("to_buffer"),
      nb::arg("stream") = 0, "gather (to_buffer) or scatter between device KV blocks and a buffer, one launch");
#else
  m.attr("cuda") = false;
#endif
}
