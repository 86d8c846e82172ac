"""minipaged.show.show_source prints the package's own code, exactly, with true line numbers."""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
from pathlib import Path

import pytest

import minipaged
from minipaged.classroom.show import Source, show_source
from minipaged.core.block_pool import BlockPool, FreeKVCacheBlockQueue
from minipaged.worker.block_table import slot_mapping

REPO = Path(minipaged.__file__).resolve().parents[1]

DEMO = '''\
"""A module written by the test."""
import functools


def double(x):
    """Twice x."""
    return 2 * x


class Counter:
    step = 1

    def bump(self, n):
        text = """
a string reaching column 0
"""
        return n + self.step

    @property
    def size(self):
        return 3

    @staticmethod
    def zero():
        return 0
'''


@pytest.fixture
def demo(tmp_path, monkeypatch):
    (tmp_path / "show_demo_mod.py").write_text(DEMO)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("show_demo_mod", None)
    module = importlib.import_module("show_demo_mod")
    yield module, tmp_path / "show_demo_mod.py"
    sys.modules.pop("show_demo_mod", None)


def test_function_exact_source_and_lines(demo):
    module, _ = demo
    assert repr(show_source(module.double)) == (
        '# double in show_demo_mod.py, lines 5-7\ndef double(x):\n    """Twice x."""\n    return 2 * x'
    )


def test_method_named_by_class_and_dedented(demo):
    module, _ = demo
    expected = (
        "# Counter.bump in show_demo_mod.py, lines 13-17\n"
        "def bump(self, n):\n"
        '    text = """\n'
        "a string reaching column 0\n"
        '"""\n'
        "    return n + self.step"
    )
    assert repr(show_source(module.Counter.bump)) == expected
    assert repr(show_source(module.Counter().bump)) == expected  # bound to an instance: the same code


def test_property_staticmethod_class_and_module(demo):
    module, _path = demo
    assert repr(show_source(module.Counter.size)).startswith(
        "# Counter.size in show_demo_mod.py, lines 19-21\n@property\ndef size(self):"
    )
    assert repr(show_source(module.Counter.__dict__["zero"])).startswith(
        "# Counter.zero in show_demo_mod.py, lines 23-25\n@staticmethod\n"
    )
    assert repr(show_source(module.Counter)).startswith("# Counter in show_demo_mod.py, lines 10-25\nclass Counter:")
    assert repr(show_source(module)) == "# show_demo_mod in show_demo_mod.py, lines 1-25\n" + DEMO.rstrip("\n")


def test_follows_the_file_when_the_code_changes(demo):
    module, path = demo
    path.write_text(DEMO.replace("return 2 * x", "y = x + x\n    return y"))
    module = importlib.reload(module)
    assert repr(show_source(module.double)).splitlines()[0] == "# double in show_demo_mod.py, lines 5-8"
    assert repr(show_source(module.double)).endswith("    y = x + x\n    return y")


def _check_against_file(obj, qualname: str, rel: str, first_line: str) -> None:
    text = repr(show_source(obj))
    header, *body = text.splitlines()
    m = re.fullmatch(rf"# {re.escape(qualname)} in {re.escape(rel)}, lines (\d+)-(\d+)", header)
    assert m, header
    a, b = int(m[1]), int(m[2])
    file_lines = (REPO / rel).read_text().splitlines()
    assert file_lines[a - 1].strip() == first_line  # the header's first line is the definition's
    assert textwrap.dedent("\n".join(file_lines[a - 1 : b])) == "\n".join(body)  # every line, as in the file

    def indent(line):
        return len(line) - len(line.lstrip())

    after = file_lines[b] if b < len(file_lines) else ""  # the block ends at b: the next line is not in it
    assert not after.strip() or indent(after) <= indent(file_lines[a - 1])


def test_package_function_and_method_match_their_files():
    _check_against_file(
        slot_mapping,
        "slot_mapping",
        "minipaged/worker/block_table.py",
        next(
            ln.strip()
            for ln in (REPO / "minipaged/worker/block_table.py").read_text().splitlines()
            if ln.startswith("def slot_mapping(")
        ),
    )
    _check_against_file(
        FreeKVCacheBlockQueue.remove,
        "FreeKVCacheBlockQueue.remove",
        "minipaged/core/block_pool.py",
        "def remove(self, block: KVCacheBlock) -> None:",
    )
    _check_against_file(
        BlockPool.get_new_blocks,
        "BlockPool.get_new_blocks",
        "minipaged/core/block_pool.py",
        "def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:",
    )


def test_triton_kernel_is_shown_as_its_python_function():
    kernel = importlib.import_module("minipaged.kernels.cache_write")._reshape_and_cache_kernel
    text = repr(show_source(kernel))
    assert text.splitlines()[0].startswith("# _reshape_and_cache_kernel in minipaged/kernels/cache_write.py")
    assert text.splitlines()[1:3] == ["@triton.jit", "def _reshape_and_cache_kernel("]


def test_several_objects_one_block_each():
    text = repr(show_source(FreeKVCacheBlockQueue.remove, FreeKVCacheBlockQueue._unlink))
    headers = [ln for ln in text.splitlines() if ln.startswith("# FreeKVCacheBlockQueue.")]
    assert [h.split(" in ")[0] for h in headers] == [
        "# FreeKVCacheBlockQueue.remove",
        "# FreeKVCacheBlockQueue._unlink",
    ]
    assert "\n\n# FreeKVCacheBlockQueue._unlink" in text


@pytest.mark.parametrize(
    "obj, why",
    [
        (len, "built in"),
        (dict.get, "built in"),
        (3, "type int"),
        (BlockPool(4), "instance of BlockPool"),
    ],
)
def test_refuses_objects_without_python_source(obj, why):
    with pytest.raises(TypeError, match="no Python source") as err:
        show_source(obj)
    assert why in str(err.value)


def test_needs_an_object():
    with pytest.raises(TypeError, match="at least one"):
        show_source()


def test_plain_and_html_reprs():
    src = show_source(slot_mapping)
    assert isinstance(src, Source)
    assert str(src) == repr(src) == src.text
    html = src._repr_html_()
    assert html.lstrip().startswith("<div") or html.lstrip().startswith("<pre")
    assert "slot_mapping" in html and "block_table.py" in html


def test_refuses_stale_lines_after_an_edit_without_reload(demo):
    module, path = demo
    path.write_text("# a new first line moves every definition down\n\n\n" + DEMO)
    with pytest.raises(OSError, match="changed since it was imported"):
        show_source(module.double)
    assert repr(show_source(importlib.reload(module).double)).startswith("# double in show_demo_mod.py, lines 8-10")
