#include "schedule/collective_waits.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace dcr {
namespace {

using memsim_internal::SimulateMemoryUnchecked;

// Each wait's window in the order without waits: [earliest, latest] and its start's position.
struct Windows {
  std::vector<int64_t> others;    // order without the waits
  std::vector<int64_t> start_at;  // per collective: its start's position in `others`
  std::vector<int64_t> earliest, latest;
};

std::string Id(const char* what, size_t i) { return std::string(what) + "[" + std::to_string(i) + "]"; }

Windows Analyze(const MemoryGraph& g, Span<int64_t> order, Span<int64_t> starts,
                Span<int64_t> waits, int64_t max_in_flight) {
  const int64_t n = g.num_nodes;
  const size_t k = starts.size;
  std::vector<int64_t> collective_of_wait(n, -1), collective_of_start(n, -1);
  auto claim = [&](const char* what, size_t i, int64_t v, std::vector<int64_t>* role) {
    if (v < 0 || v >= n) throw std::invalid_argument(Id(what, i) + " is out of range");
    if (g.is_input[v]) throw std::invalid_argument(Id(what, i) + " is a graph input");
    if (collective_of_wait[v] >= 0 || collective_of_start[v] >= 0)
      throw std::invalid_argument(Id(what, i) + " repeats a node");
    (*role)[v] = static_cast<int64_t>(i);
  };
  for (size_t i = 0; i < k; ++i) {
    claim("starts", i, starts[i], &collective_of_start);
    claim("waits", i, waits[i], &collective_of_wait);
  }
  Windows w;
  std::vector<int64_t> pos(n, -1);
  for (size_t s = 0; s < order.size; ++s) {
    const int64_t v = order[s];  // range and completeness: checked by the simulation before
    if (collective_of_wait[v] >= 0) continue;
    pos[v] = static_cast<int64_t>(w.others.size());
    w.others.push_back(v);
  }
  const int64_t end = static_cast<int64_t>(w.others.size());
  w.start_at.resize(k);
  w.earliest.assign(k, 0);
  w.latest.assign(k, end);
  // A start's result is its output and every alias of it (a bucket's items): the collective
  // of a node's storage root, or -1.
  auto collective_of_result = [&](int64_t v) {
    while (g.alias_of[v] >= 0) v = g.alias_of[v];
    return collective_of_start[v];
  };
  std::vector<uint8_t> reads_start(k, 0);
  for (size_t e = 0; e < g.edge_tails.size; ++e) {
    const int64_t p = g.edge_tails[e], c = g.edge_heads[e];
    if (collective_of_wait[c] >= 0) {  // a producer of a wait
      const int64_t i = collective_of_wait[c];
      if (collective_of_wait[p] >= 0)
        throw std::invalid_argument(Id("waits", i) + " reads another wait");
      if (collective_of_result(p) == i) reads_start[i] = 1;
      if (!g.is_input[p]) w.earliest[i] = std::max(w.earliest[i], pos[p] + 1);
    }
    if (collective_of_wait[p] >= 0) {  // a reader of a wait's output
      const int64_t i = collective_of_wait[p];
      w.latest[i] = std::min(w.latest[i], pos[c]);
    }
    const int64_t read = collective_of_result(p);  // a result read, not through its wait
    if (read >= 0 && c != waits[read] && collective_of_result(c) != read) {
      w.latest[read] = std::min(w.latest[read], pos[c]);
    }
  }
  for (size_t i = 0; i < k; ++i) {
    if (!reads_start[i]) throw std::invalid_argument(Id("waits", i) + " does not read its start");
    w.start_at[i] = pos[starts[i]];
  }
  if (max_in_flight > 0) {  // wait i before the start max_in_flight starts later
    std::vector<int64_t> by_start(k);
    for (size_t i = 0; i < k; ++i) by_start[i] = static_cast<int64_t>(i);
    std::sort(by_start.begin(), by_start.end(),
              [&](int64_t a, int64_t b) { return w.start_at[a] < w.start_at[b]; });
    for (size_t j = 0; j + max_in_flight < k; ++j) {
      const int64_t i = by_start[j];
      // Never before the wait's own producers: a bucket's wait reads items made after its start.
      w.latest[i] = std::min(w.latest[i],
                             std::max(w.earliest[i], w.start_at[by_start[j + max_in_flight]]));
    }
  }
  for (size_t i = 0; i < k; ++i) {
    if (w.earliest[i] > w.latest[i]) {
      throw std::invalid_argument(Id("waits", i) + " has a producer after the first reader of "
                                  "its collective's result; the order is invalid");
    }
  }
  return w;
}

std::vector<int64_t> BuildOrder(const Windows& w, Span<int64_t> waits, int64_t distance) {
  const int64_t end = static_cast<int64_t>(w.others.size());
  std::vector<std::vector<int64_t>> before(end + 1);
  std::vector<int64_t> by_start(waits.size);
  for (size_t i = 0; i < waits.size; ++i) by_start[i] = static_cast<int64_t>(i);
  std::stable_sort(by_start.begin(), by_start.end(),
                   [&](int64_t a, int64_t b) { return w.start_at[a] < w.start_at[b]; });
  for (int64_t i : by_start) {
    const int64_t want = w.start_at[i] + 1 + std::min(distance, end);
    before[std::clamp(want, w.earliest[i], w.latest[i])].push_back(waits[i]);
  }
  std::vector<int64_t> order;
  order.reserve(w.others.size() + waits.size);
  for (int64_t p = 0; p <= end; ++p) {
    for (int64_t v : before[p]) order.push_back(v);
    if (p < end) order.push_back(w.others[p]);
  }
  return order;
}

int64_t MostInFlight(const std::vector<int64_t>& order, Span<int64_t> starts, Span<int64_t> waits,
                     int64_t num_nodes) {
  std::vector<int8_t> delta(num_nodes, 0);
  for (size_t i = 0; i < starts.size; ++i) delta[starts[i]] = 1, delta[waits[i]] = -1;
  int64_t now = 0, most = 0;
  for (int64_t v : order) most = std::max(most, now += delta[v]);
  return most;
}

}  // namespace

WaitPlacement PlaceCollectiveWaits(const MemoryGraph& g, Span<int64_t> order,
                                   Span<int64_t> starts, Span<int64_t> waits, double prefetch_budget_bytes,
                                   int64_t max_in_flight) {
  g.Validate();
  if (starts.size != waits.size)
    throw std::invalid_argument("starts and waits must have one entry per collective");
  SimulateMemoryUnchecked(g, order);  // checks the order itself
  const Windows w = Analyze(g, order, starts, waits, max_in_flight);
  WaitPlacement out;
  out.order = BuildOrder(w, waits, 0);
  out.peak_bytes = out.peak_bytes_synchronous = SimulateMemoryUnchecked(g, out.order).peak_bytes;
  const double budget = prefetch_budget_bytes < 0 ? out.peak_bytes_synchronous : prefetch_budget_bytes;
  // Largest D in [0, m] whose peak fits (peaks are non-decreasing in D); D = 0 is kept even
  // over the budget: it is the synchronous placement. out.order is always the order at lo.
  int64_t lo = 0, hi = static_cast<int64_t>(w.others.size());
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    std::vector<int64_t> candidate = BuildOrder(w, waits, mid);
    const double peak = SimulateMemoryUnchecked(g, candidate).peak_bytes;
    if (peak <= budget) {
      lo = mid;
      out.order = std::move(candidate);
      out.peak_bytes = peak;
    } else {
      hi = mid - 1;
    }
  }
  out.distance = lo;
  out.max_in_flight = MostInFlight(out.order, starts, waits, g.num_nodes);
  return out;
}

}  // namespace dcr
