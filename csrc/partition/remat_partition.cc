#include "partition/remat_partition.h"

#include <cmath>
#include <limits>
#include <utility>

#include "maxflow/max_flow.h"
#include "maxflow/node_split.h"
#include "partition/remat_network.h"

namespace dcr {
namespace remat_internal {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

OpClass ClassOf(const JointGraphView& g, int64_t v) { return static_cast<OpClass>(g.op_class[v]); }
bool Has(const JointGraphView& g, int64_t v, uint32_t flag) { return (g.flags[v] & flag) != 0; }

bool IsRecomputeTag(RecomputeTag t) {
  return t == RecomputeTag::kMustRecompute || t == RecomputeTag::kPreferRecompute;
}

}  // namespace

// --- ClassifyRegions ---------------------------------------------------------------------------
std::vector<uint8_t> ClassifyRegions(const JointGraphView& g, const Adjacency& adj) {
  const int64_t n = g.num_nodes;
  std::vector<uint8_t> info(n, 0);
  // Tangent closure: forward propagation in topological order.
  for (int64_t v = 0; v < n; ++v) {
    if (Has(g, v, kBackwardInput) || Has(g, v, kMustBeInBackward)) info[v] |= kTangentClosure;
    if (info[v] & kTangentClosure) adj.ForEachUser(v, [&](int64_t u) { info[u] |= kTangentClosure; });
  }
  // Required forward: ancestors of the forward outputs, reverse topological order.
  for (int64_t o : g.fwd_outputs) info[o] |= kRequiredForward;
  for (int64_t v = n - 1; v >= 0; --v) {
    if (info[v] & kRequiredForward)
      adj.ForEachProducer(v, [&](int64_t p) { info[p] |= kRequiredForward; });
  }
  for (int64_t v = 0; v < n; ++v)
    if (info[v] & kTangentClosure) info[v] |= kRequiredBackward;
  for (int64_t o : g.bwd_outputs) info[o] |= kRequiredBackward;
  return info;
}

// --- MarkParameterAliases ----------------------------------------------------------------------
// alias_of[v] = the parameter node v derives from through gathers/views/casts/getitems, or -1.
// A parameter the compiler copies when it is saved roots none: the marking trades saving an
// alias for saving the parameter, which is free only where no copy is written (a conv weight
// under inductor's channels-last layout would be saved as a full-precision copy, twice the
// bytes of the bf16 cast the marking refused to save).
std::vector<int64_t> MarkParameterAliases(const JointGraphView& g, const Adjacency& adj) {
  std::vector<int64_t> alias_of(g.num_nodes, -1);
  for (int64_t v = 0; v < g.num_nodes; ++v) {
    const bool root_here = Has(g, v, kParameter) && !Has(g, v, kCopiedWhenSaved);
    const int64_t root = root_here ? v : alias_of[v];
    if (root < 0) continue;
    adj.ForEachUser(v, [&](int64_t u) {
      switch (ClassOf(g, u)) {
        case OpClass::kGather:
        case OpClass::kView:
        case OpClass::kCast:
        case OpClass::kGetItem:
          if (alias_of[u] < 0) alias_of[u] = root;  // first (lowest-id) parameter wins
          break;
        default:
          break;
      }
    });
  }
  return alias_of;
}

// --- ApplyCheckpointTags -----------------------------------------------------------------------
// A recompute-tagged node whose recompute-tagged user lies in a later checkpoint region is the
// boundary between two regions: it is saved (as torch.utils.checkpoint stashes region outputs),
// unless it is a parameter alias (re-gathered from the shard in the backward, never saved).
std::vector<RecomputeTag> ApplyCheckpointTags(const JointGraphView& g, const Adjacency& adj,
                                              const std::vector<int64_t>& alias_of) {
  std::vector<RecomputeTag> tags(g.num_nodes);
  for (int64_t v = 0; v < g.num_nodes; ++v) {
    tags[v] = static_cast<RecomputeTag>(g.recompute[v]);
    // A random or effectful op that cannot be replayed yields a region's request: its result
    // is saved. (MUST_RECOMPUTE on it stays, and conflicts.)
    if (tags[v] == RecomputeTag::kPreferRecompute && ClassOf(g, v) == OpClass::kRandom &&
        !Has(g, v, kRngReplayable))
      tags[v] = RecomputeTag::kNone;
  }
  for (int64_t v = 0; v < g.num_nodes; ++v) {
    if (!IsRecomputeTag(static_cast<RecomputeTag>(g.recompute[v])) || g.ac_graph_id[v] < 0 ||
        alias_of[v] >= 0)
      continue;
    bool boundary = false;
    adj.ForEachUser(v, [&](int64_t u) {
      boundary |= IsRecomputeTag(static_cast<RecomputeTag>(g.recompute[u])) &&
                  g.ac_graph_id[u] > g.ac_graph_id[v];
    });
    if (boundary) tags[v] = RecomputeTag::kMustSave;
  }
  return tags;
}

// --- BuildRematNetwork ---------------------------------------------------------------------------
const char* Describe(ArcWhy why) {
  switch (why) {
    case ArcWhy::kSaveCost: return "saving it has a finite cost";
    case ArcWhy::kData: return "depends on the previous node";
    case ArcWhy::kCannotSaveView: return "cannot be saved: a view (its base is saved instead)";
    case ArcWhy::kCannotSaveNonTensor: return "cannot be saved: not a tensor (tuple/list/object)";
    case ArcWhy::kCannotSaveSymFloat: return "cannot be saved: a SymFloat";
    case ArcWhy::kCannotSaveTagged: return "cannot be saved: tagged MUST_RECOMPUTE";
    case ArcWhy::kCannotSaveParameterAlias:
      return "cannot be saved: a gathered/viewed/cast alias of a parameter (ZeRO-3 marking)";
    case ArcWhy::kBanPrimal: return "cannot be recomputed: a forward input";
    case ArcWhy::kBanSeed: return "cannot be recomputed: a forward RNG seed";
    case ArcWhy::kBanMustSave: return "cannot be recomputed: tagged MUST_SAVE/PREFER_SAVE";
    case ArcWhy::kBanRandom:
      return "cannot be recomputed: a random op outside a checkpoint region (its draw is saved)";
    case ArcWhy::kBanNotReplayable:
      return "cannot be recomputed: an effectful or unseeded random op (no RNG state to replay; "
             "running it again repeats its effect or draws anew)";
    case ArcWhy::kBanComputeIntensive: return "cannot be recomputed: a compute-intensive op";
    case ArcWhy::kBanNotFusible: return "cannot be recomputed: not fusible (conservative policy)";
    case ArcWhy::kBanShrinkingReduction:
      return "cannot be recomputed: a reduction reading 4x its result or more (conservative policy)";
    case ArcWhy::kBanCollective: return "cannot be recomputed: a collective on a non-parameter";
    case ArcWhy::kBanParameterGather:
      return "cannot be recomputed: a parameter gather, kept (ZeRO-3 marking off)";
    case ArcWhy::kSinkTangentClosure: return "must be computed in backward: depends on a tangent";
    case ArcWhy::kSinkBackwardOutput: return "must be available in backward: a gradient needs it";
    case ArcWhy::kRecomputePrice: return "recomputing it has a price (memory-budget sweep)";
  }
  return "?";
}

bool IsCostOnlyBan(ArcWhy why) {
  return why == ArcWhy::kBanComputeIntensive || why == ArcWhy::kBanNotFusible ||
         why == ArcWhy::kBanShrinkingReduction || why == ArcWhy::kBanParameterGather;
}

// Returns the reason v may not be recomputed, or false.
namespace {
// A reduction that reads at least 4x the bytes it writes: a norm's statistics, a softmax's or a
// loss's max and log-sum-exp, a mean over a large axis.
bool IsShrinkingReduction(const JointGraphView& g, const Adjacency& adj, int64_t v) {
  if (ClassOf(g, v) != OpClass::kReduction) return false;
  int64_t read = 0;
  adj.ForEachProducer(v, [&](int64_t u) { read += g.bytes[u]; });
  return g.bytes[v] * 4 < read;
}

bool BanReason(const JointGraphView& g, const Adjacency& adj, int64_t v, RecomputeTag tag,
               RematPolicy policy, int64_t alias_of, ArcWhy* why) {
  const OpClass c = ClassOf(g, v);
  if (Has(g, v, kPrimal)) return *why = ArcWhy::kBanPrimal, true;
  if (Has(g, v, kForwardSeed)) return *why = ArcWhy::kBanSeed, true;
  // A getitem's MUST_SAVE is how torch pins an effectful op's results (force_save_effectful_ops):
  // honour it before the free-alias rule below, or the op could run again in the backward.
  if (tag == RecomputeTag::kMustSave && c == OpClass::kGetItem)
    return *why = ArcWhy::kBanMustSave, true;
  if (c == OpClass::kView || c == OpClass::kGetItem || c == OpClass::kPlaceholder) return false;
  if (tag == RecomputeTag::kMustSave) return *why = ArcWhy::kBanMustSave, true;
  if (c == OpClass::kRandom) {
    // Recomputed only where a region asks and the forward's draw can be replayed.
    if (IsRecomputeTag(tag) && Has(g, v, kRngReplayable)) return false;
    return *why = IsRecomputeTag(tag) ? ArcWhy::kBanNotReplayable : ArcWhy::kBanRandom, true;
  }
  if (IsRecomputeTag(tag) || alias_of >= 0) return false;  // checkpoint region / ZeRO-3 alias
  if (tag == RecomputeTag::kPreferSave) return *why = ArcWhy::kBanMustSave, true;
  if (c == OpClass::kComputeIntensive) return *why = ArcWhy::kBanComputeIntensive, true;
  if (c == OpClass::kGather) {
    bool of_parameter = false;
    adj.ForEachProducer(v, [&](int64_t u) { of_parameter |= Has(g, u, kParameter); });
    return *why = of_parameter ? ArcWhy::kBanParameterGather : ArcWhy::kBanCollective, true;
  }
  if (policy == RematPolicy::kConservative && !IsFusible(c))
    return *why = ArcWhy::kBanNotFusible, true;
  // Saving it is cheap, and recomputing it runs its whole input again in the backward, often
  // where nothing else needs that input any more (torch's partitioner bans the same: "reduction
  // op"). A byte-only cut cannot see this: without the ban it recomputes norms and losses to
  // save a few bytes and pays in backward time and in the backward's peak.
  if (policy == RematPolicy::kConservative && IsShrinkingReduction(g, adj, v))
    return *why = ArcWhy::kBanShrinkingReduction, true;
  return false;
}

// The smallest power of two above the sum of the finite costs: a penalty that outweighs every
// cut made of finite costs alone, and keeps integer costs exact in float64.
double RequestPenalty(const std::vector<double>& costs) {
  double total = 0.0;
  for (double c : costs)
    if (!std::isinf(c)) total += c;
  double p = 1.0;
  while (p <= total) p *= 2.0;
  return p;
}

}  // namespace

RematNetwork BuildRematNetwork(const JointGraphView& g, const Adjacency& adj,
                               const std::vector<RecomputeTag>& tags,
                               const std::vector<int64_t>& alias_of, RematPolicy policy,
                               const NetworkCosts& costs, std::vector<uint8_t>& info) {
  const int64_t n = g.num_nodes;
  RematNetwork net;
  net.num_graph_nodes = n;
  net.num_nodes = 2 * n + 2;
  net.source = 2 * n;
  net.sink = 2 * n + 1;
  net.node_cost.assign(n, 0.0);
  net.priced_arc.assign(n, -1);
  // materialized[v]: v's buffer is written to memory in the forward anyway, because
  //   - some consumer is not fusible; views and getitems alias their input, so look through
  //     them; or
  //   - it is read on both sides of a non-fusible op that depends on it: a fusible reader
  //     after that op cannot share a kernel with the readers before it, so the value is
  //     written, or its inputs are held and it is redone in each kernel (torch's partitioner
  //     bans recomputing such a late reader: "used far apart"). The residual stream is the
  //     case: read by a block's norm, then by the residual add after the block's matmuls.
  // first_unfusible[v]: the lowest id of a non-fusible forward node reached from v through
  // fusible forward nodes (ids are topological: users come later, so one reverse pass).
  std::vector<uint8_t> materialized(n, 0);
  std::vector<int64_t> first_unfusible(n, std::numeric_limits<int64_t>::max());
  for (int64_t v = n - 1; v >= 0; --v) {
    const OpClass c = ClassOf(g, v);
    bool m = c == OpClass::kPlaceholder || !IsFusible(c);
    const bool forward = !(info[v] & kTangentClosure);
    adj.ForEachUser(v, [&](int64_t u) {
      const OpClass cu = ClassOf(g, u);
      const bool alias = cu == OpClass::kView || cu == OpClass::kGetItem;
      m |= !IsFusible(cu) || (alias && materialized[u]);
      if (forward && !(info[u] & kTangentClosure))
        first_unfusible[v] = std::min(first_unfusible[v], IsFusible(cu) ? first_unfusible[u] : u);
    });
    if (forward) {
      adj.ForEachUser(v, [&](int64_t u) {
        m |= !(info[u] & kTangentClosure) && IsFusible(ClassOf(g, u)) && u > first_unfusible[v];
      });
    }
    materialized[v] = m;
  }
  // Node arcs first, so arc index v is node v's arc.
  std::vector<ArcWhy> node_why(n, ArcWhy::kSaveCost);
  for (int64_t v = 0; v < n; ++v) {
    const OpClass c = ClassOf(g, v);
    double cost;
    ArcWhy& why = node_why[v];
    if (alias_of[v] >= 0) {
      cost = kInf, why = ArcWhy::kCannotSaveParameterAlias;
      info[v] |= kParameterAlias | kMustRecompute;
    } else if (tags[v] == RecomputeTag::kMustRecompute) {
      cost = kInf, why = ArcWhy::kCannotSaveTagged;
      info[v] |= kMustRecompute;
    } else if (c == OpClass::kView) {
      cost = kInf, why = ArcWhy::kCannotSaveView;
    } else if (Has(g, v, kSymFloat)) {
      cost = kInf, why = ArcWhy::kCannotSaveSymFloat;
    } else if (Has(g, v, kNonTensor)) {
      cost = kInf, why = ArcWhy::kCannotSaveNonTensor;
    } else if (Has(g, v, kStaticInput) && !Has(g, v, kCopiedWhenSaved)) {
      cost = 0.0;
    } else if (Has(g, v, kSymInt)) {
      cost = g.bytes[v];
    } else {
      cost = (materialized[v] || costs.bytes_only ? 1.0 : 2.0) * g.bytes[v];
    }
    net.node_cost[v] = cost;
  }
  net.request_penalty = costs.bytes_only ? 0.0 : RequestPenalty(net.node_cost);
  for (int64_t v = 0; v < n; ++v) {
    if (tags[v] == RecomputeTag::kPreferRecompute && alias_of[v] < 0) {
      info[v] |= kRecomputeRequested;
      net.node_cost[v] += net.request_penalty;  // +inf stays +inf
    }
    net.Add(SplitIn(v), SplitOut(v), net.node_cost[v], node_why[v]);
  }
  for (int64_t v = 0; v < n; ++v) {
    if (info[v] & kTangentClosure) {
      net.Add(SplitIn(v), net.sink, kInf, ArcWhy::kSinkTangentClosure);
      continue;  // computed in backward: its own users are in the closure too
    }
    if (info[v] & kRequiredBackward) net.Add(SplitOut(v), net.sink, kInf, ArcWhy::kSinkBackwardOutput);
    ArcWhy why;
    // Forward nodes may be banned from recomputation, and so may a node pinned to the forward
    // that only the backward reads (how the ZeRO-3 runtime hands the backward a secondary
    // shard, cut from a gathered weight, that no forward output needs), and any forward input:
    // an input only the backward reads (a dynamic size that only sizes a gradient's zeros) is
    // still the forward's, so the backward gets it saved, never "recomputed". A cost-only ban
    // is a price in the memory-budget sweep: there the cut may recompute it after all.
    const bool forward = (info[v] & kRequiredForward) || Has(g, v, kPinnedToForward) ||
                         Has(g, v, kPrimal) || Has(g, v, kForwardSeed);
    if (forward && BanReason(g, adj, v, tags[v], policy, alias_of[v], &why)) {
      if (costs.price_cost_bans && IsCostOnlyBan(why)) {
        net.priced_arc[v] = static_cast<int64_t>(net.tails.size());
        net.Add(net.source, SplitIn(v), 0.0, ArcWhy::kRecomputePrice);
      } else {
        info[v] |= kBanned;
        net.Add(net.source, SplitIn(v), kInf, why);
      }
    }
    adj.ForEachUser(v, [&](int64_t u) { net.Add(SplitOut(v), SplitIn(u), kInf, ArcWhy::kData); });
  }
  return net;
}

// --- Prepare -----------------------------------------------------------------------------------
Prepared Prepare(const JointGraphView& g, const PartitionOptions& options,
                 const NetworkCosts& costs) {
  g.Validate();
  Prepared p{Adjacency(g), {}, {}};
  p.info = ClassifyRegions(g, p.adj);
  const std::vector<int64_t> alias_of = options.mark_parameter_aliases
                                            ? MarkParameterAliases(g, p.adj)
                                            : std::vector<int64_t>(g.num_nodes, -1);
  const std::vector<RecomputeTag> tags = ApplyCheckpointTags(g, p.adj, alias_of);
  p.net = BuildRematNetwork(g, p.adj, tags, alias_of, options.policy, costs, p.info);
  return p;
}

// --- Solve -------------------------------------------------------------------------------------
[[noreturn]] void ThrowConflict(const RematNetwork& net, const std::vector<int64_t>& path) {
  // Map each step of the +inf path back to graph nodes and the constraint behind its arc.
  std::vector<int64_t> nodes;
  std::vector<std::string> reasons;
  auto note = [&](int64_t graph_node, ArcWhy why) {
    if (why == ArcWhy::kData) return;  // the chain itself shows data dependencies
    if (nodes.empty() || nodes.back() != graph_node) {
      nodes.push_back(graph_node);
      reasons.emplace_back(Describe(why));
    } else {
      if (!reasons.back().empty()) reasons.back() += "; ";
      reasons.back() += Describe(why);
    }
  };
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    const int64_t a = path[i], b = path[i + 1];
    ArcWhy why = ArcWhy::kData;
    for (size_t k = 0; k < net.tails.size(); ++k) {
      if (net.tails[k] == a && net.heads[k] == b && std::isinf(net.capacities[k])) {
        why = net.why[k];
        break;
      }
    }
    const int64_t graph_node = (a == net.source) ? b / 2 : a / 2;
    if (why == ArcWhy::kData) {
      if (nodes.empty() || nodes.back() != a / 2) nodes.push_back(a / 2), reasons.emplace_back("");
      nodes.push_back(b / 2);
      reasons.emplace_back("");
      continue;
    }
    note(graph_node, why);
  }
  // No iostreams in the core: see max_flow.cc.
  std::string msg = "conflicting rematerialization constraints along node chain";
  for (size_t i = 0; i < nodes.size(); ++i) {
    msg += (i ? " -> " : " ") + std::to_string(nodes[i]);
    if (!reasons[i].empty()) msg += " [" + reasons[i] + "]";
  }
  throw PartitionConflictError(msg, std::move(nodes), std::move(reasons));
}

// Cut nodes the backward actually reads: v_out reaches the sink through sink-side nodes. A
// zero-cost cut arc (a static input nothing downstream needs) is part of some minimum cut but
// saving it would only add a useless backward input.
std::vector<int64_t> UsedCutNodes(const RematNetwork& net, const MinCutResult& cut) {
  const int64_t n = net.num_graph_nodes;
  std::vector<int64_t> first(net.num_nodes + 1, 0), tails(net.tails.size());
  for (int64_t h : net.heads) ++first[h + 1];
  for (int64_t v = 0; v < net.num_nodes; ++v) first[v + 1] += first[v];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (size_t k = 0; k < net.tails.size(); ++k) tails[next[net.heads[k]]++] = net.tails[k];
  std::vector<uint8_t> reaches_sink(net.num_nodes, 0);
  std::vector<int64_t> stack = {net.sink};
  reaches_sink[net.sink] = 1;
  while (!stack.empty()) {
    const int64_t b = stack.back();
    stack.pop_back();
    for (int64_t k = first[b]; k < first[b + 1]; ++k) {
      const int64_t a = tails[k];
      if (reaches_sink[a] || cut.source_side[a]) continue;
      reaches_sink[a] = 1;
      stack.push_back(a);
    }
  }
  std::vector<int64_t> used;
  for (int64_t v : CutNodes(cut, n))
    if (reaches_sink[SplitOut(v)]) used.push_back(v);
  return used;
}

}  // namespace remat_internal

PartitionResult PartitionJointGraph(const JointGraphView& g, const PartitionOptions& options) {
  using namespace remat_internal;
  Prepared prepared = Prepare(g, options, NetworkCosts{});
  const RematNetwork& net = prepared.net;
  PartitionResult result;
  result.node_info = std::move(prepared.info);
  if (g.num_nodes == 0) return result;
  MinCutResult cut;
  try {
    // The sink-minimal end of the minimum cuts (remat_partition.h, Solve).
    cut = MinStCut(net.num_nodes, net.tails, net.heads, net.capacities, net.source, net.sink,
                   MaxFlowAlgorithm::kDinic, CutSide::kSinkMinimal);
  } catch (const UnboundedCutError& e) {
    ThrowConflict(net, e.path());
  }
  result.saved_nodes = UsedCutNodes(net, cut);
  result.cut_cost = cut.value;
  result.request_penalty = net.request_penalty;
  return result;
}

}  // namespace dcr
