#include "nccl_bucket.h"

#include <cstring>
#include <stdexcept>

namespace dcr::cuda {
namespace {

// Makes `device` current for the scope (NCCL and event calls act on the current device).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

void CheckNccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
  }
}

CudaEvent::CudaEvent() {
  CheckCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
}
CudaEvent::~CudaEvent() {
  if (event_) cudaEventDestroy(event_);
}
void CudaEvent::Record(cudaStream_t s) { CheckCuda(cudaEventRecord(event_, s), "cudaEventRecord"); }
void CudaEvent::Wait(cudaStream_t s) const {
  CheckCuda(cudaStreamWaitEvent(s, event_, 0), "cudaStreamWaitEvent");
}
void CudaEvent::Synchronize() const {
  CheckCuda(cudaEventSynchronize(event_), "cudaEventSynchronize");
}
bool CudaEvent::Query() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  CheckCuda(e, "cudaEventQuery");
  return true;
}

std::string NcclUniqueId() {
  ncclUniqueId id;
  CheckNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

int NcclVersion() {
  int v = 0;
  CheckNccl(ncclGetVersion(&v), "ncclGetVersion");
  return v;
}

NcclCommunicator::NcclCommunicator(const std::string& unique_id, int world_size, int rank,
                                   int device)
    : world_size_(world_size), rank_(rank), device_(device) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    throw std::invalid_argument("NCCL unique id must be " + std::to_string(sizeof(id.internal)) +
                                " bytes");
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank must be in [0, world_size)");
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  DeviceScope scope(device);
  inputs_ready_ = std::make_unique<CudaEvent>();
  CheckNccl(ncclCommInitRank(&comm_, world_size, id, rank), "ncclCommInitRank");
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_) {
    cudaSetDevice(device_);
    ncclCommDestroy(comm_);  // no throwing from a destructor
  }
}

void NcclCommunicator::Destroy() {
  if (!comm_) return;
  DeviceScope scope(device_);
  ncclComm_t comm = comm_;
  comm_ = nullptr;
  CheckNccl(ncclCommDestroy(comm), "ncclCommDestroy");
}

std::shared_ptr<CudaEvent> NcclCommunicator::AllGatherCast(
    const std::vector<BucketEntry>& bucket, SlotFill fill, int out_elem_bytes,
    CudaCastOptions options, cudaStream_t compute_stream, cudaStream_t comm_stream) {
  if (!comm_) throw std::runtime_error("NCCL communicator was destroyed");
  const bool cast = fill != SlotFill::kCopy;
  if (cast && out_elem_bytes != 2) throw std::invalid_argument("cast outputs are 16-bit");
  DeviceScope scope(device_);

  // One event reused: cudaStreamWaitEvent captures the record that precedes it.
  inputs_ready_->Record(compute_stream);
  inputs_ready_->Wait(comm_stream);

  auto slot = [&](const BucketEntry& e) {
    return static_cast<char*>(e.out) + static_cast<int64_t>(rank_) * e.shard_numel * out_elem_bytes;
  };
  if (cast) {
    std::vector<CastDescriptor> descs;
    descs.reserve(bucket.size());
    for (const BucketEntry& e : bucket) {
      descs.push_back({static_cast<const float*>(e.shard), reinterpret_cast<uint16_t*>(slot(e)),
                       e.shard_numel});
    }
    CastIntoSlots(descs,
                  fill == SlotFill::kCastBFloat16 ? CastTarget::kBFloat16 : CastTarget::kFloat16,
                  options, comm_stream);
  } else {
    for (const BucketEntry& e : bucket) {
      if (e.shard == slot(e) || e.shard_numel == 0) continue;
      CheckCuda(cudaMemcpyAsync(slot(e), e.shard, e.shard_numel * out_elem_bytes,
                                cudaMemcpyDeviceToDevice, comm_stream),
                "cudaMemcpyAsync(shard -> slot)");
    }
  }

  // Allgather moves bytes only: send them as ncclInt8 whatever the dtype. In place: the send
  // buffer is this rank's slot of the receive buffer.
  CheckNccl(ncclGroupStart(), "ncclGroupStart");
  for (const BucketEntry& e : bucket) {
    const size_t bytes = static_cast<size_t>(e.shard_numel) * out_elem_bytes;
    if (bytes == 0) continue;
    const ncclResult_t r = ncclAllGather(slot(e), e.out, bytes, ncclInt8, comm_, comm_stream);
    if (r != ncclSuccess) {
      ncclGroupEnd();
      CheckNccl(r, "ncclAllGather");
    }
  }
  CheckNccl(ncclGroupEnd(), "ncclGroupEnd");

  auto done = std::make_shared<CudaEvent>();
  done->Record(comm_stream);
  return done;
}

}  // namespace dcr::cuda
