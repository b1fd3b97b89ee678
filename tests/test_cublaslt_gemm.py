"""The emulated FP4 GEMM's cuBLASLt path (codegen/cublaslt_gemm.py): alpha read on the device, applied
once in the epilogue, bfloat16 written directly.

The argument checks, layout handling and mode selection run everywhere; the GEMM itself needs a CUDA
GPU and nvmath-python (tests marked ``gpu``).
"""

from __future__ import annotations

import collections

import pytest
import torch

from fp4compile import config, formats
from fp4compile.codegen import cublaslt_gemm as cl

CUDA = torch.cuda.is_available()
HAVE_LT = cl.available()[0]
needs_lt = pytest.mark.skipif(not HAVE_LT, reason=f"cuBLASLt GEMMs cannot run here: {cl.available()[1]}")


def exact_operands(m, n, k, seed=0, device="cpu"):
    """Small-integer bf16 operands: every product and partial sum is exact in fp32, so any summation
    order (split-K included) gives the same accumulator and the output bits depend on the epilogue only."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-6, 7, (m, k), generator=g).to(torch.bfloat16)
    b = torch.randint(-6, 7, (n, k), generator=g).to(torch.bfloat16)
    return a.to(device), b.to(device)


def expected(a, b, alpha, out_dtype):
    return ((a.double() @ b.double().t()).float() * alpha.cpu()).to(out_dtype)


def test_row_major_layouts():
    t = torch.zeros(8, 32)
    assert cl._row_major(t, 8, 32)[1:] == (True, 32)
    assert cl._row_major(torch.zeros(32, 8).t(), 8, 32)[1:] == (False, 8)  # column-major, ld = rows, no copy
    wide = torch.zeros(8, 48)[:, :32]
    out, row_major, ld = cl._row_major(wide, 8, 32)
    assert (row_major, ld) == (True, 48) and out.data_ptr() == wide.data_ptr()  # padded rows, no copy
    strided = torch.zeros(8, 64)[:, ::2]
    out, row_major, ld = cl._row_major(strided, 8, 32)
    assert (row_major, ld) == (True, 32) and out.is_contiguous()  # neither layout: copied


def test_argument_errors_name_the_problem():
    a, b = exact_operands(4, 8, 16)
    alpha = torch.ones(1)
    with pytest.raises(ValueError, match=r"A \[M, K\] and B \[N, K\].*\(4, 16\) and \(8, 32\)"):
        cl.mm_alpha(a, torch.zeros(8, 32, dtype=torch.bfloat16), alpha)
    with pytest.raises(TypeError, match="bfloat16 operands, got torch.float32"):
        cl.mm_alpha(a.float(), b, alpha)
    with pytest.raises(TypeError, match="bfloat16 or float32, not torch.float16"):
        cl.mm_alpha(a, b, alpha, torch.float16)
    with pytest.raises(ValueError, match="one CUDA device"):
        cl.mm_alpha(a, b, alpha)


def test_mode_from_the_setting():
    with config.patch(emulated_gemm="torch"):
        assert cl.enabled() is False
    assert config.from_environment({"FP4COMPILE_EMULATED_GEMM": " Torch "})["emulated_gemm"] == "torch"
    with pytest.raises(ValueError, match="FP4COMPILE_EMULATED_GEMM='cuBLAS'"):
        config.from_environment({"FP4COMPILE_EMULATED_GEMM": "cuBLAS"})
    with pytest.raises(ValueError, match="emulated_gemm='cublas'"), config.patch(emulated_gemm="cublas"):
        pass
    with config.patch(emulated_gemm="auto"):
        assert cl.enabled() is HAVE_LT
    if not HAVE_LT:
        with pytest.raises(RuntimeError, match="cannot run here"), config.patch(emulated_gemm="cublaslt"):
            cl.enabled()


@pytest.mark.gpu
@needs_lt
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
# (64, 64, 65536): few output tiles and a long K, where cuBLASLt is likely to split K: the partial sums
# must be reduced in fp32 (a bf16 reduction would change these exact sums).
@pytest.mark.parametrize("m,n,k", [(16384, 1024, 1024), (300, 200, 16), (4096, 3072, 4096), (1, 1, 32), (64, 64, 65536)])
def test_alpha_applied_once_in_the_epilogue(m, n, k, out_dtype):
    a, b = exact_operands(m, n, k, seed=m + n + k, device="cuda")
    alpha = formats.gemm_alpha(torch.tensor(3.0e-3), torch.tensor(7.77e2)).cuda().reshape(1)
    out = cl.mm_alpha(a, b, alpha, out_dtype)
    torch.cuda.synchronize()
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.equal(out.cpu().view(torch.uint8), expected(a.cpu(), b.cpu(), alpha[0], out_dtype).view(torch.uint8))


@pytest.mark.gpu
@needs_lt
def test_operand_layouts_give_the_same_bits():
    m, n, k = 256, 192, 128
    a, b = exact_operands(m, n, k, seed=7, device="cuda")
    alpha = torch.full((1,), 0.3125, device="cuda")
    ref = cl.mm_alpha(a, b, alpha)
    a_cm = a.t().contiguous().t()  # column-major [m, k]
    b_cm = b.t().contiguous().t()
    a_pad = torch.zeros(m, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]
    a_pad.copy_(a)
    for x, y in ((a_cm, b), (a, b_cm), (a_cm, b_cm), (a_pad, b)):
        assert torch.equal(cl.mm_alpha(x, y, alpha), ref)
    assert torch.equal(ref.cpu(), expected(a.cpu(), b.cpu(), alpha[0], torch.bfloat16))


@pytest.mark.gpu
@needs_lt
def test_random_operands_match_torch_mm():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2048, 1024, device="cuda", generator=g).bfloat16()
    b = torch.randn(512, 1024, device="cuda", generator=g).bfloat16()
    alpha = torch.full((1,), 1.7e-3, device="cuda")
    out = cl.mm_alpha(a, b, alpha, torch.float32)
    ref = torch.mm(a, b.t(), out_dtype=torch.float32) * 1.7e-3
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.gpu
@needs_lt
def test_alpha_is_read_at_replay_in_a_cuda_graph():
    a, b = exact_operands(512, 256, 64, seed=11, device="cuda")
    alpha = torch.full((1,), 0.5, device="cuda")
    cl.mm_alpha(a, b, alpha)  # plan made before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cl.mm_alpha(a, b, alpha)
    for value in (0.5, 3.0e-7, 1234.5):
        alpha.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected(a.cpu(), b.cpu(), torch.tensor(value), torch.bfloat16))


@pytest.mark.gpu
@needs_lt
def test_emulated_scaled_mm_same_bits_with_either_gemm():
    from fp4compile.codegen import triton_kernels as tk

    a, b = exact_operands(1000, 768, 256, seed=5, device="cuda")
    amax_a, amax_b = torch.tensor(3.0e-3, device="cuda"), torch.tensor(7.77e2, device="cuda")
    outs = {"cublaslt": tk.cublaslt_scaled_mm(a, amax_a, b, amax_b), "torch": tk.emulated_scaled_mm(a, amax_a, b, amax_b)}
    assert torch.equal(outs["cublaslt"], outs["torch"])
    alpha = formats.gemm_alpha(amax_a.cpu(), amax_b.cpu())
    assert torch.equal(outs["torch"].cpu(), expected(a.cpu(), b.cpu(), alpha, torch.bfloat16))


@pytest.mark.skipif(HAVE_LT, reason="checks the message of the fallback")
@config.patch(emulated_gemm="auto")
def test_fallback_is_logged_once_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(cl, "_state", {k: v for k, v in cl._state.items() if not (isinstance(k, tuple) and k[0] == "logged")})
    with caplog.at_level("INFO", logger="fp4compile.codegen"):
        assert cl.enabled() is False
        assert cl.enabled() is False
    lines = [r.getMessage() for r in caplog.records if "emulated FP4 GEMMs" in r.getMessage()]
    assert len(lines) == 1 and "torch.mm with an fp32 output" in lines[0] and cl.available()[1] in lines[0]


@pytest.mark.gpu
@needs_lt
def test_out_is_written_never_read():
    """A NaN-filled ``out`` (also cuBLASLt's C) must not leak into the result: beta is zero."""
    a, b = exact_operands(2048, 1024, 1024, seed=2, device="cuda")
    alpha = torch.full((1,), 0.3125, device="cuda")
    out = torch.full((2048, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert cl.mm_alpha(a, b, alpha, out=out) is out
    assert torch.equal(out.cpu(), expected(a.cpu(), b.cpu(), alpha[0].cpu(), torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be a contiguous \[2048, 1024\]"):
        cl.mm_alpha(a, b, alpha, out=torch.empty(1024, 2048, dtype=torch.bfloat16, device="cuda").t())
    with pytest.raises(ValueError, match=r"out must be a contiguous \[2048, 1024\]"):
        cl.mm_alpha(a, b, alpha, out=out[:, :512])


@pytest.mark.gpu
@needs_lt
def test_first_call_under_inductor_cuda_graphs(tmp_path):
    """A fresh process whose first emulated GEMM runs in Inductor's CUDA-graph warm-up: the module's
    workspace must stay outside the graph's memory pool (CUDA graph trees check that every live
    allocation in the pool is accounted for)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "first_call.py"
    script.write_text(
        "import torch, fp4compile\n"
        "from fp4compile.codegen import cublaslt_gemm as cl\n"
        "class Proj(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = torch.nn.ModuleList([torch.nn.Linear(256, 256)])\n"
        "    def forward(self, x):\n"
        "        return self.blocks[0](x)\n"
        "torch.manual_seed(0)\n"
        "model = Proj().cuda()\n"
        "backend = fp4compile.Backend(mode='reduce-overhead', high_precision_first_blocks=0, high_precision_last_blocks=0)\n"
        "step = torch.compile(model, backend=backend)\n"
        "x, g = torch.randn(4, 512, 256, device='cuda'), torch.randn(4, 512, 256, device='cuda')\n"
        "for _ in range(4):  # warm-up (the first cuBLASLt call), recording, replays\n"
        "    xd = x.clone().requires_grad_()\n"
        "    (step(xd) * g).sum().backward()\n"
        "    model.zero_grad(set_to_none=True)  # a grad accumulated into a graph's output would be overwritten\n"
        "torch.cuda.synchronize()\n"
        "assert any(isinstance(k, int) for k in cl._state), 'cuBLASLt was not used'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FP4COMPILE_EMULATED_GEMM="cublaslt", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_describe_names_the_path_and_the_reason():
    with config.patch(emulated_gemm="torch"):
        assert cl.describe() == "torch.mm to fp32 and an epilogue kernel (FP4COMPILE_EMULATED_GEMM=torch)"
    with config.patch(emulated_gemm="auto"):
        if HAVE_LT:
            assert cl.describe().startswith("alpha in cuBLASLt's epilogue")
        else:
            assert cl.describe() == f"torch.mm to fp32 and an epilogue kernel ({cl.available()[1]})"
    if not HAVE_LT:
        with config.patch(emulated_gemm="cublaslt"):
            assert cl.describe().startswith("not decided: FP4COMPILE_EMULATED_GEMM=cublaslt, but cuBLASLt GEMMs cannot run")


@pytest.mark.gpu
@needs_lt
def test_empty_sum_keeps_a_non_finite_alpha_visible():
    a, b = torch.zeros(4, 0, dtype=torch.bfloat16, device="cuda"), torch.zeros(3, 0, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(cl.mm_alpha(a, b, torch.ones(1, device="cuda")).cpu(), torch.zeros(4, 3, dtype=torch.bfloat16))
    assert cl.mm_alpha(a, b, torch.full((1,), float("inf"), device="cuda")).isnan().all()


def test_plan_cache_is_bounded_least_recently_used_first(monkeypatch):
    """Dynamic shapes make a new GEMM problem per token count: past MAX_PLANS the least recently used
    plan goes, its descriptors destroyed; a refusal (kept so the problem falls back at once) holds none."""
    destroyed, made = [], []

    class Bindings:
        def matrix_layout_destroy(self, layout):
            destroyed.append(layout)

        def matmul_desc_destroy(self, desc):
            destroyed.append(desc)

    def plan(key, handle):
        made.append(key)
        if key == "refused":
            raise cl.Unsupported("refused for the test")
        return {"desc": f"desc{key}", "layouts": (f"b{key}", f"a{key}", f"d{key}")}

    monkeypatch.setattr(cl, "_plan", plan)
    monkeypatch.setattr(cl, "_bindings", Bindings)
    monkeypatch.setattr(cl, "_plans", collections.OrderedDict())
    monkeypatch.setattr(cl, "MAX_PLANS", 2)
    first = cl._cached_plan(0, 1, None)
    cl._cached_plan(0, 2, None)
    assert cl._cached_plan(0, 1, None) is first  # a hit: 1 is now the most recent
    cl._cached_plan(0, 3, None)
    assert list(cl._plans) == [(0, 1), (0, 3)] and destroyed == ["b2", "a2", "d2", "desc2"]
    assert isinstance(cl._cached_plan(1, "refused", None), cl.Unsupported)  # evicts 1
    cl._cached_plan(0, 4, None)  # evicts 3
    cl._cached_plan(0, 5, None)  # evicts the refusal: nothing to destroy
    assert list(cl._plans) == [(0, 4), (0, 5)]
    assert destroyed == [f"{part}{key}" for key in (2, 1, 3) for part in ("b", "a", "d", "desc")]
    assert made == [1, 2, 3, "refused", 4, 5]


@pytest.mark.gpu
@needs_lt
def test_a_problem_cublaslt_refuses_falls_back_or_raises(monkeypatch, caplog):
    """auto: the emulated GEMM falls back to torch.mm plus the epilogue kernel (same bits on exact sums),
    logged once, and the refusal is remembered; cublaslt: the refusal is an error."""
    from fp4compile.codegen import triton_kernels as tk

    calls = []

    def refuse(key, handle):
        calls.append(key)
        raise cl.Unsupported("refused for the test")

    monkeypatch.setattr(cl, "_plan", refuse)
    monkeypatch.setattr(cl, "_plans", collections.OrderedDict())
    a, b = exact_operands(256, 128, 64, seed=9, device="cuda")
    amax_a, amax_b = torch.tensor(3.0e-3, device="cuda"), torch.tensor(7.77e2, device="cuda")
    expect = expected(a.cpu(), b.cpu(), formats.gemm_alpha(amax_a.cpu(), amax_b.cpu()), torch.bfloat16)
    with config.patch(emulated_gemm="auto"), caplog.at_level("WARNING", logger="fp4compile.codegen"):
        for _ in range(2):
            assert torch.equal(tk.cublaslt_scaled_mm(a, amax_a, b, amax_b).cpu(), expect)
    assert len(calls) == 1  # planned once, the refusal kept
    assert sum("refused for the test" in r.getMessage() for r in caplog.records) == 1
    with config.patch(emulated_gemm="cublaslt"):
        with pytest.raises(cl.Unsupported, match="refused for the test"):
            tk.cublaslt_scaled_mm(a, amax_a, b, amax_b)
        with pytest.raises(cl.Unsupported, match="bfloat16 operands"):
            tk.cublaslt_scaled_mm(a, amax_a, b, amax_b, torch.float16)
