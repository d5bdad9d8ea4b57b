"""Cast kernels and comm.cast_and_gather against torch's own cast + all_gather, bit for bit."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from deepcompile_remat import _C, comm

DTYPES = [torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().view(torch.int16).numpy().view(np.uint16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(view), b.view(view))


def nasty_fp32(n: int, seed: int = 0) -> torch.Tensor:
    """Random values plus NaNs (with payloads and signs), infs, subnormals of both formats,
    fp16 overflow edges and exact round-to-even ties."""
    g = np.random.default_rng(seed)
    u = g.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0x00000001,
                         0x80000000, 0x33000000, 0x33800000, 0x387FE000, 0x477FF000, 0x477FE000,
                         0x3F808000, 0x3F818000, 0x3F801000, 0x3F803000, 0x7F7F8000],
                        dtype=np.uint32)
    u[: min(n, specials.size)] = specials[: min(n, specials.size)]
    normals = g.standard_normal(n // 3).astype(np.float32).view(np.uint32)
    u[specials.size: specials.size + normals.size] = normals[: max(0, n - specials.size)]
    return torch.from_numpy(u.view(np.float32).copy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 17, 1000, 4099])
@pytest.mark.parametrize("start", [0, 1, 3])
def test_kernel_bit_identical_to_torch(dtype, n, start):
    full = nasty_fp32(n + start, seed=n)
    src = full[start:]  # unaligned view
    out = torch.full((n + 5,), -1, dtype=torch.int16)
    option = comm.torch_nan_option("cpu", dtype)
    assert option is not None
    _C.cast_fp32_into(src.numpy(), out.numpy(), 2, str(dtype).split(".")[1], option.nan_mode,
                      option.canonical_nan)
    np.testing.assert_array_equal(out.numpy()[2:2 + n].view(np.uint16), bits(src.to(dtype)))
    assert (out.numpy()[:2] == -1).all() and (out.numpy()[2 + n:] == -1).all()


def test_kernel_rejects_bad_arrays():
    src = np.ones(4, np.float32)
    with pytest.raises(TypeError):
        _C.cast_fp32_into(src.astype(np.float64), np.zeros(4, np.int16), 0, "bfloat16")
    with pytest.raises(TypeError):
        _C.cast_fp32_into(src, np.zeros(4, np.int32), 0, "bfloat16")
    with pytest.raises(ValueError):
        _C.cast_fp32_into(src, np.zeros(8, np.int16)[::2], 0, "bfloat16")  # strided: would copy
    with pytest.raises(ValueError):
        _C.cast_fp32_into(src, np.zeros(5, np.int16), 2, "bfloat16")
    with pytest.raises(ValueError):
        _C.cast_fp32_into(src, np.zeros(4, np.int16), 0, "float8")
    with pytest.raises(ValueError):
        _C.cast_fp32_into(src, np.zeros(4, np.int16), 0, "bfloat16", "canonical", 0x1234)


@pytest.mark.parametrize("dtype", DTYPES + [None])
def test_world_size_one(dtype):
    shards = [nasty_fp32(5, 1), nasty_fp32(8, 2)]
    outs = comm.cast_and_gather(shards, dtype=dtype)
    for s, o in zip(shards, outs):
        want = s if dtype is None else s.to(dtype)
        assert o.dtype == want.dtype
        np.testing.assert_array_equal(o.view(torch.int16 if o.element_size() == 2 else torch.int32).numpy(),
                                      want.view(o.view(torch.int16 if o.element_size() == 2 else torch.int32).dtype).numpy())
    handle = comm.cast_and_gather(shards, dtype=dtype, async_op=True)
    assert len(handle.wait()) == 2 and handle.is_completed()


def test_argument_checks():
    with pytest.raises(ValueError):
        comm.cast_and_gather([torch.ones(2, 2)])
    with pytest.raises(ValueError):
        comm.cast_and_gather([torch.ones(4)], outputs=[torch.empty(3, dtype=torch.bfloat16)],
                           dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        comm.cast_and_gather([torch.ones(4, dtype=torch.float16)], dtype=torch.bfloat16)


def test_cuda_build_info_says_why():
    info = comm.cuda_build_info()
    assert "built" in info and "reason" in info
    if not comm.cuda_available():
        assert info["reason"] or info["import_error"]


def _cast_and_gather_matches_torch(rank, world, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    # Uneven true sizes, padded to the same shard length per rank: 10 -> 5, 7 -> 4 (pad 1).
    sizes = {"a": 5, "b": 4, "c": 1}
    for dtype in DTYPES + [None]:
        for async_op in (False, True):
            shards = [nasty_fp32(n, seed=100 * rank + i).to(device)
                      for i, n in enumerate(sizes.values())]
            got = comm.cast_and_gather(shards, dtype=dtype, group=None, async_op=async_op)
            if async_op:
                got = got.wait()
            for s, o in zip(shards, got):
                cast = s if dtype is None else s.to(dtype)
                # torch's cast, then torch's all_gather (of the bytes: gloo has no bf16)
                parts = [torch.empty_like(cast).view(torch.uint8) for _ in range(world)]
                dist.all_gather(parts, cast.view(torch.uint8))
                want = torch.cat(parts).view(cast.dtype)
                assert same_bits(want.cpu(), o.cpu()), \
                    f"rank {rank} dtype {dtype} async {async_op}"


def _run_world(world, backend):
    from dist_utils import run_ranks

    run_ranks(_cast_and_gather_matches_torch, world, backend, backend=backend)


@pytest.mark.slow
def test_two_rank_gloo_matches_torch():
    _run_world(2, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 1, 2, 3])
@pytest.mark.parametrize("path", ["vector", "scalar"])
def test_cuda_kernel_bit_identical_to_torch(dtype, start, path):
    """Source `start` floats past a 16-byte boundary (a scalar head of (4 - start) % 4);
    destination offset chosen so the float4 body runs after that head ("vector": dst + head
    8-byte aligned) or cannot run ("scalar")."""
    if not comm.cuda_available():
        pytest.fail(f"CUDA device present but _cuda not built: {comm.cuda_build_info()}")
    from deepcompile_remat import _cuda

    # Offsets on the device buffers themselves: .cuda() of a CPU view would realign them.
    srcs = [nasty_fp32(n + start, seed=n).cuda()[start:] for n in (1, 3, 17, 4099, 1 << 20)]
    dst_offset = start + (0 if path == "vector" else 1)
    option = comm.torch_nan_option("cuda", dtype)
    assert option is not None
    outs = [torch.full((s.numel() + 8,), -1, dtype=torch.int16, device="cuda") for s in srcs]
    stream = torch.cuda.current_stream()
    _cuda.cast_into_slots([s.data_ptr() for s in srcs], [o[dst_offset:].data_ptr() for o in outs],
                          [s.numel() for s in srcs], str(dtype).split(".")[1], option.nan_mode,
                          option.canonical_nan, stream.cuda_stream)
    for s, o in zip(srcs, outs):
        o = o.cpu()
        got = o[dst_offset:dst_offset + s.numel()].numpy().view(np.uint16)
        np.testing.assert_array_equal(got, bits(s.to(dtype)))
        assert (o[:dst_offset] == -1).all() and (o[dst_offset + s.numel():] == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_world_size_one():
    shards = [nasty_fp32(n, seed=n).cuda() for n in (5, 4099)]
    for dtype in DTYPES + [None]:
        outs = comm.cast_and_gather(shards, dtype=dtype)
        for s, o in zip(shards, outs):
            assert same_bits(o, s if dtype is None else s.to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_rank_nccl_matches_torch():
    _run_world(2, "nccl")


def _bench_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "bench_allgather_cast.py"
    spec = importlib.util.spec_from_file_location("bench_allgather_cast", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_fill_benchmark_runs_and_its_bit_check_can_fail(monkeypatch, capsys, tmp_path):
    """benchmarks/scripts/bench_allgather_cast.py --cpu, on a tiny bucket: it prints (and writes) a
    time and a bandwidth for each slot fill, and our kernel's slots equal torch's bit for bit.
    With the kernel made a no-op the bit check says so (before: the slots still held the torch
    runs' bits, so it could not fail)."""
    bench = _bench_module()
    shapes = [(64, 48), (33,), (130, 7)]
    monkeypatch.setattr(bench, "LAYER_SHAPES", shapes)
    out = tmp_path / "cpu_fill.json"
    monkeypatch.setattr(sys, "argv", ["bench_allgather_cast.py", "--cpu", "--layers", "2",
                                      "--iters", "2", "--json", str(out)])
    bench.main()
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    fill = printed["cpu_fill"]
    assert fill["same_bits"] is True
    assert fill["elements"] == 2 * sum(-(-math.prod(s) // 2) for s in shapes)
    for name in ("our_kernel", "torch_foreach_copy", "torch_copy_per_tensor"):
        assert fill[name]["ms"] > 0 and math.isfinite(fill[name]["GBps"]), (name, fill[name])
        assert fill[name]["GBps"] > 0, (name, fill[name])
    monkeypatch.setattr(_C, "cast_shards_into_slots", lambda *args, **kwargs: None)
    assert bench.bench_cpu_fill(1, 1)["same_bits"] is False
