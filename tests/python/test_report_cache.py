"""PartitionReports survive torch's compile caches (partition/report_cache.py).

Before: with the AOTAutograd cache on (torch's default), a compile served from the cache never
ran the partitioner, so `dcr.reports()`, the documented way to check that ours cut the graph,
came back empty on every warm start: a false negative. Each run below is a fresh process with
the caches on, in a cache folder of its own (the suite's conftest turns them off elsewhere).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import json, logging, shutil, sys
    import torch
    import deepcompile_remat as dcr
    from deepcompile_remat.partition import report_cache
    from torch._dynamo.utils import counters

    warnings = []
    class Warnings(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("deepcompile_remat").addHandler(Warnings(logging.WARNING))

    def compile_once():
        torch._dynamo.reset()
        dcr.clear_reports()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 8))
        compiled = torch.compile(model, backend=dcr.backend("inductor"))
        compiled(torch.randn(4, 16)).sum().backward()
        assert model[0].weight.grad is not None
        return [{"saved": [v.name for v in r.saved], "recomputed": list(r.recomputed),
                 "policy": r.policy, "from_cache": r.from_cache} for r in dcr.reports()]

    out = {"first": compile_once(), "hits": counters["aot_autograd"]["autograd_cache_hit"]}
    out["warnings_first"] = list(warnings)
    if sys.argv[1] == "forget":  # the kept reports removed, the cache entry still there
        shutil.rmtree(report_cache._path("x").rsplit("/", 1)[0])
        out["forgotten"] = compile_once()
        out["hits"] = counters["aot_autograd"]["autograd_cache_hit"]
    out["warnings"] = warnings
    print("RESULT " + json.dumps(out))
""")


def _run(cache_dir, mode="plain"):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_reports_survive_a_warm_compile_cache(tmp_path):
    """Silent bug guarded: the second process, served from the AOTAutograd cache, got no
    report; it must get the first process's decision, marked from_cache. And when the kept
    reports are gone, a warning, not silence."""
    cold = _run(tmp_path)
    assert cold["hits"] == 0 and len(cold["first"]) == 1, cold
    assert not cold["first"][0]["from_cache"] and cold["first"][0]["saved"], cold

    warm = _run(tmp_path, "forget")
    assert warm["hits"] >= 1, "the second process missed the cache: the test proves nothing"
    [restored] = warm["first"]
    assert restored["from_cache"]
    assert {k: v for k, v in restored.items() if k != "from_cache"} == \
        {k: v for k, v in cold["first"][0].items() if k != "from_cache"}
    assert not warm["warnings_first"], warm["warnings_first"]

    assert warm["forgotten"] == [] and warm["hits"] >= 2, warm
    assert any("served from torch's AOTAutograd cache" in w and "reports() lacks it" in w
               for w in warm["warnings"]), warm["warnings"]
