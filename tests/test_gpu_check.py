"""``make gpu-check``'s plan, checked without a GPU: ``--dry-run`` lists every notebook, every exercise's starter
and solution, every test file with a CUDA-only test and the GPU benchmarks, and fails when one is missing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def test_the_dry_run_lists_every_notebook_exercise_cuda_test_and_benchmark(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{nb.name}" in out
    for starter in sorted((ROOT / "exercises").glob("ex*.ipynb")):
        assert f"exercises/solutions/{starter.name}" in out  # the solution under nbval
    assert "tests/test_exercises.py" in out  # which runs every starter: each check must fail
    for name in ("test_kernels", "test_engine_triton", "test_cuda_graphs", "test_engine_memory"):
        assert f"tests/{name}.py" in out
    assert "bench_engine.py --device cuda" in out and "bench_paged_attention.py" in out
    # Every step in one of the lease calls, each call 10 minutes with time to start; the dry run prints them
    assert sorted(s for call in gpu_check.CALLS for s in call) == sorted(gpu_check.STEPS)
    assert all(sum(gpu_check.BUDGET_S[s] for s in call) <= 8 * 60 + 10 for call in gpu_check.CALLS)
    assert "lease call 2: --steps exercises,notebooks" in out


def test_a_cuda_test_file_left_out_of_the_plan_fails_the_dry_run(monkeypatch, capsys):
    found = gpu_check.cuda_tests_in_tree()
    assert "tests/test_engine_memory.py" in found and "tests/test_block_pool.py" not in found
    monkeypatch.setattr(gpu_check, "cuda_tests_in_tree", lambda: [*found, "tests/test_new_gpu_thing.py"])
    assert gpu_check.main(["--dry-run"]) == 1
    assert "not in the plan: tests/test_new_gpu_thing.py" in capsys.readouterr().err


def test_a_starter_without_a_solution_fails_the_dry_run(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "starters", lambda: ["exercises/ex99_new.ipynb"])
    assert gpu_check.main(["--dry-run"]) == 1
    assert "exercises/ex99_new.ipynb (no solution)" in capsys.readouterr().err


def test_without_cuda_it_says_so_and_fails(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--steps", "kernels"]) == 1
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--steps", "nonsense"])


def test_setup_with_the_systems_torch_installs_everything_else_as_pinned():
    import deps  # tools/deps.py, what `make setup TORCH=system` installs

    every = deps.requirements(["dev"], set())
    kept = deps.requirements(["dev"], {"torch", "triton"})
    assert {r for r in every if r.startswith(("torch==", "triton=="))} == set(every) - set(kept)
    assert "transformers==5.23.0" in kept and any(r.startswith("nbval") for r in kept)
    makefile = (ROOT / "Makefile").read_text()
    assert "--system-site-packages" in makefile and "tools/deps.py --extra dev --except torch,triton" in makefile


def test_one_result_file_per_gpu_and_the_gpu_page_lists_each():
    assert gpu_check.result_path("Tesla T4").name == "gpu_check_tesla-t4.json"
    page = (ROOT / "site" / "guide" / "gpu.md").read_text()  # "On a GPU", linked from the README
    assert "site/guide/gpu.md" in (ROOT / "README.md").read_text()
    recorded = gpu_check.recorded()
    assert "NVIDIA H100 80GB HBM3" in recorded
    for device in recorded:
        assert gpu_check.result_path(device).name in page, f"the GPU page's table does not name {device}'s result file"
    table = page[page.index("Which GPUs have a recorded") :].split("\n\n")[1]
    for gpu in ("T4", "A100", "H100", "H200"):
        row = next(line for line in table.splitlines() if gpu in line.split("|")[1])
        named = any(gpu_check.result_path(d).name in row for d in recorded if gpu in d)
        assert named or "none" in row, f"the row of the {gpu} neither names a result file nor says there is none"


@pytest.mark.parametrize("cfg", ["tests/nbval_sanitize.cfg", gpu_check.ANY_OUTPUT])
def test_every_sanitizer_entry_is_one_nbval_reads(cfg):
    """nbval reads ``regex: ...`` then ``replace: ...`` with a space after the colon; an entry written otherwise is
    dropped without a word (the GPU pool line's was, until an H200 run printed it)."""
    from nbval.plugin import get_sanitize_patterns

    text = (ROOT / cfg).read_text()
    assert len(get_sanitize_patterns(text)) == len(re.findall(r"^\[[^\]]+\]$", text, flags=re.MULTILINE)) > 0


def _sanitized(cfg: str, text: str) -> str:
    from nbval.plugin import get_sanitize_patterns

    for regex, replace in get_sanitize_patterns((ROOT / cfg).read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_a_gpu_engines_pool_line_is_dropped_and_random_weights_blank_a_chapters_output():
    gpu = (
        "minipaged: KV pool: 365,749 blocks of 16 tokens (0.9 of the card)\n"
        "minipaged: compiled the kernels of 5 kinds of step and captured 48 CUDA graphs in 3.1 s\n"
        "same tokens: True 7.7e-07\n"
    )
    assert _sanitized("tests/nbval_sanitize.cfg", gpu) == "same tokens: True <rounding-error>\n"
    assert _sanitized(gpu_check.ANY_OUTPUT, gpu) == ""
    assert gpu_check.ANY_OUTPUT in " ".join(gpu_check.plan("python", random_weights=True)["notebooks"][0][0])
    assert gpu_check.ANY_OUTPUT not in " ".join(gpu_check.plan("python")["notebooks"][0][0])
    assert all(
        gpu_check.ANY_OUTPUT not in " ".join(argv)
        for argv, _ in gpu_check.plan("python", random_weights=True)["exercises"]
    )


def test_the_pack_leaves_out_what_a_cuda_image_brings():
    """Named as pip saves them: torch's CUDA wheels (3 GB) would not fit a 64 MiB call; Jupyter's would be missing."""
    kept, dropped = [], []
    for wheel in ("torch-2.14.1-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_cublas-13.1.1.3-py3-none.whl",
                  "triton-3.8.0-cp312.whl", "pytest_xdist-3.8.0-py3-none-any.whl", "nbval-0.11.0-py2.py3-none-any.whl",
                  "plotly-7.1.0-py3-none-any.whl", "ipykernel-7.4.0-py3-none-any.whl", "torchvision-0.29.whl"):  # fmt: skip
        (dropped if gpu_check.IMAGE_BRINGS.fullmatch(wheel.split("-")[0]) else kept).append(wheel.split("-")[0])
    assert dropped == ["torch", "nvidia_cublas", "triton", "pytest_xdist"]
    assert kept == ["nbval", "plotly", "ipykernel", "torchvision"]
