#include "graph/joint_graph.h"

#include <cmath>
#include <stdexcept>

namespace dcr {

bool IsFusible(OpClass c) {
  switch (c) {
    case OpClass::kView:
    case OpClass::kCast:
    case OpClass::kPointwise:
    case OpClass::kReduction:
    case OpClass::kRandom:  // a random op fuses with its consumers; it is just never redone
    case OpClass::kGetItem:
      return true;
    default:
      return false;
  }
}

const char* OpClassName(OpClass c) {
  switch (c) {
    case OpClass::kPlaceholder: return "placeholder";
    case OpClass::kView: return "view";
    case OpClass::kCast: return "cast";
    case OpClass::kPointwise: return "pointwise";
    case OpClass::kReduction: return "reduction";
    case OpClass::kComputeIntensive: return "compute-intensive";
    case OpClass::kRandom: return "random";
    case OpClass::kGather: return "gather";
    case OpClass::kGetItem: return "getitem";
    case OpClass::kOther: return "other";
    default: return "invalid";
  }
}

namespace {
[[noreturn]] void Fail(const std::string& what) { throw std::invalid_argument(what); }

std::string At(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }
}  // namespace

void JointGraphView::Validate() const {
  const size_t n = static_cast<size_t>(num_nodes);
  if (num_nodes < 0) Fail("num_nodes must be >= 0");
  auto check_len = [n](const char* name, size_t len) {
    if (len != n) {
      Fail(std::string(name) + " has " + std::to_string(len) + " entries, expected num_nodes = " +
           std::to_string(n));
    }
  };
  check_len("bytes", bytes.size);
  check_len("op_class", op_class.size);
  check_len("flags", flags.size);
  check_len("recompute", recompute.size);
  check_len("ac_graph_id", ac_graph_id.size);
  for (size_t v = 0; v < n; ++v) {
    if (std::isnan(bytes[v]) || bytes[v] < 0) Fail(At("bytes", v) + " must be >= 0");
    if (op_class[v] >= static_cast<uint8_t>(OpClass::kNumClasses))
      Fail(At("op_class", v) + " = " + std::to_string(op_class[v]) + " is not an OpClass");
    if (recompute[v] < 0 || recompute[v] > static_cast<int8_t>(RecomputeTag::kPreferRecompute))
      Fail(At("recompute", v) + " = " + std::to_string(recompute[v]) + " is not a tag");
  }
  if (edge_tails.size != edge_heads.size) {
    Fail("edge_tails and edge_heads must have one length; got " + std::to_string(edge_tails.size) +
         " and " + std::to_string(edge_heads.size));
  }
  for (size_t i = 0; i < edge_tails.size; ++i) {
    const int64_t u = edge_tails[i], v = edge_heads[i];
    if (u < 0 || u >= num_nodes) Fail(At("edge_tails", i) + " = " + std::to_string(u) + " is out of range");
    if (v < 0 || v >= num_nodes) Fail(At("edge_heads", i) + " = " + std::to_string(v) + " is out of range");
    if (u >= v) {
      Fail("edge " + std::to_string(i) + " (" + std::to_string(u) + " -> " + std::to_string(v) +
           ") goes backwards: nodes must be in topological (FX) order");
    }
  }
  for (size_t i = 0; i < fwd_outputs.size; ++i)
    if (fwd_outputs[i] < 0 || fwd_outputs[i] >= num_nodes) Fail(At("fwd_outputs", i) + " is out of range");
  for (size_t i = 0; i < bwd_outputs.size; ++i)
    if (bwd_outputs[i] < 0 || bwd_outputs[i] >= num_nodes) Fail(At("bwd_outputs", i) + " is out of range");
}

Adjacency::Adjacency(const JointGraphView& g)
    : user_first(g.num_nodes + 1, 0), producer_first(g.num_nodes + 1, 0) {
  const size_t m = g.edge_tails.size;
  for (size_t i = 0; i < m; ++i) {
    ++user_first[g.edge_tails[i] + 1];
    ++producer_first[g.edge_heads[i] + 1];
  }
  for (int64_t v = 0; v < g.num_nodes; ++v) {
    user_first[v + 1] += user_first[v];
    producer_first[v + 1] += producer_first[v];
  }
  users.resize(m);
  producers.resize(m);
  std::vector<int64_t> nu(user_first.begin(), user_first.end() - 1);
  std::vector<int64_t> np(producer_first.begin(), producer_first.end() - 1);
  for (size_t i = 0; i < m; ++i) {
    users[nu[g.edge_tails[i]]++] = g.edge_heads[i];
    producers[np[g.edge_heads[i]]++] = g.edge_tails[i];
  }
}

}  // namespace dcr
