"""A restarted job: Inductor's on-disk FX graph cache serves the compiled forward and backward of a
model compiled with the backend (keyed on the graphs fp4compile's passes produce), with the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # two fresh processes, each compiling

_RUN = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    import fp4compile

    torch.manual_seed(0)
    fp4compile.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    backend = fp4compile.Backend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64)
    loss = compiled(x).square().sum()
    loss.backward()
    print(json.dumps({
        "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
        "loss": loss.item(), "grads": [p.grad.double().sum().item() for p in model.parameters()],
        "fp4": backend.report.counts().get("nvfp4", 0), "graphs": len(backend.report.graphs),
    }))
""")


def test_a_restarted_job_gets_its_compiled_graphs_from_inductors_cache(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["hits"] == 0 and cold["misses"] >= 2  # forward and backward compiled
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0  # and served on the restart
    assert warm["loss"] == cold["loss"] and warm["grads"] == cold["grads"]
    assert warm["fp4"] == cold["fp4"] == 3 and warm["graphs"] == cold["graphs"]  # the report is whole
