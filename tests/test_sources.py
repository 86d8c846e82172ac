"""The "Sources and checked claims" page: every figure the course quotes names a source a reader can find,
computes live, and carries a verdict."""

import re
from pathlib import Path

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
    assert claim.verdict.startswith(("holds", "unverifiable as quoted", "wrong")), claim.verdict
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


def test_the_source_titles_name_no_seed_file():
    for name in NAMED:
        assert "seed" not in name.lower() and not re.search(r"\d{3}_[0-9a-f]{8,}", name)
    assert sources.claims is claims


def test_every_chapter_01_to_13_has_a_claim():
    chapters = {c.chapter for c in ALL}
    missing = [f"{n:02d}" for n in range(1, 14) if f"{n:02d}" not in chapters]
    assert not missing, f"chapters without a checked claim: {missing}"


# ---- every figure a chapter quotes from elsewhere is on the page --------------------------------------------------
# A sentence quotes a figure from elsewhere when it cites a work (an author "et al.", or one of the texts the course
# names) and still holds a number once the citation's own numbers are gone (years, sections, figures, arXiv ids,
# venues) and so are model and hardware names (Llama-3-8B, H100) and code.
CITED = re.compile(
    r"(?P<author>[A-Z][A-Za-z\-]+) et al\.|(?P<named>vLLM Deep Dive|Inference at scale|capacity article|"
    r"KV-cache capacity|DistServe|Orca|Megatron|Sarathi)"
)
KEYS = {  # how a named text appears in a claim's source
    "vLLM Deep Dive": "vLLM Deep Dive",
    "Inference at scale": "Inference at scale",
    "capacity article": "KV-cache capacity",
    "KV-cache capacity": "KV-cache capacity",
    "DistServe": "DistServe",
    "Orca": "Orca",
    "Megatron": "Megatron",
    "Sarathi": "Sarathi",
}
NOT_FIGURES = [
    re.compile(p)
    for p in (
        r"`[^`]*`",
        r"\b(?:19|20)\d\d\b",
        r"(?:§|Fig\.|Figure|Table|[Ss]ections?|[Cc]hapters?|version)\s*\d+(?:[.–-]\d+)*[a-z]?",
        r"arXiv:?\s?\d{4}\.\d{4,5}",
        r"\b(?:OSDI|SOSP|ISCA|MLSys|NeurIPS|ICML|EuroSys)\b",
        r"\b(?=[\w-]*[A-Za-z])(?=[\w-]*\d)[\w-]+\b",  # Llama-3-8B, H100, fp16, SmolLM2-135M, FlashAttention-2
    )
]


# Sentences that cite a work beside numbers that are not the work's: each with the reason.
NOT_QUOTED = {
    ("09", "Sun"): "the activations quoted are SmolLM2's, measured in the cell before; Sun et al. named the effect",
}


def quoted_figures() -> list[tuple[str, str, str]]:
    """(chapter, the cited work's key, the sentence) for every sentence of chapters 01–13 that quotes a figure."""
    import nbformat

    found = []
    for path in sorted(Path(__file__).resolve().parents[1].glob("notebooks/[01][0-9]*_*.ipynb")):
        chapter = path.name[:2]
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            text = cell.source.replace("\n", " ")
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z*(#])", text):
                bare = sentence
                for pattern in NOT_FIGURES:
                    bare = pattern.sub(" ", bare)
                if not re.search(r"\d", bare):
                    continue
                for m in CITED.finditer(sentence):
                    found.append((chapter, m["author"] or KEYS[m["named"]], sentence.strip()[:160]))
    return found


def test_every_quoted_figure_has_its_source_on_the_page():
    """A chapter that quotes a figure from a work must have a claim that names that work; chapter 00 (the welcome)
    only introduces the works the chapters quote."""
    sources_by_chapter: dict[str, str] = {}
    for c in ALL:
        sources_by_chapter[c.chapter] = sources_by_chapter.get(c.chapter, "") + " " + c.source + " " + c.claim
    missing = [
        (chapter, key, sentence)
        for chapter, key, sentence in quoted_figures()
        if chapter != "00" and (chapter, key) not in NOT_QUOTED and key not in sources_by_chapter.get(chapter, "")
    ]
    assert not missing, "figures quoted with no claim naming their source:\n" + "\n".join(map(str, missing))


def test_the_figure_finder_finds_what_it_must():
    """The finder itself: the quoted figures it must see are seen (so an empty list above is not a blind finder)."""
    found = {(chapter, key) for chapter, key, _ in quoted_figures()}
    for want in [("01", "vLLM Deep Dive"), ("02", "Inference at scale"), ("07", "Wu"), ("06", "Orca")]:
        assert want in found, want
    assert set(NOT_QUOTED) <= found, "an exemption that no longer applies"


# ---- a GPU's measured figure in a chapter names the committed run it comes from -------------------------------------
# "an H100 ... 39 ms", "the recorded H100 run ... 81 %": a figure measured on a GPU names its result file in
# assets/benchmarks/ (or says it is an estimate, or reads a datasheet peak from minipaged.gpus). A CPU-only machine
# cannot check such a figure, so the file is what a reader can.
_GPU_FIGURE = re.compile(r"\b(T4|L4|A100|H100|H200)\b[^.]{0,120}?\b\d+(?:\.\d+)?\s?(?:ms|µs|%|tok/s)")
_BACKED = re.compile(r"assets/benchmarks/|\bestimate|minipaged\.gpus|\bdatasheet")


def _unbacked_gpu_figures(text: str) -> list[str]:
    """Each GPU figure whose sentence (and the one before it) names neither a result file nor an estimate."""
    found = []
    for m in _GPU_FIGURE.finditer(text):
        start = text.rfind(".", 0, text.rfind(".", 0, m.start()) - 1) + 1  # from the start of the sentence before
        end = text.find(".", m.end())
        if not _BACKED.search(text[start : len(text) if end < 0 else end]):
            found.append(" ".join(m[0].split()))
    return found


def test_the_gpu_figure_check_finds_an_unbacked_figure():
    assert _unbacked_gpu_figures("Our record on an H200 is about 36 ms a step, 90 % in Python.") == [
        "H200 is about 36 ms"
    ]
    assert not _unbacked_gpu_figures("The committed run on an H100 (`assets/benchmarks/gpu/x.json`) took 39 ms.")
    assert not _unbacked_gpu_figures("On an H100 we estimate about 3 ms a step.")


CHAPTERS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_gpu_figure_in_a_chapter_points_to_a_committed_result(chapter):
    import nbformat

    text = "\n".join(c.source for c in nbformat.read(chapter, as_version=4).cells if c.cell_type == "markdown")
    assert not _unbacked_gpu_figures(text), f"{chapter.name}: GPU figures with no result file or estimate"
