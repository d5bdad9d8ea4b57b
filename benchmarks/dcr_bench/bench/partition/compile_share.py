"""bench-partition --compile-share: the partitioner's share of a whole torch.compile (first
forward + backward less a warm step), before and after, on the eager and inductor backends."""
from __future__ import annotations

import contextlib
import time

from dcr_bench.bench.joint_capture import build_speed_model


def compile_once(name: str, kind: str, *, before: bool, tiny: bool = False) -> dict:
    """One fresh torch.compile of SPEED_GRAPHS[name] on backends.backend(kind), FX
    graph and autograd caches off: milliseconds in our partitioner and in the whole compile
    (first step less a warm step), and the share."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from deepcompile_remat.backends import backend
    from deepcompile_remat.planning import partition_fn

    fn, inputs = build_speed_model(name, tiny)
    spent = []
    real = partition_fn.partition_joint_graph

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **{**kwargs, "torch_passes": before})
        finally:
            spent.append(time.perf_counter() - t0)

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        partition_fn.partition_joint_graph = timed  # remat_partition_fn's closure looks it up
        stack.callback(setattr, partition_fn, "partition_joint_graph", real)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend(kind))
        steps = []
        for _ in range(2):
            t0 = time.perf_counter()
            compiled(*inputs).float().pow(2).mean().backward()
            steps.append(time.perf_counter() - t0)
        torch._dynamo.reset()
    compile_s = max(steps[0] - steps[1], 1e-9)
    return {"partition_ms": sum(spent) * 1e3, "compile_ms": compile_s * 1e3,
            "share": sum(spent) / compile_s}


def compile_share(name: str, kind: str, tiny: bool = False) -> dict:
    """The partitioner's share of compile time, before and after, each after an untimed
    compile that warms the kernel caches both then hit alike."""
    compile_once(name, kind, before=False, tiny=tiny)
    return {"graph": name, "backend": kind,
            "before": compile_once(name, kind, before=True, tiny=tiny),
            "after": compile_once(name, kind, before=False, tiny=tiny)}
