"""``make gpu-check``: everything that needs a real NVIDIA GPU, in one command (two calls on a 10-minute lease).

On a machine with CUDA it runs these steps, in order, each bounded in time, and goes on past a failure (one
failing step must not hide the others on a short lease); it exits 1 if any failed:

=========== ======================================================================================================
setup       chapter 00's set-up on this GPU: what it would install (``--dry-run``), the device, dtype and pool it reports
kernels     ``tests/test_kernels.py`` compiled on the GPU: every kernel against the PyTorch reference, bf16 too
tests       the CUDA tests: the engine's equality tests on the Triton backend (``test_engine_triton.py``, and
            ``test_engine.py`` with ``MINIPAGED_TEST_BACKEND=triton``), CUDA graphs, memory given back
            (``test_engine_memory.py``), events and the monitor on a GPU pool, the kernel exercises' graders
exercises   every exercise under nbval on CUDA: each solution must pass; each starter must fail every check
            (``tests/test_exercises.py``, which proves both, run on the GPU)
notebooks   every chapter under nbval on CUDA, top to bottom
report      the compile report for this GPU's architecture (registers, spills, occupancy)
bandwidth   ``benchmarks/bench_paged_attention.py`` (decode bandwidth against peak, paged vs contiguous)
bench       ``benchmarks/bench_engine.py --device cuda`` (the engine against transformers' static batching)
=========== ======================================================================================================

Results (JSON, the logs, the device name and date) go to ``assets/benchmarks/gpu/``: commit them.

Where the model cannot travel (a GPU lease sends at most 64 MiB; the converted weights are 540 MB), pass
``--random-weights DIR``: DIR holds the model's small files (``config.json``, the tokenizer, the chat template;
``--pack`` copies them), and this builds SmolLM2-shaped random weights on the GPU's machine and points the engine
at them. The work and the shapes are the real model's; the tokens are not, so a test or a notebook cell that
checks the real model's text ("Paris") fails by design there, and the results say ``random_weights: true``.
``--wheelhouse DIR`` installs what the machine lacks (nbval, Jupyter's kernel, plotly, ...) from wheels carried
there, never torch, Triton or transformers: the machine's own are what is tested. ``--pack DIR`` (on any machine)
fills DIR with both.

``--dry-run`` (no GPU needed) lists every test file, notebook, exercise and benchmark the run would take, and
exits 1 if a notebook, an exercise or a CUDA test of the tree is missing from the plan: ``make test`` runs it.
``--steps`` takes some of the steps; each step's outcome and time land in ``gpu_check_<the GPU>.json`` (one file
per GPU: ``recorded()`` reads them, ``site/guide/gpu.md`` lists them), merged with an earlier run's steps on the same
device, so a lease whose calls last 10 minutes takes them in the two calls of ``CALLS`` (``--dry-run`` prints them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "assets" / "benchmarks" / "gpu"
# The suite's addopts without nbval's flags (test files are not notebooks), and nbval's for notebooks.
# -rf --tb=short: every failure named with its cause in the log, also when a step is stopped at its time (run_step).
PYTEST = ["-m", "pytest", "-q", "-rf", "--tb=short", "-o", "addopts=-p no:cacheprovider"]
NBVAL = ["-m", "pytest", "-q", "-rf", "--tb=short", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
         "--nbval-sanitize-with", "tests/nbval_sanitize.cfg", "-o", "addopts="]  # fmt: skip
# Test files with CUDA-only tests (a `needs_cuda`/`torch.cuda.is_available()` skip): each must be in a step.
CUDA_TESTS = [
    "tests/test_engine_triton.py",
    "tests/test_engine.py",
    "tests/test_cuda_graphs.py",
    "tests/test_engine_memory.py",
    "tests/test_viz_monitor.py",
    "tests/test_events.py",
    "tests/test_puzzles.py",
    "tests/test_grading.py",
    "tests/test_engine_faults.py",
    "tests/test_private_api_fallbacks.py",
]
BENCHMARKS = ["benchmarks/bench_paged_attention.py", "benchmarks/bench_engine.py"]
# The engine benchmark, sized for a lease: 64 mixed-length requests, one round, against itself without graphs.
BENCH_ARGS = "--device cuda --rounds 1 --no-vllm --levers cuda_graphs --num-requests 64".split()
BENCH_ARGS += ["--static-batch-sizes", "16", "64"]
# Seconds per step, and the steps that share one lease call (10 minutes, less the machine's start). Measured on an
# H200 (16 cores, 2026-11-30): the exercises' starters and graders 87 s on 4 workers; the solutions and chapters
# under nbval did not finish in 180 s on 4 workers, 93 % of both in 230 s on 12.
BUDGET_S = {"setup": 10, "kernels": 60, "tests": 110, "exercises": 200, "notebooks": 180, "report": 20, "bandwidth": 30,
            "bench": 50}  # fmt: skip
CALLS = (("setup", "kernels", "tests", "report", "bandwidth", "bench"), ("exercises", "notebooks"))
WORKERS = 8  # notebooks at once: each holds a kernel process and a small engine on the GPU
# A sanitizer that blanks every output: cells must run, their text is not compared (the later flag wins in pytest).
ANY_OUTPUT = "tools/nbval_any_output.cfg"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")  # fmt: skip

# What a CUDA machine's image may lack, for the notebooks and exercises (torch, triton, transformers: its own).
WHEELS = ["nbval", "nbclient", "nbformat", "ipykernel", "ipywidgets", "plotly", "anywidget", "pytest",
          "pytest-xdist", "hypothesis", "gguf", "safetensors", "accelerate", "fastapi", "uvicorn", "openai",
          "matplotlib"]  # fmt: skip
# What a CUDA PyTorch image brings (torch's own needs, the scientific stack, pytest, Hugging Face's libraries): their
# wheels would not fit a lease call (torch's CUDA wheels alone are about 3 GB) and must not replace the image's own.
# pip downloads them as needs of WHEELS; ``pack`` leaves them out, and pip there keeps the versions it finds.
IMAGE_BRINGS = re.compile(
    r"(torch|triton|nvidia[-_].*|cuda[-_].*|numpy|sympy|mpmath|networkx|filelock|fsspec|jinja2|markupsafe|"
    r"typing[-_]extensions|setuptools|packaging|matplotlib|pillow|fonttools|contourpy|kiwisolver|cycler|pyparsing|"
    r"python[-_]dateutil|six|pygments|pyyaml|psutil|tqdm|requests|urllib3|idna|certifi|charset[-_]normalizer|"
    r"huggingface[-_]hub|hf[-_]xet|safetensors|accelerate|tokenizers|transformers|pytest|pytest[-_]xdist|pluggy|"
    r"iniconfig|execnet|coverage|hypothesis|sortedcontainers|attrs|anyio|h11|click|narwhals)",
    re.IGNORECASE,
)


def installed() -> bool:
    """True when minipaged is an installed distribution (``make setup``, or chapter 00's ``pip install -e``)."""
    from importlib import metadata

    try:
        metadata.distribution("minipaged")
    except metadata.PackageNotFoundError:
        return False
    return True


def result_path(device: str) -> Path:
    """One result file per GPU, named by it: ``gpu_check_nvidia-h100-80gb-hbm3.json``."""
    return OUT / f"gpu_check_{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.json"


def recorded() -> dict[str, dict]:
    """Each GPU with a committed result file: its device name → the file's contents."""
    return {
        json.loads(p.read_text())["device"]: json.loads(p.read_text()) for p in sorted(OUT.glob("gpu_check_*.json"))
    }


def notebooks() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "notebooks").glob("*.ipynb"))


def solutions() -> list[str]:
    """Every exercise's solution (nbval runs them: each must pass)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "exercises" / "solutions").glob("ex*.ipynb"))


def starters() -> list[str]:
    """Every exercise's starter (tests/test_exercises.py runs each: every check must fail)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "exercises").glob("ex*.ipynb"))


def cuda_tests_in_tree() -> list[str]:
    """Test files that hold a test run only where CUDA is (found by reading them, so a new one cannot hide)."""
    pattern = re.compile(r"needs_cuda\b|skipif\(\s*not torch\.cuda\.is_available\(\)")
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if pattern.search(p.read_text()))


def bench_dtype(arch: str) -> str:
    """The dtype the engine picks on that GPU: float16 below compute capability 8.0 (a T4 has no bfloat16 units)."""
    return "float16" if int(arch.removeprefix("sm_")) < 80 else "bfloat16"


def plan(
    py: str, arch: str = "sm_90", random_weights: bool = False
) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """Each step's commands (argv, extra environment), in order. With random weights the chapters' checked outputs
    (the real model's answers, its hidden-state sizes, the lengths its answers take) cannot hold: there every cell
    must run without an error and its output is not compared (``ANY_OUTPUT``). The exercises' checks compare the
    learner's code with the package's on the same weights, so they are compared either way."""
    chapters = ["--nbval-sanitize-with", ANY_OUTPUT] if random_weights else []
    triton = {"MINIPAGED_TEST_BACKEND": "triton"}
    return {
        # What chapter 00's set-up cell reports on this GPU (device, compute capability, dtype, pool), and what it
        # would install beside the machine's own torch and Triton.
        "setup": [
            ([py, "tools/setup_course.py", "--dry-run"], {}),
            ([py, "-c", "from minipaged.config import device_summary; print(device_summary())"], {}),
        ],
        "kernels": [([py, *PYTEST, "tests/test_kernels.py"], {})],
        "tests": [
            ([py, *PYTEST, "tests/test_engine_triton.py", "tests/test_engine.py"], triton),
            (
                [
                    py,
                    *PYTEST,
                    *[t for t in CUDA_TESTS if t not in ("tests/test_engine_triton.py", "tests/test_engine.py")],
                ],
                {},
            ),
        ],
        "exercises": [
            ([py, *PYTEST, "-n", str(WORKERS), "--dist", "loadfile", "tests/test_exercises.py"], {}),
            ([py, *NBVAL, "-n", str(WORKERS), "--dist", "loadfile", *solutions()], {}),
        ],
        "notebooks": [([py, *NBVAL, *chapters, "-n", str(WORKERS), "--dist", "loadfile", *notebooks()], {})],
        "report": [([py, "-m", "minipaged", "kernels", "--arch", arch, "--json"], {})],
        "bandwidth": [([py, BENCHMARKS[0], "--out-dir", str(OUT)], {})],
        "bench": [([py, BENCHMARKS[1], *BENCH_ARGS, "--dtype", bench_dtype(arch), "--out", str(OUT)], {})],
    }


STEPS = tuple(plan("python"))


def dry_run(py: str) -> int:
    """Print the plan; 1 if something of the tree is not in it (a notebook, an exercise, a CUDA test)."""
    steps = plan(py)
    listed = " ".join(" ".join(argv) for cmds in steps.values() for argv, _ in cmds)
    for name, cmds in steps.items():
        print(f"{name} (at most {BUDGET_S[name]} s):")
        for argv, env in cmds:
            print("   ", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(argv).replace(py, "python"))
    words = set(listed.split())
    missing = [f for f in notebooks() + solutions() + cuda_tests_in_tree() + BENCHMARKS if f not in words]
    missing += [
        f"{s} (no solution)" for s in starters() if s.replace("exercises/", "exercises/solutions/") not in words
    ]
    print(f"\n{len(notebooks())} notebooks; {len(starters())} exercises, starters and solutions; "
          f"{len(set(CUDA_TESTS) | {'tests/test_kernels.py'})} test files; {len(BENCHMARKS)} benchmarks; "
          f"budget {sum(BUDGET_S.values())} s")  # fmt: skip
    for i, call in enumerate(CALLS, 1):
        print(f"lease call {i}: --steps {','.join(call)} (at most {sum(BUDGET_S[s] for s in call)} s)")
    if missing:
        print("not in the plan: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


def pack(dest: Path) -> int:
    """Fill ``dest`` with what a GPU lease call carries: the model's small files and the wheels it may lack."""
    sys.path.insert(0, str(REPO))
    from minipaged.model_loader import ensure_converted

    model = ensure_converted(progress=True)
    (dest / "smollm2").mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (model / name).is_file():
            shutil.copy(model / name, dest / "smollm2" / name)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(dest / "wheels"),
           "--python-version", "3.12", *WHEELS]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    dropped = [w for w in (dest / "wheels").glob("*.whl") if IMAGE_BRINGS.fullmatch(w.name.split("-")[0])]
    for w in dropped:
        w.unlink()
    print(f"left out {len(dropped)} wheels a CUDA PyTorch image brings (torch, Triton, numpy, Hugging Face, pytest...)")
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"{dest}: {size / 2**20:.1f} MiB (a lease call carries at most 64 MiB with the checkout)")
    return rc


def random_weights(src: Path, dst: Path) -> Path:
    """A SmolLM2-shaped model folder with random weights (seeded), built here: the shapes and the work are the
    real model's, the tokens are not."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from minipaged.model_loader import RANDOM_SOURCE, write_manifest

    folder = dst / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, folder / f.name)
    torch.manual_seed(7948)
    LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).float().save_pretrained(folder, safe_serialization=True)
    write_manifest(folder, source=f"{RANDOM_SOURCE} SmolLM2-shaped weights (tools/gpu_check.py, seed 7948)")
    return folder


def run_step(name: str, cmds: list[tuple[list[str], dict[str, str]]], log: Path, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    record: dict = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), passed=True)
    with log.open("w") as f:
        for argv, extra in cmds:
            print(f"\n=== {name}\n$ {' '.join(argv)}", flush=True)
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=REPO, env={**env, **extra}, stdout=f, stderr=subprocess.STDOUT)
            try:
                ok = proc.wait(timeout=BUDGET_S[name] * 2) == 0
            except subprocess.TimeoutExpired:
                # Ctrl-C first: pytest then prints the failures it has seen so far (the first H200 run lost them).
                ok = False
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                f.write(f"\ntimed out after {BUDGET_S[name] * 2} s\n")
            record["passed"] &= ok
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    record.update(seconds=round(time.perf_counter() - start, 1), summary=tail[0][:300], log=str(log.relative_to(REPO)))
    print(f"{name}: {'passed' if record['passed'] else 'FAILED'} in {record['seconds']} s — {record['summary']}")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {', '.join(STEPS)}")
    ap.add_argument("--dry-run", action="store_true", help="list what would run (no GPU needed); 1 if incomplete")
    ap.add_argument("--random-weights", type=Path, metavar="DIR", help="build random SmolLM2-shaped weights")
    ap.add_argument("--wheelhouse", type=Path, metavar="DIR", help="install missing packages from these wheels")
    ap.add_argument("--pack", type=Path, metavar="DIR", help="fill DIR with the model's small files and wheels")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown or not steps:
        ap.error(f"--steps: unknown {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    py = sys.executable
    if args.dry_run:
        return dry_run(py)
    if args.pack:
        return pack(args.pack)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu-check needs an NVIDIA GPU with CUDA, and this machine has none "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). Run it where a GPU is, with a "
            "CUDA build of torch; here, `python tools/gpu_check.py --dry-run` lists what it would run, and "
            "`python -m minipaged kernels` compiles the kernels for sm_75/sm_80/sm_90 without a GPU.",
            file=sys.stderr,
        )
        return 1
    import triton

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.wheelhouse:
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(args.wheelhouse),
                        *WHEELS], check=False)  # fmt: skip
    if not installed():  # its entry points (the graders' nbval plugin) exist only for an installed distribution
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "-e",
                        str(REPO)], check=False)  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "logs").mkdir(exist_ok=True)
    if args.random_weights:
        cache = REPO / ".gpu-cache"
        print("random SmolLM2-shaped weights in", random_weights(args.random_weights, cache), flush=True)
        env["MINIPAGED_CACHE_DIR"] = str(cache)
    props = torch.cuda.get_device_properties(0)
    arch = f"sm_{props.major}{props.minor}"
    summary: dict = dict(
        device=torch.cuda.get_device_name(0),
        arch=arch,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        random_weights=bool(args.random_weights),
        commit=subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        or None,
        steps={},
    )
    summary_path = result_path(summary["device"])
    if summary_path.is_file():  # an earlier call's steps on the same device and software are kept
        old = json.loads(summary_path.read_text())
        if all(old.get(k) == summary[k] for k in ("device", "torch", "triton")):
            summary["steps"] = old.get("steps", {})
    commands = plan(py, arch, random_weights=bool(args.random_weights))
    for name in [s for s in STEPS if s in steps]:
        summary["steps"][name] = run_step(name, commands[name], OUT / "logs" / f"{name}.log", env)
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    failed = [s for s in steps if not summary["steps"][s]["passed"]]
    print(f"\ngpu-check on {summary['device']}: {len(steps) - len(failed)} of {len(steps)} steps passed"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; results in {OUT.relative_to(REPO)}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
