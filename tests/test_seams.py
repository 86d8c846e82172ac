"""The engine's seams, read from the package itself: one config, one step driver, one set of request metrics,
a small ``LLM``. Each test fails if a second copy of the concept comes back."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from minipaged import config
from minipaged.config import Config, SchedulerConfig
from minipaged.core import request
from minipaged.core.scheduler import Scheduler
from minipaged.engine import llm as engine
from minipaged.engine import overlap, step
from minipaged.lab import checking_driver as testing
from minipaged.lab import simulator
from minipaged.lab.simulator import CostModel, SimConfig, SimRequest, simulate_continuous

PACKAGE = Path(config.__file__).parent


def _calls(attr: str) -> dict[str, int]:
    """Module (relative path) -> number of calls ``x.attr(...)`` in the package's code."""
    found: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                key = str(path.relative_to(PACKAGE))
                found[key] = found.get(key, 0) + 1
    return found


def test_llm_is_small() -> None:
    lines, _ = inspect.getsourcelines(engine.LLM)
    assert len(lines) <= 200, f"LLM is {len(lines)} lines: move a concept to its own module"


def test_one_config_class_the_others_derived() -> None:
    assert issubclass(SimConfig, Config)
    knobs = {f.name for f in dataclasses.fields(Config) if f.init}
    assert {f.name for f in dataclasses.fields(SchedulerConfig)} <= knobs
    cfg = Config(max_num_seqs=7, max_num_batched_tokens=99, max_model_len=64, device="cpu")
    assert cfg.scheduler_config() == SchedulerConfig(7, 99, 64, "recompute")
    # The one rule per knob refuses the same value in every config that holds it, with the same words.
    messages = set()
    for make in (lambda: Config(max_num_seqs=0, device="cpu"), lambda: SchedulerConfig(max_num_seqs=0),
                 lambda: SimConfig(max_num_seqs=0)):  # fmt: skip
        with pytest.raises(ValueError, match="max_num_seqs") as err:
            make()
        messages.add(str(err.value))
    assert len(messages) == 1
    # Only config.py writes a knob's rule: no other module tests preemption_mode against its choices.
    for path in PACKAGE.rglob("*.py"):
        if path.name != "config.py":
            assert "PREEMPTION_MODES" not in path.read_text(), path


def test_the_simulators_scheduler_is_built_like_the_engines() -> None:
    sim = SimConfig(block_size=4, num_gpu_blocks_override=33, max_model_len=64, enable_prefix_caching=True,
                    watermark=0.0, max_num_seqs=5)  # fmt: skip
    sched = sim.make_scheduler()
    assert isinstance(sched, Scheduler) and sched.config == sim.scheduler_config()
    assert (
        sched.kv_cache_manager.num_blocks,
        sched.kv_cache_manager.block_size,
        sched.kv_cache_manager.enable_caching,
    ) == (33, 4, True)


def test_one_step_driver() -> None:
    # The scheduler's two calls of a step are made in one place in the package: the step driver.
    # The build track's graders put the package's scheduler behind the learner's interface, whose step loop is the
    # learner's own: exercise 06b drives it beside the learner's scheduler, exercise 10 under the learner's engine.
    build_track = {"classroom/grading/ex06b.py", "classroom/grading/ex10.py"}
    calls = _calls("update_from_output")
    assert calls.pop("engine/step.py") == 1 and set(calls) <= build_track, calls
    assert set(_calls("schedule")) <= {
        "engine/step.py",
        "engine/overlap.py",  # the same step, the next one scheduled while the device runs it
        "core/async_scheduler.py",  # (schedule_ahead: what the overlap loop asks for)
        "classroom/grading/ex06.py",
        "classroom/grading/ex07.py",
        *build_track,
    }  # graders: one call
    for module in (overlap, simulator):  # the engine and the checking driver step through overlap.StepPipeline
        assert "run_step(" in inspect.getsource(module), module.__name__
    assert "self.pipeline.step(" in inspect.getsource(engine.LLM.step)
    assert "self.pipeline.step(" in inspect.getsource(testing.Driver.step)
    assert step.run_step.__module__ == "minipaged.engine.step"


def test_one_request_metrics() -> None:
    defined = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "RequestMetrics"
    ]
    assert defined == ["core/request.py"]
    assert engine.RequestOutput.__dataclass_fields__["metrics"].type in ("RequestMetrics", request.RequestMetrics)
    res = simulate_continuous([SimRequest("a", 0.0, 5, 3)], CostModel.for_model(), SimConfig())
    (m,) = res.requests
    assert isinstance(m, request.RequestMetrics) and m.ttft is not None and len(m.token_times) == 3
    ttft_defs = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "ttft"
    ]
    assert ttft_defs == ["core/request.py"]
