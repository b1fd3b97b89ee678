"""Export of a model trained with the backend as an NVFP4 compressed-tensors checkpoint (docs/export.md).

Tiny Hugging Face configs with random weights, trained two steps on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach for the Hub

import pytest
import torch

import fp4compile
from fp4compile import Backend, executors, formats
from models import MODEL_FILE
import importlib

# The module; ``fp4compile.export`` is the function it defines.
fp4export = importlib.import_module("fp4compile.export")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 128
IDX = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def capture_weight_quantization():
    """Records what every quantization of a weight (NVFP4 16x16 tiles) returns while the compiled model
    runs, {data pointer of the quantized tensor: (codes, scales, amax)}, by wrapping the executor table's
    reference quantizer, which runs them on the CPU (a dispatch mode would make dynamo run the model
    eagerly instead)."""
    seen = {}
    original = executors.unregister("quantize", "reference")

    def recording(x, fmt, block, *args):
        out = original.call(x, fmt, block, *args)
        if block == "16x16":
            seen[x.data_ptr()] = tuple(t.clone() for t in out)
        return out

    executors.register("quantize", "reference", original.check, recording, after="triton")
    try:
        yield seen
    finally:
        executors.unregister("quantize", "reference")
        executors.register("quantize", "reference", original.check, original.call, after="triton")


def train(model, steps=2):
    torch.manual_seed(0)
    backend = Backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = compiled(input_ids=IDX, labels=IDX, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return backend, compiled


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    ))


def qwen2():
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ))


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=4, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    ))


def forward_quantization(model, compiled):
    """{site: (codes, scales, amax)} of each FP4 weight as the compiled forward quantizes it now (after
    the last optimizer step: what the next training forward uses)."""
    with capture_weight_quantization() as seen:
        compiled(input_ids=IDX, labels=IDX, use_cache=False)
    params = dict(model.named_parameters())
    return {site: seen[params[site + ".weight"].data_ptr()] for site in _fp4_sites(seen, params)}


def _fp4_sites(seen, params):
    by_ptr = {p.data_ptr(): name for name, p in params.items()}
    return sorted(by_ptr[ptr].removesuffix(".weight") for ptr in seen)


@pytest.mark.parametrize("factory", [llama, qwen2, gpt2], ids=["llama", "qwen2", "gpt2"])
def test_exported_weights_are_the_training_forward_bits(factory):
    model = factory()
    backend, compiled = train(model)
    used = forward_quantization(model, compiled)
    sites = fp4export.export_sites(backend)
    assert sorted(s.name for s in sites) == sorted(used)
    assert len(sites) == (8 if factory is gpt2 else 14)  # the middle two of four blocks
    params = dict(model.named_parameters())
    for site in sites:
        codes, scales, amax = used[site.name]
        q = fp4export.quantized_weight(params[site.parameter], site.transposed)
        tensors = fp4export.site_tensors(q)
        n, k = (params[site.parameter].shape[::-1] if site.transposed else params[site.parameter].shape)
        assert tensors["weight_packed"].dtype == torch.uint8 and tensors["weight_packed"].shape == (n, k // 2)
        assert tensors["weight_scale"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (n, k // 16)
        assert torch.equal(tensors["weight_packed"], codes), site.name
        assert torch.equal(tensors["weight_scale"].view(torch.uint8), scales), site.name
        assert torch.equal(tensors["weight_global_scale"], (torch.tensor(2688.0) / amax).reshape(1)), site.name
        # Low nibble first: element 0 of the row is the low nibble of byte 0.
        assert torch.equal(tensors["weight_packed"][:, 0] & 0xF, q.codes()[:, 0])
    assert any(s.transposed for s in sites) == (factory is gpt2)


@pytest.mark.parametrize("factory", [llama, qwen2], ids=["llama", "qwen2"])
def test_export_folder_holds_the_training_bits_and_loads_in_transformers(factory, tmp_path):
    model = factory()
    backend, compiled = train(model)
    used = forward_quantization(model, compiled)
    out = fp4export.export(model, tmp_path / "ckpt", backend=backend, scheme="NVFP4A16", max_shard_size=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1  # streamed in several shards
    stored = {}
    for f in files:
        stored.update(safetensors_torch.load_file(str(out / f)))
    for site, (codes, scales, amax) in used.items():
        assert torch.equal(stored[site + ".weight_packed"], codes)
        assert torch.equal(stored[site + ".weight_scale"].view(torch.uint8), scales)
        assert torch.equal(stored[site + ".weight_global_scale"], (torch.tensor(2688.0) / amax).reshape(1))
        assert site + ".weight" not in stored and site + ".input_global_scale" not in stored
    assert stored["lm_head.weight" if factory is llama else "model.embed_tokens.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert q["config_groups"]["group_0"]["input_activations"] is None
    assert "lm_head" in q["ignore"] and "model.layers.0.self_attn.q_proj" in q["ignore"]
    assert "model.layers.1.self_attn.q_proj" not in q["ignore"]

    pytest.importorskip("compressed_tensors")
    model.eval()
    with fp4export.served(model, backend, "NVFP4A16") as served:
        expected = served(input_ids=IDX, use_cache=False).logits
        served_q = served.model.layers[1].self_attn.q_proj.weight.clone()
    plain = model(input_ids=IDX, use_cache=False).logits
    # transformers on the CPU: compressed-tensors decompresses the packed weights to dense ones at load.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
    )
    with torch.no_grad():
        got = loaded(input_ids=IDX, use_cache=False).logits
    # Each weight is decoded in bfloat16 by compressed-tensors: one bf16 rounding away from ours.
    w = loaded.model.layers[1].self_attn.q_proj.weight
    torch.testing.assert_close(w, served_q, rtol=2**-8, atol=0)
    scale = expected.abs().max()
    assert (got - expected).abs().max() < 0.01 * scale
    assert (plain - expected).abs().max() > 0.02 * scale  # the served model is not the master-weight model


def test_gpt2_conv1d_export_is_refused_with_the_reason(tmp_path):
    model = gpt2()
    backend, _ = train(model)
    with pytest.raises(NotImplementedError, match=r"transformer\.h\.1\.attn\.c_attn.*Conv1D.*nn\.Linear"):
        fp4export.export(model, tmp_path / "gpt2", backend=backend, scheme="NVFP4A16")
    assert not (tmp_path / "gpt2" / "config.json").exists()


def test_w4a4_config_round_trips_through_compressed_tensors(tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    model = llama()
    backend, _ = train(model)
    amax = fp4compile.calibrate(model, [IDX], backend, forward=lambda m, b: m(input_ids=b, use_cache=False))
    out = fp4compile.export(model, tmp_path / "w4a4", backend=backend, scheme="NVFP4", input_amax=amax)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.format == "nvfp4-pack-quantized" and parsed.quant_method == "compressed-tensors"
    assert parsed.config_groups["group_0"] == preset_name_to_scheme("NVFP4", ["Linear"])
    assert transformers.CompressedTensorsConfig(**config).quantization_config == parsed
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    site = "model.layers.2.mlp.down_proj"
    assert stored[site + ".input_global_scale"].item() == pytest.approx(2688.0 / amax[site].item(), rel=1e-7)
    # The recorded range is max |input| of the layer in the served model (weights as exported).
    seen = []
    with fp4compile.served(model, backend) as m:
        h = m.get_submodule(site).register_forward_pre_hook(lambda mod, a: seen.append(a[0].abs().max()))
        m(input_ids=IDX, use_cache=False)
        h.remove()
    assert amax[site] == seen[0]
    assert ct.__version__  # the parser that read the config is the installed compressed-tensors


def test_w4a4_served_model_quantizes_activations():
    model = llama()
    backend, _ = train(model)
    model.eval()
    amax = fp4compile.calibrate(model, [IDX], backend, forward=lambda m, b: m(input_ids=b, use_cache=False))
    site = "model.layers.1.mlp.down_proj"
    master = model.get_submodule(site).weight.detach().clone()
    module = model.get_submodule(site)
    seen = []
    raw = module.register_forward_pre_hook(lambda m, a: seen.append(a[0]))  # before served's quantizer
    with fp4compile.served(model, backend, "NVFP4", amax):
        after = module.register_forward_pre_hook(lambda m, a: seen.append(a[0]))  # after it
        model(input_ids=IDX, use_cache=False)
        after.remove()
    raw.remove()
    x, quantized = seen
    expected = formats.dequantize(formats.quantize(x, "nvfp4", "1x16", amax=amax[site]), x.dtype)
    assert torch.equal(quantized, expected)
    assert not torch.equal(quantized, x)
    assert torch.equal(model.get_submodule(site).weight, master)  # the master weights are back after the block


def test_export_errors_name_what_is_wrong(tmp_path):
    model = llama()
    with pytest.raises(TypeError, match="Backend the model was trained with"):
        fp4export.export(model, tmp_path / "a", backend=None)
    backend = Backend(inner="eager")
    with pytest.raises(ValueError, match="compiled no GEMM site"):
        fp4export.export(model, tmp_path / "a", backend=backend)
    backend, _ = train(model, steps=1)
    with pytest.raises(ValueError, match="scheme must be one of"):
        fp4export.export(model, tmp_path / "a", backend=backend, scheme="W4A4")
    with pytest.raises(ValueError, match=r"must be finite and >= 0.*model\.layers\.1\.mlp\.up_proj"):
        fp4export.export(model, tmp_path / "a", backend=backend, scheme="NVFP4",
                         input_amax={"model.layers.1.mlp.up_proj": float("nan")})
    backend.ranges.load_state_dict({})  # as a backend that recorded nothing (test_ranges.py: remedies)
    with pytest.raises(ValueError, match=r"no range was recorded or given for model\.layers\.1\.self_attn\.q_proj"):
        fp4export.export(model, tmp_path / "a", backend=backend, scheme="NVFP4", input_amax={})


def test_mxfp4_export_is_refused():
    model = llama()
    backend = Backend(inner="eager", fmt="mxfp4")
    torch.compile(model, backend=backend)(input_ids=IDX, labels=IDX, use_cache=False).loss.backward()
    with pytest.raises(NotImplementedError, match="MXFP4"):
        fp4export.export_sites(backend)


def test_cli_exports_a_saved_checkpoint(tmp_path, capsys):
    from fp4compile import cli

    (tmp_path / "net.py").write_text(MODEL_FILE)
    model = cli.load_factory(f"{tmp_path / 'net.py'}:Net")
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    out = tmp_path / "out"
    assert cli.main(["export", f"{tmp_path / 'net.py'}:Net", str(tmp_path / "ckpt.pt"), str(out),
                     "--input-shape", "4x16x32"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "quantization_config.json").read_text())
    assert config["ignore"] == ["blocks.0.down", "blocks.0.up", "blocks.3.down", "blocks.3.up", "head"]
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    q = fp4export.quantized_weight(model.blocks[1].up.weight)
    assert torch.equal(stored["blocks.1.up.weight_packed"], q.data.view(torch.uint8))
    assert torch.equal(stored["blocks.1.up.bias"], model.blocks[1].up.bias.to(torch.bfloat16))
    assert stored["head.weight"].dtype == torch.bfloat16
    assert cli.main(["export", f"{tmp_path / 'net.py'}:Net", str(tmp_path / "missing.pt"), str(out),
                     "--input-shape", "4x16x32"]) == 2
    assert "missing.pt' not found" in capsys.readouterr().err
