import os

import pytest
import torch

# The processes the tests spawn (rank processes of compare and profile, the command-line
# subprocesses) compile from scratch too: a warm on-disk cache skips the partitioner there, so
# a check that ours cut the graphs (reports, compare's our_partitions) would fail or pass on
# the cache's state. Forced through the environment, which spawned processes inherit.
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    """Every test compiles from scratch: caches would skip the partitioner (and its report)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import deepcompile_remat

    torch._dynamo.reset()
    deepcompile_remat.clear_reports()
    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        torch.manual_seed(0)
        yield
    torch._dynamo.reset()
