"""A restarted job: Inductor's on-disk FX graph cache serves the compiled forward and backward of a
model compiled with the backend (keyed on the graphs fp4compile's passes produce), with the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # three fresh processes, each compiling

_RUN = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    import fp4compile

    PATCH
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
        "user_pass_calls": USER_PASS_CALLS[0],
    }))
""")


# Another version of fp4compile (its code hash patched) with a post-grad pass of the user's own.
_OTHER_VERSION = textwrap.dedent("""
    import fp4compile.backend
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    fp4compile.backend._code_version = lambda: b"another version of fp4compile"
    USER_PASS_CALLS = [0]

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            USER_PASS_CALLS[0] += 1

        def uuid(self):
            return "user pass"

    inductor_config.post_grad_custom_pre_pass = UserPass()
""")


def test_a_restarted_job_gets_its_compiled_graphs_from_inductors_cache(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    runs = []
    same = "USER_PASS_CALLS = [0]"
    for patch in (same, same, _OTHER_VERSION):
        script = _RUN.replace("PATCH", patch)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm, other = runs
    assert cold["hits"] == 0 and cold["misses"] >= 2  # forward and backward compiled
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0  # and served on the restart
    assert warm["loss"] == cold["loss"] and warm["grads"] == cold["grads"]
    assert warm["fp4"] == cold["fp4"] == 3 and warm["graphs"] == cold["graphs"]  # the report is whole
    # Another fp4compile version compiles the same model's graphs again (the cache is keyed on the code's
    # version: a cached graph may call ops or kernels that version does not have), with the same bits,
    # and a post-grad pass the user set still runs (on the forward and the backward).
    assert other["hits"] == 0 and other["misses"] == cold["misses"]
    assert other["loss"] == cold["loss"] and other["grads"] == cold["grads"]
    assert other["user_pass_calls"] >= 2
