"""With DeepCompile on ("compile": {"deepcompile": true}, CUDA only): our partitioner in place of
DeepSpeed's.

DeepCompile owns ZeRO-3 itself (its own gather/release passes, grad buffers); what we replace is
only the partitioner it runs on the joint graph. It tags parameter aliases MUST_RECOMPUTE and
then calls
  - eager backend: the module-global ``min_cut_rematerialization_partition`` of
    deepspeed.compile.backend (through get_wrapped_partitioner);
  - inductor backend: inductor's partition_fn, which honours
    ``torch._inductor.config.custom_partitioner_fn``.
install(engine, remat) wraps the backend function engine.compile() gets from DeepCompile so
that, while it compiles a graph, both point at our min-cut (parameters: the graph inputs that
are DeepSpeed ZeRO-3 parameters), and are restored afterwards: nothing leaks into other
compilations in the process.
"""
from __future__ import annotations

import contextlib
import functools

from deepcompile_remat.deepspeed import _ds_internals as ds
from deepcompile_remat.deepspeed.adapter import DeepSpeedAdapter


def ds_parameter_indices(example_inputs) -> list:
    """Positions of the graph inputs that are DeepSpeed ZeRO-3 parameters (they carry ds_id)."""
    return [i for i, x in enumerate(example_inputs) if hasattr(x, "ds_id")]


@contextlib.contextmanager
def our_partitioner(remat, parameter_indices, num_graph_inputs, adapter: DeepSpeedAdapter):
    """Context manager: while it is open, both partitioner entry points DeepCompile uses (the
    eager backend's module-global, patched through `adapter`, and inductor's
    custom_partitioner_fn) are our RematPartitioner; both are restored on exit."""
    import torch._inductor.config as inductor_config

    from deepcompile_remat.backends import RematPartitioner

    # One partitioner for both paths: it takes the module-global's call as well (DeepSpeed's
    # wrapper passes keywords only).
    ours = RematPartitioner(remat, parameter_indices, num_graph_inputs)
    dc_backend = ds.deepcompile_backend_module()
    with adapter.replaced(dc_backend, "min_cut_rematerialization_partition", ours), \
            inductor_config.patch(custom_partitioner_fn=ours):
        yield


def wrap_backend(backend_fn, remat, adapter: DeepSpeedAdapter):
    """DeepCompile's backend function, partitioning with ours."""

    @functools.wraps(backend_fn)
    def backend_with_our_partitioner(gm, example_inputs, *args, **kwargs):
        with our_partitioner(remat, ds_parameter_indices(example_inputs), len(example_inputs),
                             adapter):
            return backend_fn(gm, example_inputs, *args, **kwargs)

    return backend_with_our_partitioner


def install(engine, remat, adapter: DeepSpeedAdapter) -> None:
    """Makes the backend engine.compile() gets from DeepCompile partition with ours (remat);
    every patch through `adapter`."""
    ds.wrap_deepcompile_backend(engine, lambda fn: wrap_backend(fn, remat, adapter), adapter)
