// Which forward values the backward keeps: the min-cut rematerialization decision on a joint
// forward/backward graph (after the AOTAutograd min-cut recomputation posts in the seeds, and
// DESIGN.md "Cost model for the cut").
//
// Phases, each its own function:
//   ClassifyRegions        tangent closure (nodes that depend on a backward input), nodes the
//                          forward outputs need, nodes the backward outputs need;
//   MarkParameterAliases   ZeRO-3: every node reached from a parameter through gathers, views,
//                          casts and getitems must be recomputed, so the backward reads the
//                          parameter (its shard) itself, never a gathered or downcast copy
//                          (not from a parameter saved as a copy: kCopiedWhenSaved);
//   ApplyCheckpointTags    CheckpointPolicy tags, with the ac_graph_id boundary rule: a tagged
//                          node feeding a later checkpoint region is saved, not recomputed
//                          (parameter aliases excepted: they are re-gathered, never saved);
//   BuildRematNetwork      node-split flow network (v_in -> v_out carries the cost of saving v):
//                            cost(v) = 0          static inputs (parameters, buffers live
//                                                 anyway), unless the compiler copies them
//                                                 when saved (kCopiedWhenSaved: 1 x bytes)
//                                      1 x bytes  materialized values (inputs, outputs of
//                                                 non-fusible ops, values with a non-fusible user,
//                                                 values read on both sides of a non-fusible op
//                                                 that depends on them)
//                                      2 x bytes  fusible intermediates (written in forward and
//                                                 read in backward, else never written at all)
//                                      +P         added for a PREFER_RECOMPUTE request (below)
//                                      +inf       views, tuples, SymFloats, MUST_RECOMPUTE
//                                                 tags, parameter aliases
//                            source -> v_in (+inf) forward nodes that may not be recomputed,
//                                                 every forward input among them (also one
//                                                 only the backward reads: a dynamic size)
//                            v_in -> sink (+inf)   tangent closure (computed in backward only)
//                            v_out -> sink (+inf)  other values the backward outputs need
//                            u_out -> v_in (+inf)  data edges
//   (the phases above are declared in remat_network.h, which the memory-budget sweep,
//   budget_cut.h, builds on: same constraints, 1x bytes, cost-only bans priced)
//   Solve                  exact minimum cut (maxflow/max_flow.h); the cut node arcs are the
//                          saved values. Of the minimum cuts (equal saved cost), the one
//                          nearest the sink: its recomputed set is a subset of every other
//                          minimum cut's (the lattice of minimum cuts), so a tie never costs
//                          extra recomputation, and it saves the latest values of the forward,
//                          which the backward frees soonest. The source-nearest cut recomputes
//                          the most: on T5 fp32 under inductor its step peak was 3.3% above
//                          torch's cut, the sink-nearest one's is 8% below.
//                          An unbounded cut means constraints that cannot all hold:
//                          PartitionConflictError names the chain of nodes and, for each, the
//                          constraint that put it there.
//
// How the constraints rank, strongest first:
//   1. Correctness: a random op is never run twice with a different result, and an effectful
//      op never twice at all. Random and effectful ops are never recomputed, with one
//      exception: a seeded random op (kRngReplayable) with a recompute tag, i.e. inside a
//      checkpoint region, may be, because the Python side then saves its forward RNG state and
//      replays it in the backward (torch's run_and_save_rng_state / run_with_rng_state), so
//      the recomputation draws exactly what the forward drew.
//   2. The ZeRO-3 marking (a must): a parameter alias is never saved. It overrides a
//      PREFER_SAVE tag and the region-boundary rule; an explicit MUST_SAVE on one conflicts.
//   3. MUST_RECOMPUTE / MUST_SAVE tags (musts: a conflict is an error).
//   4. PREFER_RECOMPUTE (a request: what torch.utils.checkpoint and HF's gradient
//      checkpointing put on every op of a region). Saving such a node costs a penalty
//      P = the smallest power of two above the sum of every finite saving cost, so any cut
//      that honours all requests (cost < P) beats every cut that does not, and one that must
//      break some breaks as few as it can: where torch's partitioner (which treats the request
//      as a must) finds a cut, this is a cut of the same constraints; where it fails, this
//      saves the requested node instead and records it (kRecomputeRequested in node_info).
//      Integer byte costs and a power-of-two P keep the flow arithmetic exact.
//   5. Cost: bytes, as above. PREFER_SAVE bans recomputation of untagged nodes.
//
// Policies: kConservative recomputes only fusible ops (views, casts, pointwise, cheap
// reductions), and no reduction that reads 4x the bytes it writes or more (a norm's statistics,
// a loss's log-sum-exp: cheap to save, a full pass over their input to recompute);
// kAggressive recomputes everything except random and compute-intensive ops.
// A recompute tag lifts both restrictions for its node (it is how a checkpoint region asks to
// recompute a matmul).
//
// Complexity: O(n + m) to build, plus one max-flow on 2n + 2 nodes and n + m + O(n) arcs.
// Deterministic: a pure function of the arrays; every rank gets the same saved set.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "graph/joint_graph.h"

namespace dcr {

enum class RematPolicy : uint8_t { kConservative = 0, kAggressive = 1 };

struct PartitionOptions {
  RematPolicy policy = RematPolicy::kConservative;
  bool mark_parameter_aliases = true;  // ZeRO-3 marking
};

// Bits of PartitionResult::node_info.
enum NodeInfoBit : uint8_t {
  kRequiredForward = 1u << 0,   // needed to compute the forward outputs
  kTangentClosure = 1u << 1,    // depends on a backward input: computed in backward only
  kRequiredBackward = 1u << 2,  // tangent closure plus values the backward outputs read
  kMustRecompute = 1u << 3,     // may not be saved (tag or parameter alias)
  kBanned = 1u << 4,            // may not be recomputed
  kParameterAlias = 1u << 5,    // marked by MarkParameterAliases
  kRecomputeRequested = 1u << 6,  // tagged PREFER_RECOMPUTE: saving it pays the penalty P
};

struct PartitionResult {
  std::vector<int64_t> saved_nodes;  // ascending node ids: the values the forward hands over
  double cut_cost = 0.0;             // sum of the saved nodes' costs (penalties included)
  double request_penalty = 0.0;      // P: the cost added for saving a PREFER_RECOMPUTE node
  std::vector<uint8_t> node_info;    // NodeInfoBit per node
};

// Constraints that cannot all hold. nodes() is the chain of graph nodes along one path of
// +inf arcs from the source to the sink; reasons()[i] says why node i is on it.
class PartitionConflictError : public std::runtime_error {
 public:
  PartitionConflictError(const std::string& msg, std::vector<int64_t> nodes,
                         std::vector<std::string> reasons)
      : std::runtime_error(msg), nodes_(std::move(nodes)), reasons_(std::move(reasons)) {}
  const std::vector<int64_t>& nodes() const { return nodes_; }
  const std::vector<std::string>& reasons() const { return reasons_; }

 private:
  std::vector<int64_t> nodes_;
  std::vector<std::string> reasons_;
};

// Validates `graph` (std::invalid_argument) and returns the saved set.
PartitionResult PartitionJointGraph(const JointGraphView& graph, const PartitionOptions& options);

}  // namespace dcr
