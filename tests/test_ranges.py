"""Activation ranges recorded while training (fp4compile.ranges) and the W4A4 export that uses them.

The expected ranges are measured independently of the recording: forward pre-hooks on the layers (which
dynamo traces into the compiled graph) keep max |input| of every call, the value each layer's fprop
quantizer takes as its global amax (float32 inputs, no autocast).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach for the Hub

import pytest
import torch
import torch.nn.functional as F

import fp4compile
from fp4compile import Backend, formats
from models import MODEL_FILE, TinyGPT, lm_loss

sys.path.insert(0, os.path.dirname(__file__))
from test_model_styles import VOCAB as STYLE_VOCAB, compiled  # noqa: E402

# The module; ``fp4compile.export`` is the function it defines.
fp4export = importlib.import_module("fp4compile.export")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

IDX = [torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(s)) for s in range(6)]


def record_inputs(model) -> dict[str, list]:
    """{linear's name: [max |input| of each call]}, filled as the (compiled) model runs."""
    seen: dict[str, list] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            seen[name] = []
            module.register_forward_pre_hook(lambda m, args, out=seen[name]: out.append(args[0].detach().abs().amax()))
    return seen


def train(model, backend, steps, first_step_scale=None):
    """``steps`` SGD steps of ``model`` compiled by ``backend``; with ``first_step_scale`` the first step's
    LayerNorm weights are scaled by it (a first step whose qkv and fc inputs are larger than later ones)."""
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = [m.weight for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    for step in range(steps):
        scale = first_step_scale if step == 0 and first_step_scale else None
        if scale:
            with torch.no_grad():
                torch._foreach_mul_(norms, scale)
        lm_loss(compiled(IDX[step % len(IDX)]), IDX[step % len(IDX)]).backward()
        if scale:
            with torch.no_grad():
                torch._foreach_div_(norms, scale)
        opt.step()
        opt.zero_grad()
    return compiled


def fp4_layers(backend) -> list[str]:
    return [s.name for s in fp4export.export_sites(backend)]


def test_training_records_the_window_of_each_fp4_layers_input_amax():
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    seen = record_inputs(model)
    backend = Backend(inner="eager", amax_history=3)
    train(model, backend, steps=5, first_step_scale=8.0)
    layers = fp4_layers(backend)
    assert len(layers) == 8  # the FP4 linears of the middle two blocks
    histories = backend.ranges.state_dict()
    assert sorted(histories) == sorted(layers)
    recorded = backend.ranges.amax()
    for name in layers:
        assert len(seen[name]) == 5
        # The newest three amaxes, oldest first: the history is the window itself.
        assert torch.equal(histories[name], torch.stack(seen[name][-3:])), name
        assert torch.equal(recorded[name], torch.stack(seen[name][-3:]).max()), name
    # The larger first step has left the window: the range is not the maximum over all steps.
    assert all(torch.stack(seen[n]).max() > recorded[n] for n in layers if n.endswith(("attn.qkv", "mlp.fc")))
    # Layers that run in high precision, and graphs run without gradients, record nothing.
    before = backend.ranges.state_dict()
    with torch.no_grad():
        torch.compile(model, backend=backend)(IDX[0])
    assert all(torch.equal(before[k], v) for k, v in backend.ranges.state_dict().items())
    assert "blocks.0.attn.qkv" not in recorded and "lm_head" not in recorded


def test_amax_history_zero_records_nothing_and_w4a4_export_names_the_remedies(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    backend = Backend(inner="eager", amax_history=0)
    train(model, backend, steps=1)
    assert len(backend.ranges) == 0
    with pytest.raises(ValueError, match=r"no range was recorded or given for blocks\.1\.attn\.qkv.*"
                                         r"Recipe\.amax_history > 0.*input_amax=fp4compile\.calibrate"):
        fp4compile.export(model, tmp_path / "out", backend=backend, scheme="NVFP4")
    # calibrate's ranges serve where none were recorded.
    amax = fp4compile.calibrate(model, IDX[:2], backend=backend)
    out = fp4compile.export(model, tmp_path / "out", backend=backend, scheme="NVFP4", input_amax=amax)
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("style", ["checkpoint", "selective_checkpoint", "per_block", "graph_break"])
def test_every_model_style_records_what_module_calls_record(style):
    """Checkpointed regions (recomputed in the backward: recorded once per step), blocks compiled one by
    one and blocks split by a graph break record the same histories as plain module calls (which compute
    the same bits, test_model_styles.py)."""

    def histories(style):
        fp4compile.manual_seed(0)
        torch._dynamo.reset()
        _, call, backend = compiled(style)
        for step in range(3):
            idx = torch.randint(0, STYLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))
            F.cross_entropy(call(idx).flatten(0, 1), idx.flatten()).backward()
        return backend.ranges.state_dict()

    got, expected = histories(style), histories("modules")
    assert len(expected) == 12 and got.keys() == expected.keys()
    for name in expected:
        assert torch.isfinite(expected[name]).sum() == 3, name  # one amax per step
        assert torch.equal(got[name], expected[name]), name


def test_a_layer_called_twice_records_both_calls_and_exports_their_maximum():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = b(torch.relu(b(x)))  # each block's weight in two GEMMs: sites name and name#2
            return x

    torch.manual_seed(0)
    model = Twice()
    seen = record_inputs(model)
    backend = Backend(inner="eager", amax_history=4)
    x = torch.randn(4, 16, 32)
    torch.compile(model, backend=backend)(x).square().mean().backward()
    histories = backend.ranges.state_dict()
    assert sorted(histories) == ["blocks.1", "blocks.1#2", "blocks.2", "blocks.2#2"]
    assert histories["blocks.1"][-1] == seen["blocks.1"][0] and histories["blocks.1#2"][-1] == seen["blocks.1"][1]
    assert backend.ranges.amax()["blocks.1"] == max(seen["blocks.1"])


@pytest.mark.slow
def test_the_ranges_travel_with_the_backend_state_and_the_window_goes_on():
    torch.manual_seed(0)
    model = TinyGPT(n_layer=4)
    seen = record_inputs(model)
    backend = Backend(inner="eager", amax_history=3)
    train(model, backend, steps=2)
    state = backend.state_dict()
    # A new process: a new backend loads the state before compiling, then trains one step more.
    resumed = Backend(inner="eager", amax_history=3)
    resumed.load_state_dict(state)
    torch._dynamo.reset()
    train(model, resumed, steps=1)
    for name, history in resumed.ranges.state_dict().items():
        assert torch.equal(history, torch.stack(seen[name][-3:])), name
    # Loading into a backend whose graphs record writes their histories in place.
    recording = resumed.ranges.history("blocks.1.mlp.fc", torch.device("cpu"), 3)
    resumed.load_state_dict(state)
    assert torch.equal(recording[1:], torch.stack(seen["blocks.1.mlp.fc"][:2])) and recording[0] == -math.inf


@pytest.mark.slow
def test_recording_survives_inductor():
    """The default inner compiler: the record op becomes ATen ops in the graph Inductor compiles (a shift and
    a copy into the history, no op call), which Inductor's dead-code elimination keeps and which run on
    every step."""
    torch.manual_seed(0)
    model = TinyGPT(n_layer=3)
    seen = record_inputs(model)
    backend = Backend(amax_history=2)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        train(model, backend, steps=3)
    recorded = 0
    for ctx in backend.report.contexts:  # each compiled forward handed to Inductor: one record per FP4 linear
        graph = ctx.final_graphs["forward"]
        assert not graph.find_nodes(op="call_function", target=torch.ops.fp4.record_amax.default)
        records = [n for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
                   if n.args[0].op == "placeholder"]
        assert len(records) == sum(s.precision == "nvfp4" for s in ctx.sites)
        recorded += len(records)
    assert recorded >= 4
    histories = backend.ranges.state_dict()
    assert len(histories) == 4
    for name, history in histories.items():
        assert torch.equal(history, torch.stack(seen[name][-2:])), name


@pytest.mark.gpu
def test_recording_under_cuda_graphs_runs_on_every_replay():
    """mode="reduce-overhead": the steps replay recorded CUDA graphs, and each replay records its own
    amaxes into the same histories, as the run without CUDA graphs does."""
    from torch._dynamo.utils import counters

    from models import GPTWithLoss

    idx = torch.randint(0, 512, (5, 4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def run(mode):
        torch._dynamo.reset()
        counters.clear()
        fp4compile.manual_seed(7)
        torch.manual_seed(0)
        model = GPTWithLoss().cuda()
        backend = Backend(mode=mode, amax_history=3, high_precision_first_blocks=0, high_precision_last_blocks=0)
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(5):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = compiled(idx[step])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps.append(backend.ranges.state_dict())
        return steps, dict(counters["inductor"])

    graphs, counts = run("reduce-overhead")
    # Recorded in CUDA graphs (none skipped); that every replay records into the histories, as the run
    # without CUDA graphs does, is checked below.
    assert counts.get("cudagraph_skips", 0) == 0
    plain, _ = run(None)
    assert len(graphs[-1]) == 8  # both blocks' four FP4 linears
    for step in range(1, 5):
        for name, history in graphs[step].items():
            # One new amax per step, the older ones shifted by one, each equal to the run without CUDA graphs
            # (whose every step records): recorded on every replay. Two steps may share an amax (a bf16 value).
            assert torch.equal(history[:-1], graphs[step - 1][name][1:]), (step, name)
            assert torch.isfinite(history[-1]), (step, name)
            assert torch.equal(history, plain[step][name]), (step, name)


# ---------------------------------------------------------------------------------------------
# W4A4 export from the recorded ranges
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_w4a4_export_writes_the_recorded_ranges_and_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    pytest.importorskip("compressed_tensors")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    ))
    seen = record_inputs(model)
    backend = Backend(inner="eager", amax_history=2)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(3):
        compiled(input_ids=IDX[step], labels=IDX[step], use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    out = fp4compile.export(model, tmp_path / "w4a4", backend=backend, scheme="NVFP4")
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    sites = [k.removesuffix(".input_global_scale") for k in stored if k.endswith(".input_global_scale")]
    assert len(sites) == 14  # the middle two of four blocks: q, k, v, o, gate, up, down
    for site in sites:
        amax = torch.stack(seen[site][-2:]).max()
        assert torch.equal(stored[site + ".input_global_scale"], formats.global_encode_scale(amax).reshape(1)), site
        assert stored[site + ".input_global_scale"].item() == pytest.approx(448 * 6 / amax.item(), rel=1e-7)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"

    # transformers with compressed-tensors builds the W4A4 model from the folder and runs it.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    layer = loaded.model.layers[1].self_attn.q_proj
    assert torch.equal(layer.input_global_scale.float(), stored["model.layers.1.self_attn.q_proj.input_global_scale"])
    model.eval()
    with torch.no_grad():
        got = loaded(input_ids=IDX[0], use_cache=False).logits.float()
        with fp4compile.served(model, backend, "NVFP4") as served:
            expected = served(input_ids=IDX[0], use_cache=False).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_cli_exports_w4a4_with_the_ranges_a_checkpoint_holds(tmp_path, capsys):
    from fp4compile import cli

    safetensors_torch = pytest.importorskip("safetensors.torch")
    (tmp_path / "net.py").write_text(MODEL_FILE)
    model = cli.load_factory(f"{tmp_path / 'net.py'}:Net")
    backend = Backend(inner="eager")
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0)) * 3
    torch.compile(model, backend=backend)(x).square().mean().backward()
    torch.save({"model": model.state_dict(), "backend": backend.state_dict()}, tmp_path / "ckpt.pt")
    out = tmp_path / "out"
    command = ["export", f"{tmp_path / 'net.py'}:Net", str(tmp_path / "ckpt.pt"), str(out), "--input-shape", "4x16x32",
               "--scheme", "NVFP4"]
    assert cli.main(command) == 0
    assert "(NVFP4)" in capsys.readouterr().out
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    recorded = backend.ranges.amax()
    assert sorted(k for k in stored if k.endswith("input_global_scale")) == sorted(f"{k}.input_global_scale" for k in recorded)
    for site, amax in recorded.items():  # training's ranges, not those of the CLI's random planning inputs
        assert torch.equal(stored[site + ".input_global_scale"], formats.global_encode_scale(amax).reshape(1))
    torch.save({"model": model.state_dict()}, tmp_path / "weights.pt")
    command[2] = str(tmp_path / "weights.pt")
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert "no range was recorded or given for blocks.1.up" in err and "holds no activation ranges" in err
