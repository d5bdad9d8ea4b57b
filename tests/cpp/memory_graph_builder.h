// Test helper: a memory graph built node by node (ids follow insertion order, so topological),
// owning the arrays that MemoryGraph points into. The schedule and collective-wait tests share it.
#pragma once

#include <cstdint>
#include <vector>

#include "memsim/memory_sim.h"

namespace dcr::test_support {

struct MemoryGraphArrays {
  std::vector<double> bytes;
  std::vector<int64_t> alias_of, tails, heads;
  std::vector<uint8_t> is_input, persistent, keep;

  // Appends a node of `b` bytes (0 for an alias of `alias`) reading `in`; returns its id.
  int64_t Add(double b, const std::vector<int64_t>& in, bool input = false, int64_t alias = -1) {
    const int64_t v = static_cast<int64_t>(bytes.size());
    bytes.push_back(alias >= 0 ? 0 : b);
    alias_of.push_back(alias);
    is_input.push_back(input), persistent.push_back(0), keep.push_back(0);
    for (int64_t u : in) tails.push_back(u), heads.push_back(v);
    return v;
  }
  // Spans into this object's arrays: valid while it lives and is not added to.
  MemoryGraph View() const {
    MemoryGraph g;
    g.num_nodes = static_cast<int64_t>(bytes.size());
    g.bytes = bytes, g.alias_of = alias_of, g.is_input = is_input;
    g.persistent = persistent, g.keep = keep, g.edge_tails = tails, g.edge_heads = heads;
    return g;
  }
};

}  // namespace dcr::test_support
