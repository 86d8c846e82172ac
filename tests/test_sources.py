"""The "Sources and checked claims" page: every figure the course quotes names a source a reader can find,
computes live, and carries a verdict."""

import re

import pytest

from minipaged.classroom import sources
from minipaged.classroom.sources import (
    BOOK_CHAPTER,
    CAPACITY_ARTICLE,
    DEEP_DIVE,
    INFERENCE_AT_SCALE,
    PAGED_ATTENTION,
    Claim,
    claims,
)

NAMED = (PAGED_ATTENTION, BOOK_CHAPTER, INFERENCE_AT_SCALE, DEEP_DIVE, CAPACITY_ARTICLE)
# Other sources a reader can find: a file of vLLM's source, a paper (authors "et al." or an arXiv id), a GitHub
# repository, a vendor's datasheet, or a text named by its quoted title.
FINDABLE = re.compile(r"\bvllm/[\w/.]+\.py\b|\bet al\.|\barXiv\b|\bGitHub\b|\bdatasheet\b|\"[^\"]{8,}\"")

ALL = claims()


def _id(c: Claim) -> str:
    return f"{c.chapter}: {c.claim[:50]}"


def test_there_are_claims_and_each_has_a_chapter():
    assert ALL
    assert all(re.fullmatch(r"\d\d", c.chapter) for c in ALL)
    assert [c.chapter for c in ALL] == sorted(c.chapter for c in ALL)  # grouped, in chapter order


@pytest.mark.parametrize("claim", ALL, ids=_id)
def test_each_claim_is_complete(claim):
    for field in ("chapter", "claim", "source", "verdict"):
        assert isinstance(getattr(claim, field), str) and getattr(claim, field).strip(), field
    assert claim.verdict.startswith(("holds", "wrong")), claim.verdict
    assert callable(claim.computed)


@pytest.mark.parametrize("claim", ALL, ids=_id)
def test_each_claim_computes_live(claim):
    got = claim.computed()
    assert isinstance(got, str) and got.strip()


@pytest.mark.parametrize("claim", ALL, ids=_id)
def test_each_source_is_one_a_reader_can_find(claim):
    assert any(name in claim.source for name in NAMED) or FINDABLE.search(claim.source), claim.source
    for text in (claim.claim, claim.source, claim.verdict):
        assert not re.search(r"\bseeds?\b", text, re.IGNORECASE), text


def test_every_chapter_01_to_09_has_a_claim():
    chapters = {c.chapter for c in ALL}
    missing = [f"{n:02d}" for n in range(1, 10) if f"{n:02d}" not in chapters]
    assert not missing, f"chapters without a checked claim: {missing}"


def test_the_source_titles_name_no_seed_file():
    for name in NAMED:
        assert "seed" not in name.lower() and not re.search(r"\d{3}_[0-9a-f]{8,}", name)
    assert sources.claims is claims
