// The rematerialization partition on hand-built joint graphs (the seeds' examples, ZeRO-3
// parameter marking, checkpoint tags, conflicts).
#include "partition/remat_partition.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "joint_graph_builder.h"

namespace dcr {
namespace {

// Builds a JointGraphView node by node; ids follow insertion order (topological).
struct GraphBuilder : test_support::JointGraphArrays {
  int64_t Add(OpClass c, std::vector<int64_t> inputs, double size = 4096, uint32_t f = 0,
              RecomputeTag tag = RecomputeTag::kNone, int64_t ac_id = -1) {
    return AddNode(c, inputs, size, f, tag, ac_id);
  }
  int64_t Primal(double size = 4096) { return Add(OpClass::kPlaceholder, {}, size, kPrimal); }
  int64_t Parameter(double size = 4096) {
    return Add(OpClass::kPlaceholder, {}, size, kPrimal | kStaticInput | kParameter);
  }
  int64_t Tangent(double size = 4096) { return Add(OpClass::kPlaceholder, {}, size, kBackwardInput); }

  PartitionResult Solve(RematPolicy policy = RematPolicy::kConservative, bool mark = true) const {
    PartitionOptions o;
    o.policy = policy;
    o.mark_parameter_aliases = mark;
    return PartitionJointGraph(View(), o);
  }
};

using Ids = std::vector<int64_t>;

// cos(cos(a + b + c + d)): the backward needs sin(cos1) and sin(sum); saving the sum alone
// (then recomputing cos1 = cos(sum) in backward) is the cheapest cut (seed post 000).
TEST(RematPartition, SeedCosCosSavesOnlyTheSum) {
  GraphBuilder g;
  const int64_t a = g.Primal(), b = g.Primal(), c = g.Primal(), d = g.Primal();
  const int64_t t = g.Tangent();
  const int64_t ab = g.Add(OpClass::kPointwise, {a, b});
  const int64_t abc = g.Add(OpClass::kPointwise, {ab, c});
  const int64_t sum = g.Add(OpClass::kPointwise, {abc, d});
  const int64_t cos1 = g.Add(OpClass::kPointwise, {sum});
  const int64_t cos2 = g.Add(OpClass::kPointwise, {cos1});
  const int64_t sin1 = g.Add(OpClass::kPointwise, {cos1});
  const int64_t g1 = g.Add(OpClass::kPointwise, {t, sin1});
  const int64_t sin0 = g.Add(OpClass::kPointwise, {sum});
  const int64_t g0 = g.Add(OpClass::kPointwise, {g1, sin0});
  g.fwd_outputs = {cos2};
  g.bwd_outputs = {g0};
  for (RematPolicy p : {RematPolicy::kConservative, RematPolicy::kAggressive}) {
    const PartitionResult r = g.Solve(p);
    EXPECT_EQ(r.saved_nodes, Ids({sum}));
    EXPECT_DOUBLE_EQ(r.cut_cost, 2 * 4096.0);  // fusible intermediate: written and read once
  }
}

// x * x * (rand_like(x) < 0.5): the random op is never recomputed, so its consequence (the
// small bool mask) is saved, with x.
TEST(RematPartition, RandomOpIsNeverRecomputed) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t t = g.Tangent();
  const int64_t rnd = g.Add(OpClass::kRandom, {x});
  const int64_t mask = g.Add(OpClass::kPointwise, {rnd}, 1024);
  const int64_t xx = g.Add(OpClass::kPointwise, {x, x});
  const int64_t out = g.Add(OpClass::kPointwise, {xx, mask});
  const int64_t gm = g.Add(OpClass::kPointwise, {t, mask});
  const int64_t gx = g.Add(OpClass::kPointwise, {gm, x});
  g.fwd_outputs = {out};
  g.bwd_outputs = {gx};
  for (RematPolicy p : {RematPolicy::kConservative, RematPolicy::kAggressive}) {
    const PartitionResult r = g.Solve(p);
    EXPECT_EQ(r.saved_nodes, Ids({x, mask}));
    EXPECT_TRUE(r.node_info[rnd] & kBanned);
  }
}

// x.cos().cos().cos(): every intermediate is recomputable from x, which is cheapest to save.
TEST(RematPartition, ChainOfPointwiseSavesOnlyTheInput) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t t = g.Tangent();
  const int64_t c1 = g.Add(OpClass::kPointwise, {x});
  const int64_t c2 = g.Add(OpClass::kPointwise, {c1});
  const int64_t c3 = g.Add(OpClass::kPointwise, {c2});
  const int64_t s2 = g.Add(OpClass::kPointwise, {c2});
  const int64_t g2 = g.Add(OpClass::kPointwise, {t, s2});
  const int64_t s1 = g.Add(OpClass::kPointwise, {c1});
  const int64_t g1 = g.Add(OpClass::kPointwise, {g2, s1});
  const int64_t s0 = g.Add(OpClass::kPointwise, {x});
  const int64_t g0 = g.Add(OpClass::kPointwise, {g1, s0});
  g.fwd_outputs = {c3};
  g.bwd_outputs = {g0};
  EXPECT_EQ(g.Solve().saved_nodes, Ids({x}));
}

// RMSNorm, y = h * rsqrt(mean(h * h)) with h = x + 1: the backward needs h and the small
// statistic. A byte-only cut saves x and recomputes the whole norm, statistic included, in the
// backward; the conservative policy bans recomputing the shrinking reduction (it reads 256x
// what it writes), so the statistic is saved beside x. The aggressive policy keeps the old cut.
TEST(RematPartition, ConservativePolicySavesAShrinkingReductionsResult) {
  GraphBuilder g;
  const int64_t x = g.Primal(65536);
  const int64_t t = g.Tangent(65536);
  const int64_t h = g.Add(OpClass::kPointwise, {x}, 65536);
  const int64_t sq = g.Add(OpClass::kPointwise, {h}, 65536);
  const int64_t stat = g.Add(OpClass::kReduction, {sq}, 256);
  const int64_t rs = g.Add(OpClass::kPointwise, {stat}, 256);
  const int64_t y = g.Add(OpClass::kPointwise, {h, rs}, 65536);
  const int64_t gy = g.Add(OpClass::kPointwise, {t, rs}, 65536);
  const int64_t gh = g.Add(OpClass::kPointwise, {gy, h}, 65536);
  g.fwd_outputs = {y};
  g.bwd_outputs = {gh};

  const PartitionResult conservative = g.Solve(RematPolicy::kConservative);
  EXPECT_TRUE(conservative.node_info[stat] & kBanned);
  ASSERT_EQ(conservative.saved_nodes.size(), 2u);
  EXPECT_EQ(conservative.saved_nodes[0], x);
  EXPECT_TRUE(conservative.saved_nodes[1] == stat || conservative.saved_nodes[1] == rs);

  const PartitionResult aggressive = g.Solve(RematPolicy::kAggressive);
  EXPECT_FALSE(aggressive.node_info[stat] & kBanned);
  EXPECT_EQ(aggressive.saved_nodes, Ids({x}));

  // A reduction that does not shrink its input 4x (a sum over a short axis) stays free to
  // recompute.
  GraphBuilder wide;
  const int64_t wx = wide.Primal(65536);
  const int64_t wt = wide.Tangent(65536);
  const int64_t wh = wide.Add(OpClass::kPointwise, {wx}, 65536);
  const int64_t wsum = wide.Add(OpClass::kReduction, {wh}, 32768);
  const int64_t wy = wide.Add(OpClass::kPointwise, {wsum}, 32768);
  const int64_t wg = wide.Add(OpClass::kPointwise, {wt, wsum}, 65536);
  wide.fwd_outputs = {wy};
  wide.bwd_outputs = {wg};
  const PartitionResult r = wide.Solve(RematPolicy::kConservative);
  EXPECT_FALSE(r.node_info[wsum] & kBanned);
}

// ZeRO-3: y = x @ cast(gather(w)). Without marking, the gathered bf16 copy is the cheapest
// save; with marking, the backward re-gathers from the parameter (its shard) itself.
struct GatheredLinear {
  GraphBuilder g;
  int64_t w, x, gathered, cast, view_t;
  GatheredLinear() {
    w = g.Parameter(1 << 20);
    x = g.Primal(4096);
    const int64_t t = g.Tangent(4096);
    gathered = g.Add(OpClass::kGather, {w}, 4 << 20);
    cast = g.Add(OpClass::kCast, {gathered}, 2 << 20);
    const int64_t y = g.Add(OpClass::kComputeIntensive, {x, cast}, 4096);
    view_t = g.Add(OpClass::kView, {cast}, 2 << 20);
    const int64_t gx = g.Add(OpClass::kComputeIntensive, {t, view_t}, 4096);
    const int64_t xt = g.Add(OpClass::kView, {x}, 4096);
    const int64_t gw = g.Add(OpClass::kComputeIntensive, {xt, t}, 2 << 20);
    g.fwd_outputs = {y};
    g.bwd_outputs = {gx, gw};
  }
};

TEST(RematPartition, ParameterAliasesAreRecomputedNotSaved) {
  GatheredLinear m;
  for (RematPolicy p : {RematPolicy::kConservative, RematPolicy::kAggressive}) {
    const PartitionResult r = m.g.Solve(p, /*mark=*/true);
    EXPECT_EQ(r.saved_nodes, Ids({m.w, m.x}));
    for (int64_t v : {m.gathered, m.cast, m.view_t}) {
      EXPECT_TRUE(r.node_info[v] & kParameterAlias) << v;
      EXPECT_TRUE(r.node_info[v] & kMustRecompute) << v;
    }
  }
  const PartitionResult unmarked = m.g.Solve(RematPolicy::kConservative, /*mark=*/false);
  EXPECT_EQ(unmarked.saved_nodes, Ids({m.x, m.cast}));
}

// A conv weight under bf16 autocast, compiled by inductor: the weight is re-laid out
// channels-last when the forward hands it over, so saving it writes a full-precision copy.
// Flagged kCopiedWhenSaved it costs its bytes, its cast is no alias, and the cut saves the
// bf16 cast (half the bytes), as torch's partitioner does; unflagged, it is free and the cast
// is recomputed from it.
TEST(RematPartition, AParameterCopiedWhenSavedCostsItsBytesAndRootsNoAliases) {
  for (bool copied : {false, true}) {
    GraphBuilder g;
    const int64_t w = g.Add(OpClass::kPlaceholder, {}, 4 << 20,
                            kPrimal | kStaticInput | kParameter | (copied ? kCopiedWhenSaved : 0));
    const int64_t x = g.Primal(4096);
    const int64_t t = g.Tangent(4096);
    const int64_t cast = g.Add(OpClass::kCast, {w}, 2 << 20);
    const int64_t y = g.Add(OpClass::kComputeIntensive, {x, cast}, 4096);
    const int64_t gx = g.Add(OpClass::kComputeIntensive, {t, cast}, 4096);
    const int64_t gw = g.Add(OpClass::kComputeIntensive, {x, t}, 2 << 20);
    g.fwd_outputs = {y};
    g.bwd_outputs = {gx, gw};
    const PartitionResult r = g.Solve();
    EXPECT_EQ(r.saved_nodes, copied ? Ids({x, cast}) : Ids({w, x})) << copied;
    EXPECT_EQ(static_cast<bool>(r.node_info[cast] & kParameterAlias), !copied);
    EXPECT_DOUBLE_EQ(r.cut_cost, copied ? 4096.0 + (2 << 20) : 4096.0);
  }
}

// A checkpoint-tagged (PREFER_RECOMPUTE) region feeding a later region: the boundary value is
// saved, the interior recomputed, even for compute-intensive ops.
TEST(RematPartition, CheckpointTagsAndRegionBoundaries) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t t = g.Tangent();
  const auto rec = RecomputeTag::kPreferRecompute;
  const int64_t mm1 = g.Add(OpClass::kComputeIntensive, {x}, 4096, 0, rec, 0);
  const int64_t act1 = g.Add(OpClass::kPointwise, {mm1}, 4096, 0, rec, 0);
  const int64_t mm2 = g.Add(OpClass::kComputeIntensive, {act1}, 4096, 0, rec, 1);
  const int64_t act2 = g.Add(OpClass::kPointwise, {mm2}, 4096, 0, rec, 1);
  const int64_t b2 = g.Add(OpClass::kPointwise, {t, mm2});
  const int64_t b1 = g.Add(OpClass::kComputeIntensive, {b2, act1});
  const int64_t b0 = g.Add(OpClass::kPointwise, {b1, mm1});
  g.fwd_outputs = {act2};
  g.bwd_outputs = {b0};
  const PartitionResult r = g.Solve();
  EXPECT_EQ(r.saved_nodes, Ids({x, act1}));  // act1 ends region 0 and feeds region 1
  EXPECT_TRUE(r.node_info[mm1] & kRecomputeRequested);
  EXPECT_TRUE(r.node_info[mm2] & kRecomputeRequested);
  EXPECT_FALSE(r.node_info[mm1] & kMustRecompute);  // a request, not a must
  EXPECT_LT(r.cut_cost, r.request_penalty);         // every request honoured
}

// Attention as torch.utils.checkpoint / HF gradient checkpointing traces it: SDPA is a seeded
// random op (Tag.nondeterministic_seeded, even at dropout_p=0) returning a tuple, and every op
// of the region is tagged PREFER_RECOMPUTE. The backward needs two of its outputs.
struct CheckpointedAttention {
  GraphBuilder g;
  int64_t q, t, sdpa, out, lse;
  explicit CheckpointedAttention(uint32_t sdpa_flags, RecomputeTag tag) {
    q = g.Primal();
    t = g.Tangent();
    const int64_t qv = g.Add(OpClass::kView, {q}, 4096, 0, tag, 0);
    sdpa = g.Add(OpClass::kRandom, {qv}, 4096, kNonTensor | sdpa_flags, tag, 0);
    out = g.Add(OpClass::kGetItem, {sdpa}, 4096, 0, tag, 0);
    lse = g.Add(OpClass::kGetItem, {sdpa}, 256, 0, tag, 0);
    const int64_t y = g.Add(OpClass::kPointwise, {out}, 4096, 0, tag, 0);
    const int64_t bw = g.Add(OpClass::kComputeIntensive, {t, qv, out, lse}, 4096);
    g.fwd_outputs = {y};
    g.bwd_outputs = {bw};
  }
};

// Replayable: recomputed in the backward (its RNG state is replayed), as torch does.
TEST(RematPartition, ReplayableRandomOpInARegionIsRecomputed) {
  for (RecomputeTag tag : {RecomputeTag::kPreferRecompute, RecomputeTag::kMustRecompute}) {
    CheckpointedAttention a(kRngReplayable, tag);
    const PartitionResult r = a.g.Solve();
    EXPECT_EQ(r.saved_nodes, Ids({a.q}));
    EXPECT_FALSE(r.node_info[a.sdpa] & kBanned);
  }
}

// Not replayable (an effectful op, or a random op without a seed): a PREFER_RECOMPUTE request
// yields and the outputs are saved, never drawn twice; a MUST_RECOMPUTE is a conflict whose
// message says why.
TEST(RematPartition, UnreplayableRandomOpYieldsARequestAndRefusesAMust) {
  CheckpointedAttention a(0, RecomputeTag::kPreferRecompute);
  const PartitionResult r = a.g.Solve();
  EXPECT_EQ(r.saved_nodes, Ids({a.q, a.out, a.lse}));
  EXPECT_TRUE(r.node_info[a.sdpa] & kBanned);
  EXPECT_TRUE(r.node_info[a.out] & kRecomputeRequested);
  EXPECT_GE(r.cut_cost, r.request_penalty);  // requests were broken, and the cost says so

  CheckpointedAttention must(0, RecomputeTag::kMustRecompute);
  try {
    must.g.Solve();
    FAIL() << "expected PartitionConflictError";
  } catch (const PartitionConflictError& e) {
    EXPECT_NE(std::string(e.what()).find("effectful or unseeded"), std::string::npos) << e.what();
  }
}

// Saving x (and recomputing a from it) or saving a costs the same bytes: the partitioner takes
// the cut nearest the backward, which recomputes nothing (remat_partition.h, Solve).
TEST(RematPartition, TiedCutsTakeTheOneThatRecomputesLeast) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t t = g.Tangent();
  const int64_t a = g.Add(OpClass::kPointwise, {x});          // materialized: a matmul reads it
  const int64_t y = g.Add(OpClass::kComputeIntensive, {a});
  const int64_t bw = g.Add(OpClass::kPointwise, {t, a});
  g.fwd_outputs = {y};
  g.bwd_outputs = {bw};
  for (RematPolicy p : {RematPolicy::kConservative, RematPolicy::kAggressive}) {
    const PartitionResult r = g.Solve(p);
    EXPECT_EQ(r.saved_nodes, Ids({a}));
    EXPECT_DOUBLE_EQ(r.cut_cost, 4096.0);
  }
}

// A residual stream: r is read by a norm-like op feeding a matmul, and again by the residual
// add after that matmul. No kernel holds both readers, so r counts as written (1x bytes), ties
// with its input x, and the tie goes to r. Without the read after the matmul, r is a fusible
// intermediate (2x) and saving x is cheaper.
TEST(RematPartition, ValueReadAcrossAMatmulCostsItsBytesOnce) {
  for (bool read_after_matmul : {true, false}) {
    GraphBuilder g;
    const int64_t x = g.Primal();
    const int64_t t = g.Tangent();
    const int64_t r = g.Add(OpClass::kPointwise, {x});
    const int64_t norm = g.Add(OpClass::kPointwise, {r});
    const int64_t y = g.Add(OpClass::kComputeIntensive, {norm});
    const int64_t out = read_after_matmul ? g.Add(OpClass::kPointwise, {r, y})
                                          : g.Add(OpClass::kPointwise, {y});
    const int64_t bw = g.Add(OpClass::kPointwise, {t, r});
    g.fwd_outputs = {out};
    g.bwd_outputs = {bw};
    const PartitionResult r_cut = g.Solve();
    EXPECT_EQ(r_cut.saved_nodes, Ids({read_after_matmul ? r : x})) << read_after_matmul;
    EXPECT_DOUBLE_EQ(r_cut.cut_cost, 4096.0);
  }
}

// A request breaks as few requests as it can: here one saved value suffices.
TEST(RematPartition, BrokenRequestsAreTheFewestPossible) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t t = g.Tangent();
  const auto rec = RecomputeTag::kPreferRecompute;
  const int64_t fx = g.Add(OpClass::kRandom, {x}, 4096, kNonTensor, rec, 0);  // effectful
  const int64_t item = g.Add(OpClass::kGetItem, {fx}, 4096, 0, rec, 0);
  const int64_t a = g.Add(OpClass::kPointwise, {item}, 4096, 0, rec, 0);
  const int64_t b = g.Add(OpClass::kPointwise, {a}, 4096, 0, rec, 0);
  const int64_t c = g.Add(OpClass::kPointwise, {a}, 4096, 0, rec, 0);
  const int64_t bw = g.Add(OpClass::kPointwise, {t, b, c});
  g.fwd_outputs = {b, c};
  g.bwd_outputs = {bw};
  const PartitionResult r = g.Solve();
  // Saving item or a breaks one request at the same cost; of the two minimum cuts the
  // partitioner takes the one nearest the backward (remat_partition.h, Solve).
  EXPECT_EQ(r.saved_nodes, Ids({a}));
  EXPECT_LT(r.cut_cost, 2 * r.request_penalty);
}

// ZeRO-3 marking against save tags: a gathered weight read by two checkpoint regions is not a
// region boundary (it is re-gathered), and PREFER_SAVE on it yields to the marking.
TEST(RematPartition, ParameterAliasesOverrideBoundariesAndPreferSave) {
  for (RecomputeTag gather_tag : {RecomputeTag::kPreferRecompute, RecomputeTag::kPreferSave}) {
    GraphBuilder g;
    const int64_t w = g.Parameter();
    const int64_t x = g.Primal();
    const int64_t t = g.Tangent();
    const auto rec = RecomputeTag::kPreferRecompute;
    const int64_t gathered = g.Add(OpClass::kGather, {w}, 8192, 0, gather_tag, 0);
    const int64_t y1 = g.Add(OpClass::kComputeIntensive, {x, gathered}, 4096, 0, rec, 0);
    const int64_t y2 = g.Add(OpClass::kComputeIntensive, {y1, gathered}, 4096, 0, rec, 1);
    const int64_t b2 = g.Add(OpClass::kComputeIntensive, {t, gathered});
    const int64_t b1 = g.Add(OpClass::kComputeIntensive, {b2, gathered, y1});
    g.fwd_outputs = {y2};
    g.bwd_outputs = {b1};
    const PartitionResult r = g.Solve();
    EXPECT_EQ(r.saved_nodes, Ids({w, y1})) << static_cast<int>(gather_tag);
    EXPECT_TRUE(r.node_info[gathered] & kParameterAlias);
  }
}

TEST(RematPartition, MustSaveTag) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t t = g.Tangent();
  const int64_t c1 = g.Add(OpClass::kPointwise, {x}, 4096, 0, RecomputeTag::kMustSave, 0);
  const int64_t c2 = g.Add(OpClass::kPointwise, {c1});
  const int64_t b = g.Add(OpClass::kPointwise, {t, c1});
  g.fwd_outputs = {c2};
  g.bwd_outputs = {b};
  EXPECT_EQ(g.Solve().saved_nodes, Ids({c1}));
}

// The ZeRO-3 secondary shard: a slice copied out of a gathered weight, read only by the backward
// (its re-gather within the node), pinned to the forward (and banned from recomputation as a
// compute-intensive op). No forward output needs it, yet it is saved, and the backward does not
// re-gather the weight from the parameter to cut it again. Unpinned, the same node is
// recomputed in the backward (from the parameter: the shard is what is saved).
TEST(RematPartition, PinnedToForwardSavesABackwardOnlyValue) {
  for (const bool pinned : {true, false}) {
    GraphBuilder g;
    const int64_t w = g.Parameter();
    const int64_t x = g.Primal();
    const int64_t t = g.Tangent();
    const int64_t gathered = g.Add(OpClass::kGather, {w}, 8192);
    const int64_t y = g.Add(OpClass::kComputeIntensive, {x, gathered});
    const int64_t secondary =
        g.Add(OpClass::kComputeIntensive, {gathered}, 4096, pinned ? kPinnedToForward : 0u);
    const int64_t regathered =
        g.Add(OpClass::kGather, {secondary}, 8192, 0, RecomputeTag::kMustRecompute, -1);
    const int64_t b = g.Add(OpClass::kComputeIntensive, {t, regathered});
    g.fwd_outputs = {y};
    g.bwd_outputs = {b};
    const PartitionResult r = g.Solve();
    EXPECT_EQ(r.saved_nodes, pinned ? Ids({secondary}) : Ids({w})) << pinned;
  }
}

// Forward inputs only the backward reads: a dynamic size (SymInt) that only sizes a gradient's
// zeros, and a tensor input only the gradient reads. Neither is needed by a forward output, and
// neither can be recomputed in the backward: both are saved (seen on HF Llama layers compiled
// with a dynamic sequence length, where the cut left the size out and the extraction failed).
TEST(RematPartition, ForwardInputsOnlyTheBackwardReadsAreSaved) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  const int64_t size = g.Add(OpClass::kPlaceholder, {}, 8, kPrimal | kSymInt);
  const int64_t mask = g.Primal(1024);
  const int64_t t = g.Tangent();
  const int64_t y = g.Add(OpClass::kComputeIntensive, {x});
  const int64_t zeros = g.Add(OpClass::kPointwise, {size});
  const int64_t scattered = g.Add(OpClass::kPointwise, {zeros, t});
  const int64_t gx = g.Add(OpClass::kComputeIntensive, {scattered, mask});
  g.fwd_outputs = {y};
  g.bwd_outputs = {gx};
  for (RematPolicy p : {RematPolicy::kConservative, RematPolicy::kAggressive}) {
    const PartitionResult r = g.Solve(p);
    EXPECT_EQ(r.saved_nodes, Ids({size, mask}));
    EXPECT_TRUE(r.node_info[size] & kBanned);
    EXPECT_TRUE(r.node_info[mask] & kBanned);
  }
}

// MUST_SAVE on a gathered parameter contradicts ZeRO-3 marking: the error names the node and
// every constraint on it.
TEST(RematPartition, ConflictNamesTheChainAndTheReasons) {
  GraphBuilder g;
  const int64_t w = g.Parameter();
  const int64_t t = g.Tangent();
  const int64_t gathered = g.Add(OpClass::kGather, {w}, 4096, 0, RecomputeTag::kMustSave, 0);
  const int64_t out = g.Add(OpClass::kComputeIntensive, {gathered});
  const int64_t b = g.Add(OpClass::kComputeIntensive, {t, gathered});
  g.fwd_outputs = {out};
  g.bwd_outputs = {b};
  try {
    g.Solve();
    FAIL() << "expected PartitionConflictError";
  } catch (const PartitionConflictError& e) {
    ASSERT_EQ(e.nodes(), Ids({gathered, b}));
    const std::string why = e.reasons()[0];
    EXPECT_NE(why.find("MUST_SAVE"), std::string::npos) << why;
    EXPECT_NE(why.find("ZeRO-3"), std::string::npos) << why;
    EXPECT_NE(e.reasons()[1].find("tangent"), std::string::npos) << e.reasons()[1];
    EXPECT_NE(std::string(e.what()).find("2 ["), std::string::npos) << e.what();
  }
}

TEST(RematPartition, BadGraphIsRejectedWithTheIndex) {
  GraphBuilder g;
  const int64_t x = g.Primal();
  g.Add(OpClass::kPointwise, {x});
  g.tails.push_back(1), g.heads.push_back(0);  // backwards edge
  try {
    g.Solve();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("edge 1"), std::string::npos) << e.what();
  }
  GraphBuilder h;
  h.Primal();
  h.op_class[0] = 42;
  EXPECT_THROW(h.Solve(), std::invalid_argument);
}

TEST(RematPartition, EmptyGraph) {
  GraphBuilder g;
  const PartitionResult r = g.Solve();
  EXPECT_TRUE(r.saved_nodes.empty());
}

TEST(RematPartition, Deterministic) {
  GatheredLinear m;
  const PartitionResult a = m.g.Solve(), b = m.g.Solve();
  EXPECT_EQ(a.saved_nodes, b.saved_nodes);
  EXPECT_EQ(a.node_info, b.node_info);
}

}  // namespace
}  // namespace dcr
