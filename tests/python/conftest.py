import pytest
import torch


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
