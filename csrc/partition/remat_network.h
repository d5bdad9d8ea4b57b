// The phases of the rematerialization cut (remat_partition.h), shared by the default cut and the
// memory-budget sweep (budget_cut.h). Internal to csrc/partition: no stability promise.
//
// The default cut builds the network once and solves it once. The budget sweep builds it with
// NetworkCosts{.bytes_only = true, .price_cost_bans = true}: saving costs 1x bytes, there is no
// PREFER_RECOMPUTE penalty, and each forward node that the policy bans from recomputation for
// cost reasons only gets a finite source arc (net.priced_arc[v]) whose capacity the sweep sets
// per solve. Every correctness constraint keeps its +inf arc either way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/joint_graph.h"
#include "maxflow/max_flow.h"
#include "partition/remat_partition.h"

namespace dcr::remat_internal {

// Why an arc is +inf (or what it costs); reported on conflicts.
enum class ArcWhy : uint8_t {
  kSaveCost,
  kData,
  kCannotSaveView,
  kCannotSaveNonTensor,
  kCannotSaveSymFloat,
  kCannotSaveTagged,
  kCannotSaveParameterAlias,
  kBanPrimal,
  kBanSeed,
  kBanMustSave,
  kBanRandom,
  kBanNotReplayable,
  kBanComputeIntensive,
  kBanNotFusible,
  kBanShrinkingReduction,
  kBanCollective,
  kBanParameterGather,  // a gather of a parameter that the ZeRO-3 marking left unmarked
  kSinkTangentClosure,
  kSinkBackwardOutput,
  kRecomputePrice,  // budget sweep: a cost-only ban turned into a price (finite)
};

const char* Describe(ArcWhy why);

// True for bans that exist only to save time: a compute-intensive op; under the conservative
// policy a non-fusible op or a shrinking reduction; a gather of a parameter (with the ZeRO-3
// marking off, running it again in the backward is a re-gather from the shard, as the marking
// would force, so what bans it is the collective's time, not correctness). The budget sweep may
// lift them at a price. Every other ban is about correctness (inputs, seeds, tags,
// random/effectful ops, other collectives) and stays +inf.
bool IsCostOnlyBan(ArcWhy why);

struct NetworkCosts {
  bool bytes_only = false;       // save cost 1x bytes, no 2x for fusible values, no penalty P
  bool price_cost_bans = false;  // cost-only bans become priced arcs (capacity 0 until set)
};

struct RematNetwork {
  int64_t num_graph_nodes = 0;
  int64_t num_nodes = 0, source = 0, sink = 0;
  std::vector<int64_t> tails, heads;  // arc v < num_graph_nodes is node v's v_in -> v_out arc
  std::vector<double> capacities;
  std::vector<ArcWhy> why;
  std::vector<double> node_cost;     // cost of node v's arc (arc index v)
  std::vector<int64_t> priced_arc;   // price_cost_bans: arc index of v's priced source arc, or -1
  double request_penalty = 0.0;      // P, added to the cost of each PREFER_RECOMPUTE node

  void Add(int64_t u, int64_t v, double c, ArcWhy w) {
    tails.push_back(u);
    heads.push_back(v);
    capacities.push_back(c);
    why.push_back(w);
  }
};

std::vector<uint8_t> ClassifyRegions(const JointGraphView& g, const Adjacency& adj);
std::vector<int64_t> MarkParameterAliases(const JointGraphView& g, const Adjacency& adj);
std::vector<RecomputeTag> ApplyCheckpointTags(const JointGraphView& g, const Adjacency& adj,
                                              const std::vector<int64_t>& alias_of);
RematNetwork BuildRematNetwork(const JointGraphView& g, const Adjacency& adj,
                               const std::vector<RecomputeTag>& tags,
                               const std::vector<int64_t>& alias_of, RematPolicy policy,
                               const NetworkCosts& costs, std::vector<uint8_t>& info);

// What the phases before a solve leave: the graph's adjacency, the per-node info
// (ClassifyRegions' regions plus BuildRematNetwork's marks) and the network.
struct Prepared {
  Adjacency adj;
  std::vector<uint8_t> info;
  RematNetwork net;
};

// The one setup sequence of the default cut and the budget sweep, so a phase added to one
// reaches both: g.Validate() (its std::invalid_argument), Adjacency, ClassifyRegions,
// MarkParameterAliases (when options.mark_parameter_aliases), ApplyCheckpointTags,
// BuildRematNetwork(options.policy, costs).
Prepared Prepare(const JointGraphView& g, const PartitionOptions& options,
                 const NetworkCosts& costs);

// Throws PartitionConflictError for an s-t path of +inf arcs (UnboundedCutError::path()).
[[noreturn]] void ThrowConflict(const RematNetwork& net, const std::vector<int64_t>& path);

// Cut nodes whose v_out reaches the sink through sink-side nodes: the values the backward reads.
std::vector<int64_t> UsedCutNodes(const RematNetwork& net, const MinCutResult& cut);

}  // namespace dcr::remat_internal
