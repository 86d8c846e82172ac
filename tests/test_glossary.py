"""The glossary and cheat sheet (``minipaged.glossary``): every term is taught where it says, every package name
resolves, and every number on the cheat sheet is what the package computes."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from minipaged.classroom import glossary
from minipaged.kv_math import PRESETS

ROOT = Path(__file__).resolve().parent.parent


def _chapter_text(chapter: str) -> str:
    folder, pattern = (
        (ROOT / "exercises", "ex05c_*.ipynb") if chapter == "05c" else (ROOT / "notebooks", f"{chapter}_*")
    )
    (path,) = folder.glob(pattern)
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)


@pytest.mark.parametrize("term", glossary.TERMS, ids=lambda t: t.term)
def test_each_term_is_in_its_chapter_and_in_the_package(term) -> None:
    words = re.escape(term.term)
    flags = 0 if term.term.isupper() else re.IGNORECASE  # TTFT and ITL as written, the rest in any case
    assert re.search(rf"\b{words}", _chapter_text(term.chapter), flags), f"{term.term!r} not in chapter {term.chapter}"
    if term.where:
        assert glossary.resolve(term.where) is not None


def test_the_terms_the_course_leans_on_are_all_there() -> None:
    names = {t.term for t in glossary.TERMS}
    assert {"slot", "block table", "null block", "TTFT", "ITL", "watermark", "prefix caching", "copy-on-write"} <= names
    assert len(names) == len(glossary.TERMS)
    assert glossary.table().count("\n") == len(glossary.TERMS) + 1


def test_the_cheat_sheet_computes_its_numbers() -> None:
    sheet = {f.name: f.example for f in glossary.formulas()}
    small = PRESETS["smollm2-135m"]
    assert f"= {small.bytes_per_token:,} B" in sheet["KV bytes per token"] and small.bytes_per_token == 23_040
    assert f"Llama-3-8B: {2 * 32 * 8 * 128 * 2:,} B" in sheet["KV bytes per token"]
    assert sheet["per-rank KV bytes under TP"].endswith(f"{23_040 // 3:,} B per token on each rank")
    assert "8,192 blocks, 32 requests of 4096 tokens" in sheet["requests that fit"]  # 16 GiB / (16 · 128 KiB)
    assert sheet["slot of position p"].endswith("slot 21")  # table[9 // 4] = 5: 5 · 4 + 9 % 4
    assert "weights [0.271, 0.5]" in sheet["merge of split-KV segments"]  # 2 · e^-2, 0.5 · e^0
    assert "4.0 FLOP/B" in sheet["decode arithmetic intensity"]  # 2 · (32 / 8) / 2
    # another context length moves the numbers the sheet shows: they are computed, not typed
    assert (
        "16 requests of 8192 tokens"
        in {f.name: f.example for f in glossary.formulas(context=8192)}["requests that fit"]
    )
    assert glossary.cheat_sheet().count("e.g. ") == len(sheet)
