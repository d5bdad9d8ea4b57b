// Compact IR of an AOTAutograd joint forward/backward graph, as the Python fx bridge exports it
// (deepcompile_remat/partition/fx_export.py). No torch here: nodes are ids in FX order, which
// is a topological order, and each carries a byte size, an op class and flags.
//
// Invariants (JointGraphView::Validate checks them):
//   - every array indexed by node has num_nodes entries;
//   - data edges producer -> consumer satisfy producer < consumer (FX order is topological);
//   - bytes[v] >= 0 (may be +inf for values that cannot be stored, e.g. tuples);
//   - fwd_outputs / bwd_outputs hold node ids in range.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/span.h"

namespace dcr {

// What kind of operation produces a node. The partition policies are defined on these.
enum class OpClass : uint8_t {
  kPlaceholder = 0,       // graph input: primal, tangent, RNG seed
  kView = 1,              // aliasing op (view, t, permute, expand, slice, ...): free to redo
  kCast = 2,              // dtype conversion (convert_element_type, _to_copy)
  kPointwise = 3,         // fusible elementwise op (incl. cheap creation ops)
  kReduction = 4,         // cheap fusible reduction (sum, mean, amax, var, ...)
  kComputeIntensive = 5,  // mm, bmm, convolution, attention: never recomputed by default
  kRandom = 6,            // RNG or effectful op: recomputing it draws anew or repeats an effect,
                          // so never recomputed, except a kRngReplayable op in a checkpoint
                          // region (remat_partition.h)
  kGather = 7,            // parameter gather / wait (ZeRO-3 allgather, functional collectives)
  kGetItem = 8,           // element of a multi-output op's tuple
  kOther = 9,             // anything else: not fusible
  kNumClasses = 10,
};

bool IsFusible(OpClass c);
const char* OpClassName(OpClass c);

// Per-node flags, bitwise or'ed.
enum NodeFlag : uint32_t {
  kPrimal = 1u << 0,            // forward input (placeholder that is not a tangent or seed)
  kBackwardInput = 1u << 1,     // tangent or backward RNG seed: available only in backward
  kForwardSeed = 1u << 2,       // forward RNG seed input
  kStaticInput = 1u << 3,       // lives for the whole step anyway (parameter, buffer): free to save
  kParameter = 1u << 4,         // a parameter (ZeRO-3: its shard); its aliases must be recomputed
  kNonTensor = 1u << 5,         // value is a tuple/list/opaque: cannot be saved as is
  kSymInt = 1u << 6,            // SymInt / SymBool value: saved as a scalar
  kSymFloat = 1u << 7,          // SymFloat: never saved
  kMustBeInBackward = 1u << 8,  // partitioner tag: computed in the backward only
  kRngReplayable = 1u << 9,     // seeded random op (Tag.nondeterministic_seeded): its forward
                                // RNG state can be saved and replayed in the backward, so a
                                // recomputation draws exactly what the forward drew
  kPinnedToForward = 1u << 10,  // the cut treats it as a forward node (its bans on
                                // recomputation apply) even where no forward output needs it:
                                // a value computed for the backward only, from forward values
                                // that the backward will not have (ZeRO-3's secondary shards)
  kCopiedWhenSaved = 1u << 11,  // an input the compiler re-lays out when the forward hands it
                                // to the backward (inductor stores a conv net's 4-D inputs
                                // channels-last): saving it writes a copy, so it costs its
                                // bytes even when static, and it roots no parameter aliases
};

// CheckpointPolicy tags from node.meta["recompute"] (torch.utils.checkpoint.CheckpointPolicy).
enum class RecomputeTag : int8_t {
  kNone = 0,
  kMustSave = 1,
  kPreferSave = 2,
  kMustRecompute = 3,
  kPreferRecompute = 4,
};

// Borrowed view of the exported arrays (owned by the caller, e.g. numpy).
struct JointGraphView {
  int64_t num_nodes = 0;
  Span<double> bytes;
  Span<uint8_t> op_class;
  Span<uint32_t> flags;
  Span<int8_t> recompute;
  Span<int64_t> ac_graph_id;  // -1 where the node has no "ac_graph_id"
  Span<int64_t> edge_tails;   // producer
  Span<int64_t> edge_heads;   // consumer
  Span<int64_t> fwd_outputs;
  Span<int64_t> bwd_outputs;

  // Throws std::invalid_argument naming the array and the index at fault.
  void Validate() const;
};

// Adjacency of a validated graph in CSR form, both directions, edges in input order.
struct Adjacency {
  std::vector<int64_t> user_first, users;          // users of v: users[user_first[v]..)
  std::vector<int64_t> producer_first, producers;  // inputs of v

  explicit Adjacency(const JointGraphView& g);
  template <typename F>
  void ForEachUser(int64_t v, F&& f) const {
    for (int64_t k = user_first[v]; k < user_first[v + 1]; ++k) f(users[k]);
  }
  template <typename F>
  void ForEachProducer(int64_t v, F&& f) const {
    for (int64_t k = producer_first[v]; k < producer_first[v + 1]; ++k) f(producers[k]);
  }
};

}  // namespace dcr
