// The _cuda module: pybind11 over ops/ (cast kernel, NCCL bucket gather). Pointers and
// streams arrive as Python ints (tensor.data_ptr(), torch.cuda.Stream.cuda_stream); the Python
// layer (deepcompile_remat/ops) checks dtypes, devices, sizes and keeps tensors alive. Every
// call that can block (communicator init, event sync) releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "cast_kernel.h"
#include "kernels/cast_bits.h"
#include "nccl_bucket.h"

namespace py = pybind11;
using namespace dcr::cuda;

namespace {

cudaStream_t AsStream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

CudaCastOptions ParseNan(const std::string& nan_mode, int canonical_nan) {
  CudaCastOptions o;
  if (nan_mode == "quiet") {
    o.nan_mode = dcr::castbits::kNanQuiet;
  } else if (nan_mode == "canonical") {
    o.nan_mode = dcr::castbits::kNanCanonical;
  } else {
    throw py::value_error("nan_mode must be 'quiet' or 'canonical'");
  }
  o.canonical_nan = static_cast<uint16_t>(canonical_nan);
  return o;
}

CastTarget ParseTarget(const std::string& dtype) {
  if (dtype == "bfloat16") return CastTarget::kBFloat16;
  if (dtype == "float16") return CastTarget::kFloat16;
  throw py::value_error("dtype must be 'bfloat16' or 'float16'");
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "deepcompile_remat CUDA + NCCL kernels (no torch at the C++ level)";
  m.attr("nccl_version") = NcclVersion();

  m.def(
      "cast_into_slots",
      [](const std::vector<uintptr_t>& srcs, const std::vector<uintptr_t>& dsts,
         const std::vector<int64_t>& counts, const std::string& dtype,
         const std::string& nan_mode, int canonical_nan, uintptr_t stream) {
        if (srcs.size() != dsts.size() || srcs.size() != counts.size()) {
          throw py::value_error("srcs, dsts and counts must have the same length");
        }
        std::vector<CastDescriptor> descs;
        for (size_t i = 0; i < srcs.size(); ++i) {
          descs.push_back({reinterpret_cast<const float*>(srcs[i]),
                           reinterpret_cast<uint16_t*>(dsts[i]), counts[i]});
        }
        CastIntoSlots(descs, ParseTarget(dtype), ParseNan(nan_mode, canonical_nan),
                      AsStream(stream));
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("counts"), py::arg("dtype"),
      py::arg("nan_mode"), py::arg("canonical_nan"), py::arg("stream"),
      "One multi-tensor launch on `stream`: srcs[i] (fp32 device pointer) cast into dsts[i] "
      "(16-bit slot pointer), counts[i] elements each.");

  m.def("nccl_unique_id", [] { return py::bytes(NcclUniqueId()); });

  py::class_<CudaEvent, std::shared_ptr<CudaEvent>>(m, "Event")
      .def("wait", [](const CudaEvent& e, uintptr_t stream) { e.Wait(AsStream(stream)); },
           py::arg("stream"), "Makes `stream` wait for the event (the host does not wait).")
      .def("synchronize", &CudaEvent::Synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &CudaEvent::Query);

  py::class_<NcclCommunicator>(m, "NcclCommunicator")
      .def(py::init([](py::bytes unique_id, int world_size, int rank, int device) {
             std::string id = unique_id;
             py::gil_scoped_release release;
             return new NcclCommunicator(id, world_size, rank, device);
           }),
           py::arg("unique_id"), py::arg("world_size"), py::arg("rank"), py::arg("device"))
      .def("destroy", &NcclCommunicator::Destroy, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("destroyed", &NcclCommunicator::destroyed)
      .def_property_readonly("world_size", &NcclCommunicator::world_size)
      .def_property_readonly("rank", &NcclCommunicator::rank)
      .def_property_readonly("device", &NcclCommunicator::device)
      .def(
          "allgather_cast",
          [](NcclCommunicator& c, const std::vector<uintptr_t>& shards,
             const std::vector<uintptr_t>& outs, const std::vector<int64_t>& shard_numels,
             const std::string& fill, int out_elem_bytes, const std::string& nan_mode,
             int canonical_nan, uintptr_t compute_stream, uintptr_t comm_stream) {
            if (shards.size() != outs.size() || shards.size() != shard_numels.size()) {
              throw py::value_error("shards, outs and shard_numels must have the same length");
            }
            SlotFill f = SlotFill::kCopy;
            if (fill == "bfloat16") f = SlotFill::kCastBFloat16;
            else if (fill == "float16") f = SlotFill::kCastFloat16;
            else if (fill != "copy") throw py::value_error("fill: bfloat16, float16 or copy");
            std::vector<BucketEntry> bucket;
            for (size_t i = 0; i < shards.size(); ++i) {
              bucket.push_back({reinterpret_cast<const void*>(shards[i]),
                                reinterpret_cast<void*>(outs[i]), shard_numels[i]});
            }
            const CudaCastOptions opts =
                f == SlotFill::kCopy ? CudaCastOptions{} : ParseNan(nan_mode, canonical_nan);
            py::gil_scoped_release release;
            return c.AllGatherCast(bucket, f, out_elem_bytes, opts, AsStream(compute_stream),
                                   AsStream(comm_stream));
          },
          py::arg("shards"), py::arg("outs"), py::arg("shard_numels"), py::arg("fill"),
          py::arg("out_elem_bytes"), py::arg("nan_mode"), py::arg("canonical_nan"),
          py::arg("compute_stream"), py::arg("comm_stream"),
          "Comm stream waits for compute, casts/copies each shard into its slot, one grouped "
          "in-place allgather; returns the Event recorded on the comm stream after it.");
}
