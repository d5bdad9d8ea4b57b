"""Data across the C++ boundary by name (csrc/python/array_struct.h, graph_bindings.cc).

The joint graph and the memory graph are bound classes built by keyword and read by
attribute; results are bound C++ structs read by attribute. These tests guard the boundary
itself: every array reaches C++ under its own name and comes back under it, a wrong keyword is
an error naming it, and a result's arrays stay valid and read-only.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch.fx as fx

from deepcompile_remat import _C, fx_arrays
from deepcompile_remat.partition import fx_export

# A 4-node joint graph: x (primal) -> y = relu(x) -> z = sum(y); tangent t -> dz.
# Every array differs from the others, so an array crossing under another's name shows.
JOINT = dict(
    bytes=np.array([64.0, 64.0, 4.0, 4.0]),
    op_class=np.array([_C.OpClass.PLACEHOLDER, _C.OpClass.POINTWISE, _C.OpClass.REDUCTION,
                       _C.OpClass.PLACEHOLDER], dtype=np.uint8),
    flags=np.array([_C.NodeFlag.PRIMAL, 0, 0, _C.NodeFlag.BACKWARD_INPUT], dtype=np.uint32),
    recompute=np.array([0, _C.RecomputeTag.PREFER_RECOMPUTE, 0, 0], dtype=np.int8),
    ac_graph_id=np.array([-1, 7, -1, -1], dtype=np.int64),
    edge_tails=np.array([0, 1, 1], dtype=np.int64),
    edge_heads=np.array([1, 2, 3], dtype=np.int64),
    fwd_outputs=np.array([2], dtype=np.int64),
    bwd_outputs=np.array([3], dtype=np.int64),
)

MEMORY = dict(
    bytes=np.array([8.0, 0.0, 16.0]),
    alias_of=np.array([-1, 0, -1], dtype=np.int64),
    is_input=np.array([1, 0, 0], dtype=np.uint8),
    persistent=np.array([1, 0, 0], dtype=np.uint8),
    keep=np.array([0, 0, 1], dtype=np.uint8),
    workspace=np.zeros(0),
    edge_tails=np.array([0, 1], dtype=np.int64),
    edge_heads=np.array([1, 2], dtype=np.int64),
)


def _array_properties(cls) -> set:
    return {name for name, v in vars(cls).items()
            if isinstance(v, property) and name != "num_nodes"}


@pytest.mark.parametrize("cls, arrays", [(_C.JointGraph, JOINT), (_C.MemoryGraph, MEMORY)])
def test_graph_built_by_keyword_reads_every_array_back_by_name(cls, arrays):
    """Guards against an array crossing under another array's name (the positional-argument
    bug: nine arrays in a fixed order in two files), and against a bound array the test (and
    so the keyword constructor) does not cover."""
    assert _array_properties(cls) == set(arrays), "a bound array this test does not build"
    graph = cls(**arrays)
    assert graph.num_nodes == len(arrays["bytes"])
    for name, want in arrays.items():
        got = getattr(graph, name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert not got.flags.writeable, f"{name} can be edited through the graph"


def test_graph_keywords_in_any_order_give_the_same_cut():
    """Guards against keyword order mattering anywhere (e.g. a binding that zips the keywords
    with its field list): the reversed keyword order must give the same partition."""
    forward = _C.JointGraph(**JOINT)
    backward = _C.JointGraph(**dict(reversed(list(JOINT.items()))))
    a = _C.partition_joint_graph(forward, policy=_C.RematPolicy.conservative,
                                 mark_parameter_aliases=True)
    b = _C.partition_joint_graph(backward, policy=_C.RematPolicy.conservative,
                                 mark_parameter_aliases=True)
    np.testing.assert_array_equal(a.saved_nodes, b.saved_nodes)
    np.testing.assert_array_equal(a.node_info, b.node_info)
    assert a.cut_cost == b.cut_cost


@pytest.mark.parametrize("cls, arrays", [(_C.JointGraph, JOINT), (_C.MemoryGraph, MEMORY)])
def test_missing_or_misspelled_keyword_is_named(cls, arrays):
    """Guards against a forgotten or misspelled array being ignored (or defaulted) silently:
    the error must name the keyword at fault."""
    name = cls.__name__
    for field in arrays:
        partial = {k: v for k, v in arrays.items() if k != field}
        with pytest.raises(TypeError, match=rf"{name}\(\) missing keyword argument '{field}'"):
            cls(**partial)
        misspelled = {**partial, field + "s": arrays[field]}
        with pytest.raises(TypeError,
                           match=rf"{name}\(\) got an unexpected keyword argument '{field}s'"):
            cls(**misspelled)
    with pytest.raises(TypeError):
        cls(*arrays.values())  # positional: refused


def test_lossy_conversion_is_refused_naming_the_array():
    """Guards against an array converted with loss (float node ids truncated to int64, a 2-D
    array flattened): the error names the array."""
    with pytest.raises(TypeError, match="edge_tails must be a 1-D array of int64"):
        _C.JointGraph(**{**JOINT, "edge_tails": JOINT["edge_tails"].astype(np.float64)})
    with pytest.raises(TypeError, match="bytes must be a 1-D array of float64"):
        _C.JointGraph(**{**JOINT, "bytes": JOINT["bytes"].reshape(2, 2)})
    graph = _C.JointGraph(**{**JOINT, "edge_tails": [0, 1, 1]})  # a list of ints: no loss
    assert graph.edge_tails.dtype == np.int64


def test_invalid_values_get_the_cpp_validate_message():
    """Guards against validation moving out of C++ or changing: the bound class runs
    JointGraphView::Validate / MemoryGraph::Validate, whose ValueError names array and index."""
    with pytest.raises(ValueError, match="flags has 3 entries, expected num_nodes = 4"):
        _C.JointGraph(**{**JOINT, "flags": JOINT["flags"][:3]})
    with pytest.raises(ValueError, match="goes backwards"):
        _C.JointGraph(**{**JOINT, "edge_tails": np.array([1, 1, 1]),
                         "edge_heads": np.array([0, 2, 3])})
    with pytest.raises(ValueError, match="alias_of"):
        _C.MemoryGraph(**{**MEMORY, "alias_of": np.array([-1, 2, -1])})


def test_result_arrays_outlive_the_result_and_are_read_only():
    """Guards against a result's numpy view outliving the C++ vector it views (a dangling
    pointer after the result is freed) and against edits through it."""
    cut = _C.partition_joint_graph(_C.JointGraph(**JOINT), policy=_C.RematPolicy.conservative,
                                   mark_parameter_aliases=True)
    saved, info = cut.saved_nodes, cut.node_info
    want_saved, want_info = saved.copy(), info.copy()
    del cut
    gc.collect()
    _C.partition_joint_graph(_C.JointGraph(**JOINT), policy=_C.RematPolicy.aggressive,
                             mark_parameter_aliases=False)  # reuses freed memory, if any
    np.testing.assert_array_equal(saved, want_saved)
    np.testing.assert_array_equal(info, want_info)
    assert len(info) == 4 and not info.flags.writeable
    timeline = _C.simulate_memory(_C.MemoryGraph(**MEMORY), order=np.array([1, 2]))
    assert timeline.peak_bytes == 24.0 and timeline.peak_step == 1
    np.testing.assert_array_equal(timeline.live_after, [8.0, 24.0])


def test_node_facts_are_joint_graph_arrays():
    """Guards against fx_arrays' per-node facts and the C++ arrays drifting apart: every
    NodeFacts field is a JointGraph array of the same name, and an exported FX graph reads back,
    by name, what fx_export described."""
    assert set(fx_arrays.NodeFacts._fields) <= _array_properties(_C.JointGraph)
    g = fx.Graph()
    x = g.placeholder("primals_1")
    t = g.placeholder("tangents_1")
    y = g.call_function(len, (x,))
    g.output(([y], [t]))
    exported = fx_export.export_joint_graph(fx.GraphModule({}, g), num_fwd_outputs=1)
    assert isinstance(exported, _C.JointGraph)
    assert [n.name for n in exported.nodes] == ["primals_1", "tangents_1", "len_1"]
    assert exported.flags[0] & _C.NodeFlag.PRIMAL
    assert exported.flags[1] & _C.NodeFlag.BACKWARD_INPUT
    np.testing.assert_array_equal(exported.op_class[:2], [int(_C.OpClass.PLACEHOLDER)] * 2)
    np.testing.assert_array_equal(exported.edge_tails, [0])
    np.testing.assert_array_equal(exported.edge_heads, [2])
    np.testing.assert_array_equal(exported.fwd_outputs, [2])
    np.testing.assert_array_equal(exported.bwd_outputs, [1])
    np.testing.assert_array_equal(exported.ac_graph_id, [-1, -1, -1])
