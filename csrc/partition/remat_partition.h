// Which forward values the backward keeps: the min-cut rematerialization decision on a joint
// forward/backward graph (after the AOTAutograd min-cut recomputation posts in the seeds, and
// DESIGN.md "Cost model for the cut").
//
// Phases, each its own function:
//   ClassifyRegions        tangent closure (nodes that depend on a backward input), nodes the
//                          forward outputs need, nodes the backward outputs need;
//   ApplyCheckpointTags    CheckpointPolicy tags, with the ac_graph_id boundary rule: a tagged
//                          node feeding a later checkpoint region is saved, not recomputed;
//   MarkParameterAliases   ZeRO-3: every node reached from a parameter through gathers, views,
//                          casts and getitems must be recomputed, so the backward reads the
//                          parameter (its shard) itself, never a gathered or downcast copy;
//   BuildRematNetwork      node-split flow network (v_in -> v_out carries the cost of saving v):
//                            cost(v) = 0          static inputs (parameters, buffers live anyway)
//                                      1 x bytes  materialized values (inputs, outputs of
//                                                 non-fusible ops, values with a non-fusible user)
//                                      2 x bytes  fusible intermediates (written in forward and
//                                                 read in backward, else never written at all)
//                                      +inf       views, tuples, SymFloats, must-recompute nodes
//                            source -> v_in (+inf) forward nodes that may not be recomputed
//                            v_in -> sink (+inf)   tangent closure (computed in backward only)
//                            v_out -> sink (+inf)  other values the backward outputs need
//                            u_out -> v_in (+inf)  data edges
//   Solve                  exact minimum cut (maxflow/max_flow.h); the cut node arcs are the
//                          saved values. An unbounded cut means constraints that cannot all
//                          hold: PartitionConflictError names the chain of nodes and, for each,
//                          the constraint that put it there.
//
// Policies: kConservative recomputes only fusible ops (views, casts, pointwise, cheap
// reductions); kAggressive recomputes everything except random and compute-intensive ops.
// Random ops are never recomputed under either.
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
};

struct PartitionResult {
  std::vector<int64_t> saved_nodes;  // ascending node ids: the values the forward hands over
  double cut_cost = 0.0;             // sum of the saved nodes' costs
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
