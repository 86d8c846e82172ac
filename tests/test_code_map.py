"""The engine's code stays readable next to vLLM: short functions, classes with one job, one seam per component
where the classroom plugs a learner's part in, and the engine reaching the model runner through the executor only.

Read from the package's source, so each test names what grew back: the function, the class, the call.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from minipaged import hooks
from minipaged.classroom import parts
from minipaged.classroom.policy import POLICY_PARTS

PACKAGE = Path(hooks.__file__).resolve().parent
ENGINE_LAYERS = ("core", "worker", "model", "engine", "kernels")  # the engine itself: no course logic, no long code
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400
# Every module that declares a seam; imported so that ``hooks.SEAMS`` holds them all.
SEAM_MODULES = [
    "minipaged.core.block_pool",
    "minipaged.core.single_type_kv_cache_manager",
    "minipaged.core.kv_cache_manager",
    "minipaged.core.scheduler",
    "minipaged.worker.step_inputs",
    "minipaged.model.attention",
]


def _sources(layers: tuple[str, ...]) -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE.parent)): ast.parse(path.read_text())
        for layer in layers
        for path in sorted((PACKAGE / layer).rglob("*.py"))
    }


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``@triton.jit`` (or ``@triton.autotune``...): a kernel is one program, read top to bottom next to its
    PyTorch reference, and is exempt from the length rule."""
    return any("triton" in ast.unparse(d) for d in fn.decorator_list)


def _long_functions(tree: ast.Module) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.name, length))
    return found


def test_no_function_in_the_engine_is_longer_than_60_lines():
    long = [
        f"{path}: {name} ({n} lines)"
        for path, tree in _sources(ENGINE_LAYERS).items()
        for name, n in _long_functions(tree)
    ]
    assert long == [], "split these into named steps:\n" + "\n".join(long)


def test_the_length_rule_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(ast.parse(f"def f():\n{body}\n")) == [("f", MAX_FUNCTION_LINES + 1)]
    assert _long_functions(ast.parse(f"@triton.jit\ndef k():\n{body}\n")) == []


@pytest.mark.parametrize(
    "module, cls",
    [("minipaged.core.kv_cache_manager", "KVCacheManager"), ("minipaged.worker.model_runner", "ModelRunner")],
)
def test_the_engines_two_central_classes_stay_under_400_lines(module, cls):
    lines, _ = inspect.getsourcelines(getattr(importlib.import_module(module), cls))
    assert len(lines) < MAX_CLASS_LINES, f"{cls} is {len(lines)} lines: give one of its jobs a helper of its own"


def _calls(tree: ast.Module, owner: str, attrs: set[str]) -> list[ast.Call]:
    """Calls ``owner.attr(...)`` for ``attr`` in ``attrs``."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in attrs
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == owner
    ]


def test_the_engine_asks_for_a_learners_part_through_its_own_seam_only():
    """No ``hooks.plugged(name)`` branches in the engine: each component declares its parts once (``hooks.Seam``)
    and asks its seam, naming a part it declared (a typo would otherwise surface only when the part is plugged)."""
    for name in SEAM_MODULES:
        importlib.import_module(name)
    stray, unknown = [], []
    for path, tree in _sources(("core", "worker", "model", "engine")).items():
        stray += [f"{path}:{c.lineno}" for c in _calls(tree, "hooks", {"plugged", "push", "pop"})]
        module = importlib.import_module(path[: -len(".py")].replace("/", ".").removesuffix(".__init__"))
        for seam_name, seam in vars(module).items():
            if not isinstance(seam, hooks.Seam):
                continue
            for call in _calls(tree, seam_name, {"pick", "plugged"}):
                part = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
                if part not in seam.parts:
                    unknown.append(f"{path}:{call.lineno}: {part!r}")
    assert stray == [], f"ask the component's SEAM instead: {stray}"
    assert unknown == [], f"parts asked for that the module's SEAM does not declare: {unknown}"


def test_every_part_the_classroom_plugs_in_is_a_seams_part():
    """The classroom's parts and the engine's seams are the same list: each part a learner writes stands in for
    exactly one declared part (a policy's three functions for the scheduler's one ``policy``), and the classroom
    says where it runs in the seam's own words (``parts._where``)."""
    for name in SEAM_MODULES:
        importlib.import_module(name)
    where = {part: text for seam in hooks.SEAMS.values() for part, text in seam.parts.items()}
    assert set(parts.PARTS) - set(POLICY_PARTS) == set(where) - {"policy"}
    assert set(POLICY_PARTS) <= set(parts.PARTS) and "policy" in hooks.SEAMS["scheduler"].parts
    differ = {n: (p.where, where[n]) for n, p in parts.PARTS.items() if n in where and p.where != where[n]}
    assert differ == {}


def test_a_seam_refuses_a_part_it_did_not_declare():
    seam = hooks.SEAMS["block_pool"]
    with pytest.raises(KeyError, match="no part 'free_blocks_typo'"):
        seam.pick("free_blocks_typo", print)
    with pytest.raises(ValueError, match="another seam"):
        hooks.Seam("block_pool_again", free_blocks="a second home for a part")
    assert seam.pick("free_blocks", print) is print and not seam.replaced()


def test_the_engine_reaches_the_runner_through_the_executor():
    """``LLM`` and the disaggregated engine hold an executor, not a runner: the runner may live in another process
    (tensor parallelism), and what the engine needs of it is the executor's named methods."""
    reach = [
        f"{path}:{node.lineno}: {ast.unparse(node)}"
        for path, tree in _sources(("engine",)).items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "runner"
    ]
    assert reach == []
