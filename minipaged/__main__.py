"""Command line: ``python -m minipaged {prepare,demo,generate,chat,bench,serve,worker,grade,kernels}``.

* ``prepare``: convert the SmolLM2 GGUF once into the local cache (``make setup`` runs it).
* ``demo``: the main job — the paged engine serves a batch of prompts; answers, pool figures, throughput.
* ``generate "..." ["..."]``: answer prompts (chat template unless ``--raw``; ``--stream`` for one).
* ``chat``: an interactive, streamed chat.
* ``bench``: throughput on a seeded mixed-length batch (the full comparison is benchmarks/bench_engine.py).
* ``serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME] [--max-body-bytes N]
  [engine knobs]``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``); every field of ``Config`` is a flag (``--max-num-seqs 64``,
  ``--no-enable-prefix-caching``).
* ``worker --master-addr A --master-port P --node-rank K``: this machine's share of the ranks of a tensor-parallel
  engine started elsewhere with ``nnodes`` > 1 (``--tensor-parallel-size N`` on the commands above and on ``serve``
  splits the model over N processes of this machine).
* ``grade [PATH ...] [--timeout S]``: grade the exercise notebooks in each folder (or each notebook) by running
  the learner's code in a fresh process per notebook and calling the checks on it; print a score table.
* ``kernels [--arch sm_80,sm_90] [--json]``: compile every Triton kernel for an NVIDIA GPU (no GPU needed)
  and print registers, spills, shared memory and occupancy per configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from .classroom.grading.runner import DEFAULT_MEMORY_BYTES as DEFAULT_GRADE_MEMORY
from .classroom.grading.runner import DEFAULT_TIMEOUT_S as DEFAULT_GRADE_TIMEOUT_S

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "List the days of the week.",
    "What does a KV cache store?",
    "Write a haiku about autumn.",
]


def kv_budget_table(
    spec,
    budget_bytes: int = 1 << 30,
    request_tokens: int = 2048,
    block_size: int = 16,
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp8"),
) -> str:
    """The KV budget of one model as a small text table, one row per cache dtype."""
    from .kv_math import format_bytes

    header = (
        "KV dtype",
        "bytes/token",
        f"per {block_size}-token block",
        f"one {request_tokens}-token request",
        f"{request_tokens}-token requests in {format_bytes(budget_bytes, digits=0)}",
    )
    rows = [header]
    for dt in dtypes:
        s = spec.with_dtype(dt)
        cap = s.capacity(budget_bytes, block_size, request_tokens)
        rows.append(
            (
                dt,
                f"{s.bytes_per_token:,} B",
                format_bytes(s.bytes_per_block(block_size)),
                format_bytes(s.paged_bytes_for_tokens(request_tokens, block_size)),
                f"{cap.full_requests} ({cap.num_blocks:,} blocks)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_prepare(args: argparse.Namespace) -> int:
    from .model_loader import ModelCacheError, ModelNotInstalledError, cache_problem, ensure_converted

    t0 = time.perf_counter()
    try:
        problem = cache_problem(verify="hash")  # every file's size and SHA-256 against the manifest
        path = ensure_converted(progress=True, verify="hash")
    except (ModelCacheError, ModelNotInstalledError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = "already cached, every file verified (size and SHA-256)" if problem is None else f"converted ({problem})"
    print(f"SmolLM2-135M-Instruct {state} at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _engine(args: argparse.Namespace):
    from .engine.llm import LLM

    return LLM(
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.prefix_caching,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _params(args: argparse.Namespace):
    from .sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
    )


def _pool_report(llm) -> str:
    stats = llm.step_stats
    peak = max((s["blocks_used"] for s in stats), default=0)
    tokens = sum(s["tokens"] for s in stats)
    return (
        f"{llm.describe()}\n"
        f"steps {len(stats)}, tokens computed {tokens:,}, peak blocks in use {peak:,} of {llm.num_blocks - 1:,} "
        f"({peak / (llm.num_blocks - 1):.1%}), peak batch {max((s['running'] for s in stats), default=0)}, "
        f"preemptions {llm.scheduler.num_preemptions}"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from .sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(args)
    print(f"Loaded SmolLM2-135M-Instruct into the minipaged engine in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    outs = llm.generate(
        [[{"role": "user", "content": p}] for p in DEMO_PROMPTS],
        SamplingParams(max_tokens=args.max_tokens, temperature=0),
        use_tqdm=False,
    )
    seconds = time.perf_counter() - t0
    for prompt, out in zip(DEMO_PROMPTS, outs):
        print(f"\nQ: {prompt}\nA: {out.outputs[0].text.strip()}")
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"\n{len(outs)} prompts served together, greedy: {generated} tokens in {seconds:.1f} s "
        f"({generated / seconds:.1f} tokens/s)"
    )
    print(_pool_report(llm))
    print(
        f"\nKV cache of SmolLM2-135M-Instruct: {llm.spec.num_layers} layers × {llm.spec.num_kv_heads} KV heads × "
        f"head_dim {llm.spec.head_dim} ({llm.spec.attention_kind}, {llm.spec.num_attention_heads} query heads)"
    )
    print(kv_budget_table(llm.spec))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # bad sampling flags fail before the model loads
    if args.stream and (len(args.prompts) > 1 or params.n > 1):
        # Streamed answers would interleave on one terminal: refuse rather than show one and drop the rest.
        print(
            "error: --stream writes one answer as it is generated; with several prompts or -n > 1, leave out "
            "--stream and every answer is printed, labelled, when it is done",
            file=sys.stderr,
        )
        return 2
    llm = _engine(args)
    prompts = args.prompts if args.raw else [[{"role": "user", "content": p}] for p in args.prompts]
    if args.stream:
        printed = 0
        for out in llm.stream(prompts, params):
            if out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
            text = out.outputs[0].text
            print(text[printed:], end="", flush=True)
            printed = len(text)
        print()
        return 0
    for prompt, out in zip(args.prompts, llm.generate(prompts, params)):
        print(f"> {prompt}")
        if out.error:
            print(f"error: {out.error}")
            continue
        for o in out.outputs:
            tag = f"(sample {o.index}) " if len(out.outputs) > 1 else ""
            print(f"{tag}{o.text.strip()}  <{o.finish_reason}, {len(o.token_ids)} tokens>")
    if args.verbose:
        print(_pool_report(llm))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _engine(args)
    messages: list[dict[str, str]] = []
    print("Chat with SmolLM2 (empty line or Ctrl-D to quit).")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line or line in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        print("smollm2> ", end="", flush=True)
        printed, text = 0, ""
        for out in llm.stream([messages], params):
            text = out.outputs[0].text
            print(text[printed:], end="", flush=True)
            printed = len(text)
        print()
        messages.append({"role": "assistant", "content": text.strip()})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Serve a seeded mixed-length batch (lognormal prompt and output lengths) and report throughput."""
    from .lab.workloads import generation_workload
    from .sampling_params import SamplingParams

    llm = _engine(args)
    prompts, output_lens = generation_workload(args.num_prompts, llm.model.config.vocab_size, args.seed or 0)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in output_lens]
    prompt_lens = [len(p) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = sorted(o.metrics.ttft for o in outs)
    print(
        f"{args.num_prompts} requests, prompts {min(prompt_lens)}-{max(prompt_lens)} tokens, "
        f"outputs {min(output_lens)}-{max(output_lens)} tokens"
    )
    print(
        f"{generated:,} output tokens in {seconds:.1f} s: {generated / seconds:.1f} tokens/s; "
        f"median TTFT {ttfts[len(ttfts) // 2]:.2f} s"
    )
    print(_pool_report(llm))
    total = sum(llm.profile().values())
    print("time split: " + ", ".join(f"{k} {v / total:.1%}" for k, v in llm.profile().items()))
    return 0


def _add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per init field of ``Config`` (``--max-num-seqs``, ``--enable-prefix-caching/--no-...``): values
    are passed to ``LLM`` as given, so ``Config``'s own rules give the errors. Unset flags keep its defaults."""
    from dataclasses import MISSING, fields

    from .config import Config

    def auto_or_int(text: str) -> int | str:  # cpu_threads: "auto" or a count; Config's rule judges the count
        try:
            return text if text == "auto" else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f'"auto" or a positive integer, got {text!r}') from None

    # anything else reaches Config as a string
    types: dict[str, Any] = {"int": int, "int | None": int, "float": float, "int | str": auto_or_int}
    group = parser.add_argument_group("engine knobs (minipaged.config.Config; checked before the model loads)")
    for f in fields(Config):
        if not f.init:
            continue
        flag, default = "--" + f.name.replace("_", "-"), "" if f.default is MISSING else f" (default {f.default})"
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"Config.{f.name}{default}")  # fmt: skip
        else:
            group.add_argument(flag, type=types.get(str(f.type), str), default=argparse.SUPPRESS,
                               metavar=f.name.upper(), help=f"Config.{f.name}{default}")  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    """Check the knobs, load the model, serve until Ctrl-C (or SIGTERM)."""
    import signal
    from dataclasses import fields

    from .config import Config
    from .serving.api_server import DEFAULT_BODY_TIMEOUT_S, check_server_options

    # An empty --api-key (an unset variable) or a bad limit fails here, in a one-line ValueError, as a bad knob.
    check_server_options(args.api_key, args.max_body_bytes, DEFAULT_BODY_TIMEOUT_S)
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError(f"--served-model-name must not be empty, got {args.served_model_name!r}")
    knobs = {f.name: getattr(args, f.name) for f in fields(Config) if f.init and hasattr(args, f.name)}
    model = knobs.pop("model", None)
    Config.from_kwargs(model, knobs)  # a bad knob fails here, in a one-line ValueError, before the model loads
    from .engine.llm import LLM
    from .serving import start_server

    llm = LLM(model, **knobs)
    try:
        server = start_server(llm, args.host, args.port, args.api_key, args.served_model_name,
                              max_body_bytes=args.max_body_bytes)  # fmt: skip
    except RuntimeError as exc:  # the port is taken, say (uvicorn's own line is above)
        print(f"error: {exc}", file=sys.stderr)
        return 1

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    print(f"minipaged: serving {server.served_model_name} at {server.url}/v1 (Ctrl-C to stop)", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """This machine's ranks of an engine started elsewhere with ``nnodes`` > 1; until that engine shuts down."""
    from .worker.executor import run_node

    print(
        f"minipaged: node {args.node_rank} waiting for the engine at {args.master_addr}:{args.master_port}", flush=True
    )
    code = run_node(args.master_addr, args.master_port, args.node_rank, args.timeout)
    print(f"minipaged: node {args.node_rank} done ({'clean shutdown' if code == 0 else 'a rank failed'})", flush=True)
    return code


def cmd_grade(args: argparse.Namespace) -> int:
    from .classroom.grading import format_details, format_table, grade_folder

    def progress(path: Path) -> None:
        print(f"grading {path} ...", file=sys.stderr, flush=True)

    try:
        scores = grade_folder(args.paths, timeout=args.timeout, progress=progress, memory=args.memory)
    except (FileNotFoundError, ValueError) as exc:
        print(f"minipaged grade: {exc}", file=sys.stderr)
        return 2
    print(format_table(scores))
    details = format_details(scores)
    if details:
        print("\nwhere points were lost:\n\n" + details)
    return 0


def _grade_memory(text: str) -> int:
    from .config import parse_memory

    try:
        return parse_memory(text, "--memory")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number (0..65535), got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0..65535; 0: a free one), got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _csv(kind: type, name: str):
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a comma-separated list, got {text!r}") from None

    return parse


def cmd_kernels(args: argparse.Namespace) -> int:
    """Compile the Triton kernels for NVIDIA GPUs ahead of time; exit 1 if any fails or spills."""
    from .classroom import kernel_report as report

    configs = report.default_configs(
        archs=args.arch,
        block_sizes=args.block_sizes,
        groups=args.groups,
        dtypes=args.dtypes,
        head_dims=args.head_dims,
        kernels=args.kernels,
        addressing=args.addressing,
        tile_n=args.tile_n,
    )
    t0 = time.perf_counter()
    try:
        rows = report.compile_report(configs, processes=args.jobs)
    except RuntimeError as exc:  # no bundled ptxas, a crashed worker: say so, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.rows_to_json_lines(rows))
    else:
        print(report.format_table(rows))
        print(f"{report.summary(rows)} ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(r.error is None and r.spill_bytes == 0 for r in rows) else 1


def server_threads_sleep(argv: list[str]) -> None:
    """``serve``: the engine's OpenMP threads sleep between parallel regions (``OMP_WAIT_POLICY=PASSIVE``) instead
    of spinning as ``import minipaged`` sets them (``worker/cpu_threads.py``). A server's event loop needs a core
    between steps to stream tokens; threads spinning there would take it. Only where minipaged set the spin and
    torch is not loaded yet (the parser loads it): a user's own setting stands."""
    import minipaged

    if argv[:1] == ["serve"] and minipaged._SPIN_SET and "torch" not in sys.modules:
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def main(argv: list[str] | None = None) -> int:
    server_threads_sleep(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    commands = {
        "prepare": cmd_prepare,
        "demo": cmd_demo,
        "generate": cmd_generate,
        "chat": cmd_chat,
        "bench": cmd_bench,
        "serve": cmd_serve,
        "worker": cmd_worker,
        "grade": cmd_grade,
        "kernels": cmd_kernels,
    }
    try:
        return commands[args.command](args)
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags: the engine's and sampling's shared by the commands that run the model."""
    parser = argparse.ArgumentParser(
        prog="python -m minipaged", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="convert the SmolLM2 GGUF into the local cache once")
    engine, sampling = _engine_flags(), _sampling_flags()
    demo = sub.add_parser("demo", parents=[engine], help="the engine answers a batch of prompts; pool figures")
    demo.add_argument("--max-tokens", type=_positive, default=48)
    gen = sub.add_parser("generate", parents=[engine, sampling], help="answer one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the text as it is")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    gen.add_argument("-v", "--verbose", action="store_true", help="print block-pool figures")
    sub.add_parser("chat", parents=[engine, sampling], help="an interactive chat, streamed")
    bench = sub.add_parser("bench", parents=[engine], help="throughput on a seeded mixed-length batch")
    bench.add_argument("--num-prompts", type=_positive, default=32)
    bench.add_argument("--seed", type=int, default=0)
    _add_serve(sub)
    _add_worker(sub)
    _add_grade(sub)
    _add_kernels(sub)
    return parser


def _engine_flags() -> argparse.ArgumentParser:
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--block-size", type=_positive, default=16)
    engine.add_argument("--kv-cache-memory", default=None, help='KV pool budget, e.g. "512MiB" (CPU default 1GiB)')
    engine.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--max-num-seqs", type=_positive, default=256)
    engine.add_argument(
        "--tensor-parallel-size", type=_positive, default=1, help="ranks (processes) to split the model over"
    )
    return engine


def _sampling_flags() -> argparse.ArgumentParser:
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=_positive, default=64)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("-n", type=_positive, default=1, help="samples per prompt")
    return sampling


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine (FastAPI + uvicorn)")
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="default 8000; 0 takes a free port")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health); must not be empty"
    )
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API")
    serve.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=4 * 1024 * 1024,
        metavar="BYTES",
        help="refuse larger request bodies (413) before reading them (default 4194304: 4 MiB)",
    )
    _add_knob_flags(serve)


def _add_worker(sub: Any) -> None:
    worker = sub.add_parser(
        "worker",
        help="run this machine's ranks of a tensor-parallel engine whose rank 0 (the LLM) runs on another machine",
    )
    worker.add_argument("--master-addr", required=True, help="the engine's machine (its master_addr)")
    worker.add_argument("--master-port", type=_positive, required=True, help="the engine's master_port")
    worker.add_argument("--node-rank", type=_positive, required=True, help="this machine's number: 1 … nnodes-1")
    worker.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="how long to wait for the engine to start (default 600 s)",
    )


def _add_grade(sub: Any) -> None:
    grade = sub.add_parser("grade", help="grade a folder of exercise notebooks")
    grade.add_argument(
        "paths",
        nargs="*",
        default=["exercises"],
        metavar="PATH",
        help="folders of exercise notebooks (not their subfolders) or notebooks; default: exercises",
    )
    grade.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_GRADE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit for each notebook, its cells and its checks together (default {DEFAULT_GRADE_TIMEOUT_S} s)",
    )
    grade.add_argument(
        "--memory",
        type=_grade_memory,
        default=DEFAULT_GRADE_MEMORY,
        metavar="SIZE",
        help="memory limit for each notebook, e.g. 4GiB: what its code may allocate (default 6GiB)",
    )


def _add_kernels(sub: Any) -> None:
    kernels = sub.add_parser(
        "kernels",
        help="compile the Triton kernels for NVIDIA GPUs (no GPU needed): registers, spills, shared memory, occupancy",
    )
    kernels.add_argument("--arch", type=_csv(str, "--arch"), default=["sm_80", "sm_90"], help="default sm_80,sm_90")
    kernels.add_argument("--block-sizes", type=_csv(int, "--block-sizes"), default=[16], help="default 16; e.g. 16,32")
    kernels.add_argument(
        "--groups",
        type=_csv(int, "--groups"),
        default=[4],
        help="query heads per KV head, default 4 (SmolLM2's 3 is always included)",
    )
    kernels.add_argument("--dtypes", type=_csv(str, "--dtypes"), default=["float16", "bfloat16", "float32"])
    kernels.add_argument("--head-dims", type=_csv(int, "--head-dims"), default=[64, 128])
    kernels.add_argument(
        "--kernels", type=_csv(str, "--kernels"), default=["reshape_and_cache", "paged_decode", "paged_prefill"]
    )
    kernels.add_argument(
        "--addressing",
        choices=["block", "token"],
        default="block",
        help="token: the first version's per-token table lookups, for comparison",
    )
    kernels.add_argument(
        "--tile-n",
        type=int,
        default=None,
        help="keys per K/V tile instead of the kernels' table (e.g. 64: the first version's)",
    )
    kernels.add_argument("--jobs", type=_positive, default=None, help="compile processes (default: one per core)")
    kernels.add_argument("--json", action="store_true", help="one JSON object per line")


if __name__ == "__main__":
    sys.exit(main())
