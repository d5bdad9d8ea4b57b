"""comm.cast_and_gather on one GPU: no allocation beyond the outputs, the cast on the caller's current
stream, under the shards' device. Skipped without a CUDA device; run on the GPU machine by
scripts/gpu_check.sh. The collective logic of the NCCL path is tested on CPU
(test_nccl_path.py)."""
import pytest
import torch

from deepcompile_remat import comm
from deepcompile_remat.comm import cuda_module
from test_cast_ops import DTYPES, nasty_fp32, same_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU spin: long enough for a missing wait to show


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_allocation_beyond_the_outputs(dtype):
    """The fused path casts straight into the given outputs: no fp32 full weight, no staging
    buffer, nothing else from the caching allocator."""
    _require_cast_kernel()
    shards = [nasty_fp32(n, seed=n).cuda() for n in (3, 4099, 1 << 20)]
    outs = [torch.empty(s.numel(), dtype=dtype, device="cuda") for s in shards]
    # warm: the module check (cuda_module.usable) and the NaN probe, both cached
    comm.cast_and_gather(shards, outputs=outs, dtype=dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    comm.cast_and_gather(shards, outputs=outs, dtype=dtype)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before
    for s, o in zip(shards, outs):
        assert same_bits(o, s.to(dtype))


def _require_cast_kernel():
    """The CUDA module's cast kernel must be what fill_slots runs: with it unbuilt or unusable
    the runtime silently casts with torch, and a test of our kernel would test torch's."""
    if not comm.cuda_usable():
        pytest.fail("the CUDA extension (deepcompile_remat._cuda) is not built or not usable "
                    "with this torch and driver, so this would test torch's cast, not ours; "
                    "build it first (scripts/gpu_check.sh builds it right before running the "
                    f"GPU tests): {comm.cuda_build_info()}")


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_runs_on_the_current_stream_after_the_producer(dtype, path, monkeypatch):
    """Everything on a side stream that is kept busy: the shards are produced late on it, and
    allgather_cast must cast on that (current) stream, after the producer. A cast launched on
    the default stream, or on a stream of its own without waiting, reads the shards before
    they are written and fails this. (The old version of this test delayed a stream the
    runtime no longer used: it could not fail.) Both slot fills: our kernel ("kernel": the
    module must be built and usable, else the test fails) and torch's _foreach_copy_, what
    the runtime falls back to ("torch")."""
    if path == "kernel":
        _require_cast_kernel()
        launches = []
        real = cuda_module.require_cuda_module()

        class _Counting:  # the kernel must be what runs, not torch's copy
            def __getattr__(self, name):
                return getattr(real, name)

            def cast_into_slots(self, *args):
                launches.append(args)
                return real.cast_into_slots(*args)

        monkeypatch.setattr(cuda_module, "require_cuda_module", lambda: _Counting())
    else:
        monkeypatch.setattr(cuda_module, "usable", lambda: False)
    base = [nasty_fp32(n, seed=n).cuda() for n in (17, 1 << 20)]
    expected = [b.to(dtype) for b in base]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        shards = [torch.empty_like(b) for b in base]
        torch.cuda._sleep(SLEEP_CYCLES)  # the producer finishes late
        for s, b in zip(shards, base):
            s.copy_(b)
        handle = comm.cast_and_gather(shards, dtype=dtype, async_op=True)
        outs = handle.wait()
        got = [o.clone() for o in outs]  # read in stream order after the wait
    torch.cuda.synchronize()
    for g, e in zip(got, expected):
        assert same_bits(g, e)
    if path == "kernel":
        assert len(launches) == 1, "the cast did not run through the CUDA module's kernel"
        assert launches[0][-1] == side.cuda_stream, "the kernel ran on another stream"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_runs_on_the_shards_device(dtype):
    """Current device 0, shards on device 1 (the eager backend can run a graph so): the cast
    must run under device 1."""
    shards = [nasty_fp32(n, seed=n).to("cuda:1") for n in (5, 4099)]
    torch.cuda.set_device(0)
    outs = comm.cast_and_gather(shards, dtype=dtype)
    torch.cuda.synchronize(1)
    for s, o in zip(shards, outs):
        assert o.device == s.device and same_bits(o, s.to(dtype))
