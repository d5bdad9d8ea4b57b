#include "memsim/memory_sim.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace dcr {

void MemoryGraph::Validate() const {
  const size_t n = static_cast<size_t>(num_nodes);
  if (num_nodes < 0) throw std::invalid_argument("num_nodes must be >= 0");
  const std::pair<const char*, size_t> per_node[] = {
      {"bytes", bytes.size},           {"alias_of", alias_of.size}, {"is_input", is_input.size},
      {"persistent", persistent.size}, {"keep", keep.size}};
  for (const auto& [name, size] : per_node) {
    if (size != n) {
      throw std::invalid_argument(std::string(name) + " has " + std::to_string(size) +
                                  " entries, expected one per node (" + std::to_string(n) + ")");
    }
  }
  if (workspace.size != 0 && workspace.size != n) {
    throw std::invalid_argument("workspace has " + std::to_string(workspace.size) +
                                " entries, expected one per node (" + std::to_string(n) +
                                ") or none");
  }
  ValidateEdges(num_nodes, edge_tails, edge_heads);
  for (int64_t v = 0; v < num_nodes; ++v) {
    if (alias_of[v] < -1 || alias_of[v] >= v) {
      throw std::invalid_argument("alias_of[" + std::to_string(v) +
                                  "] must be an earlier node or -1");
    }
  }
}

void ValidateEdges(int64_t num_nodes, Span<int64_t> edge_tails, Span<int64_t> edge_heads) {
  if (edge_tails.size != edge_heads.size) {
    throw std::invalid_argument("edge_tails and edge_heads have different lengths");
  }
  for (size_t i = 0; i < edge_tails.size; ++i) {
    if (edge_tails[i] < 0 || edge_tails[i] >= num_nodes || edge_heads[i] < 0 ||
        edge_heads[i] >= num_nodes) {
      throw std::invalid_argument("edge " + std::to_string(i) + " has a node id out of range");
    }
  }
}

MemoryTimeline SimulateMemory(const MemoryGraph& g, Span<int64_t> order) {
  g.Validate();
  return memsim_internal::SimulateMemoryUnchecked(g, order);
}

MemoryTimeline memsim_internal::SimulateMemoryUnchecked(const MemoryGraph& g,
                                                        Span<int64_t> order) {
  const int64_t n = g.num_nodes;
  auto root = [&](int64_t v) {
    while (g.alias_of[v] >= 0) v = g.alias_of[v];
    return v;
  };
  std::vector<int64_t> step_of(n, -1);
  for (size_t k = 0; k < order.size; ++k) {
    const int64_t v = order[k];
    if (v < 0 || v >= n) throw std::invalid_argument("order[" + std::to_string(k) + "] out of range");
    if (g.is_input[v]) throw std::invalid_argument("order[" + std::to_string(k) + "] is a graph input");
    if (step_of[v] >= 0) throw std::invalid_argument("order[" + std::to_string(k) + "] repeats a node");
    step_of[v] = static_cast<int64_t>(k);
  }
  for (int64_t v = 0; v < n; ++v) {
    if (!g.is_input[v] && step_of[v] < 0)
      throw std::invalid_argument("node " + std::to_string(v) + " is missing from the order");
  }
  // Last step at which each storage (alias root) is read; -1: never read.
  std::vector<int64_t> last_use(n, -1);
  for (size_t i = 0; i < g.edge_tails.size; ++i) {
    const int64_t p = g.edge_tails[i], c = g.edge_heads[i];
    if (!g.is_input[p] && step_of[p] > step_of[c]) {
      throw std::invalid_argument("order runs node " + std::to_string(c) + " (step " +
                                  std::to_string(step_of[c]) + ") before its input " +
                                  std::to_string(p) + " (step " + std::to_string(step_of[p]) + ")");
    }
    const int64_t r = root(p);
    last_use[r] = std::max(last_use[r], step_of[c]);
  }
  // Aliases extend their base's life until they are dead themselves.
  for (int64_t v = 0; v < n; ++v) {
    if (g.alias_of[v] >= 0) {
      const int64_t r = root(v);
      if (g.keep[v]) last_use[r] = std::numeric_limits<int64_t>::max();
      if (!g.is_input[v]) last_use[r] = std::max(last_use[r], step_of[v]);
    }
  }
  std::vector<std::vector<int64_t>> frees(order.size);
  double live = 0.0;
  for (int64_t v = 0; v < n; ++v) {
    if (g.alias_of[v] >= 0) continue;
    const bool forever = g.keep[v] || g.persistent[v] ||
                         last_use[v] == std::numeric_limits<int64_t>::max();
    if (g.is_input[v]) live += g.bytes[v];
    if (forever) continue;
    int64_t dies = last_use[v];
    if (dies < 0) dies = g.is_input[v] ? -1 : step_of[v];  // unused: freed right away
    if (dies >= 0) frees[dies].push_back(v);
    else live -= g.bytes[v];  // an unused input is dropped before the first step
  }
  MemoryTimeline t;
  t.peak_bytes = live;
  t.live_after.resize(order.size);
  for (size_t k = 0; k < order.size; ++k) {
    const int64_t v = order[k];
    if (g.alias_of[v] < 0) live += g.bytes[v];
    const double during = live + (g.workspace.size ? g.workspace[v] : 0.0);
    if (during > t.peak_bytes) t.peak_bytes = during, t.peak_step = static_cast<int64_t>(k);
    for (int64_t f : frees[k]) live -= g.bytes[f];
    t.live_after[k] = live;
  }
  return t;
}

}  // namespace dcr
