// A NCCL communicator for one torch.distributed group and the bucketed allgather-with-cast
// over it, for benchmarks/bench_allgather_cast.py only (the runtime gathers through the process
// group's own NCCL: deepcompile_remat/ops/collectives.py). Plain C++ (no torch): device
// pointers and cudaStream_t handles come from Python.
//
// Invariants:
//   - one communicator per (process group, device), created once from a unique id that rank 0
//     generated and Python broadcast through the group; destroyed by Destroy() or the
//     destructor (whichever comes first), never twice;
//   - AllGatherCast is stream-ordered: the comm stream first waits for everything queued on
//     the compute stream so far (the shards are ready), then runs the cast kernel and one
//     ncclGroupStart/End of in-place allgathers (each output's own slot is the send buffer),
//     then records the returned event. The caller makes the compute stream wait on that event
//     before it reads the outputs, and keeps shards/outputs alive until then (the benchmark
//     synchronizes before it frees them).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cast_kernel.h"

namespace dcr::cuda {

void CheckNccl(ncclResult_t r, const char* what);

// A cudaEvent_t (timing disabled) owned by a shared_ptr: Python work handles hold it.
class CudaEvent {
 public:
  CudaEvent();
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void Record(cudaStream_t stream);
  void Wait(cudaStream_t stream) const;  // stream waits; the host does not
  void Synchronize() const;              // host waits
  bool Query() const;                    // completed?

 private:
  cudaEvent_t event_ = nullptr;
};

// What to do with each shard before the gather.
enum class SlotFill : int {
  kCastBFloat16 = 0,  // fp32 shard -> bf16 slot
  kCastFloat16 = 1,   // fp32 shard -> fp16 slot
  kCopy = 2,          // same dtype: byte copy into the slot (skipped when shard is the slot)
};

// One parameter of a bucket: the local shard and the full output (world * shard_numel
// elements of out_elem_bytes each). This rank's slot is out + rank * shard_numel elements.
struct BucketEntry {
  const void* shard;
  void* out;
  int64_t shard_numel;
};

std::string NcclUniqueId();  // 128 raw bytes
int NcclVersion();

class NcclCommunicator {
 public:
  // Blocks until all `world_size` ranks have called it with the same id (release the GIL).
  NcclCommunicator(const std::string& unique_id, int world_size, int rank, int device);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  void Destroy();
  bool destroyed() const { return comm_ == nullptr; }
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  int device() const { return device_; }

  std::shared_ptr<CudaEvent> AllGatherCast(const std::vector<BucketEntry>& bucket, SlotFill fill,
                                           int out_elem_bytes, CudaCastOptions options,
                                           cudaStream_t compute_stream,
                                           cudaStream_t comm_stream);

 private:
  ncclComm_t comm_ = nullptr;
  int world_size_;
  int rank_;
  int device_;
  std::unique_ptr<CudaEvent> inputs_ready_;  // created on device_
};

}  // namespace dcr::cuda
