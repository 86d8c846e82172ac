"""The end-of-chapter self-checks: right answers pass however they are written, known mistakes and near misses
fail with their own message, the widget checks what is typed, and no notebook stores an answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minipaged.classroom import selfcheck
from minipaged.classroom.selfcheck import Asked, check, parse_number
from minipaged.classroom.viz import Quiz

REPO = Path(__file__).resolve().parents[1]
SEEDS = range(12)


def notebook(chapter: str) -> Path:
    (path,) = (REPO / "notebooks").glob(f"{chapter}_*.ipynb")
    return path


def spellings(q: Asked) -> list[str]:
    """The right answer written the ways a learner might."""
    if q.is_choice:
        return [str(q.answer)]
    v = float(q.answer)  # type: ignore[arg-type]
    out = [repr(v), q.shown(), f"  {v!r} {q.unit} "]
    if v.is_integer():
        out += [str(int(v)), f"{int(v):,}", f"{int(v):_}", f"{v:e}" if abs(v) < 1e6 else str(int(v))]
    else:
        out.append(f"{v:.6g}")
    return out


def near_misses(q: Asked) -> list[str]:
    if q.is_choice:
        return [c for c in q.choices if c != q.answer] + ["(pick one)"]
    v = float(q.answer)  # type: ignore[arg-type]
    return [str(v + 1), str(v - 1), str(v * 1.05 if v else 0.5), str(-v) if v else "1", "", "about twelve"]


@pytest.mark.parametrize("chapter", selfcheck.CHAPTERS)
def test_every_question_accepts_its_answer_and_rejects_mistakes(chapter: str) -> None:
    seen = set()
    for seed in SEEDS:
        qs = selfcheck.questions(chapter, seed)
        assert 3 <= len(qs) <= 5
        for q in qs:
            seen.add(q.prompt)
            assert q.prompt and q.explain and q.hint
            assert len(q.shown()) < 3 or q.shown() not in q.hint
            for text in spellings(q):
                assert check(q, text).right, (q.prompt, text)
            for text in near_misses(q):
                verdict = check(q, text)
                assert not verdict.right, (q.prompt, text)
                assert q.explain not in verdict.message and "answer" not in verdict.message  # a miss never tells
            for wrong, why in q.mistakes.items():
                verdict = check(q, str(wrong))
                assert not verdict.right and verdict.message == why, (q.prompt, wrong)
    assert len(seen) > 3 * len(selfcheck.QUESTIONS[chapter]) // 2  # other seeds, other numbers


def test_questions_are_drawn_again_the_same() -> None:
    assert [q.prompt for q in selfcheck.questions("07", 3)] == [q.prompt for q in selfcheck.questions("07", 3)]
    with pytest.raises(ValueError, match="no self-check for chapter '14'"):
        selfcheck.questions("14")


def test_answers_are_the_package_computation() -> None:
    """Spot checks against the package's own functions, away from the module's code."""
    from minipaged.kv_math import KVSpec

    q = selfcheck.questions("01", 0)[0]
    name = next(n for n in ("Llama-3-8B", "Mistral-7B", "Llama-2-7B") if q.prompt.split(" in ")[1].startswith(n))
    dtype = "fp32" if "fp32" in q.prompt else "bf16"
    assert q.answer == KVSpec.from_preset(name.lower(), dtype=dtype).bytes_per_token
    for seed in SEEDS:
        q = selfcheck.questions("08", seed)[2]  # a salted prompt never hits another tenant's cache
        assert q.answer == 0
        q = selfcheck.questions("03", seed)[0]  # n - 1 - a - b: the null block is never free
        n, a, b = map(int, re.findall(r"\d+", q.prompt)[:3])
        assert q.answer == n - 1 - a - b
        q = selfcheck.questions("04", seed)[0]  # slot = table[p // bs] * bs + p % bs
        bs, *table, p = map(int, re.findall(r"\d+", q.prompt))
        assert q.answer == table[p // bs] * bs + p % bs
        q = selfcheck.questions("06", seed)[0]  # r1 gets what r0 leaves of the budget
        budget, r0, r1 = (int(re.search(rf"{w} (\d+)", q.prompt).group(1)) for w in ("budget", "r0 of", "r1 of"))  # type: ignore[union-attr]
        assert q.answer == min(r1, budget - r0)


@pytest.mark.parametrize(
    ("text", "value"),
    [("61440", 61440), ("61,440", 61440), ("6.144e4", 61440), ("12.5 %", 12.5), ("1 234", 1234), (" .5 ", 0.5)],
)
def test_parse_number(text: str, value: float) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "twelve", "12 13", "1.2.3"])
def test_parse_number_refuses(text: str) -> None:
    assert parse_number(text) is None


def test_quiz_widget_checks_shows_and_redraws() -> None:
    quiz = Quiz("03", seed=0)
    assert len(quiz.inputs) == 3 and all(f.value == "" for f in quiz.feedback)
    q = quiz.asked[0]
    quiz.inputs[0].value = "0"
    (check_button,) = [
        b for b in quiz.rows.children[0].children[1].children if getattr(b, "description", "") == "Check 1"
    ]
    check_button.click()
    assert "Not yet" in quiz.feedback[0].value or "null block" in quiz.feedback[0].value
    assert q.shown() not in quiz.feedback[0].value
    assert quiz.answer(1, str(q.answer)).right and "Right." in quiz.feedback[0].value
    quiz.show(2)
    assert html_text(quiz.feedback[1].value).startswith(f"The answer: {quiz.asked[1].shown()}.")
    before = [a.prompt for a in quiz.asked]
    quiz.new_numbers.click()
    assert quiz.seed == 1 and [a.prompt for a in quiz.asked] != before
    assert all(f.value == "" for f in quiz.feedback)
    with pytest.raises(ValueError, match="no self-check"):
        Quiz("00")


def html_text(value: str) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", value))


@pytest.mark.parametrize("chapter", selfcheck.CHAPTERS)
def test_each_chapter_ends_with_its_self_check_and_stores_no_answer(chapter: str) -> None:
    nb = json.loads(notebook(chapter).read_text())
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    quiz_cells = [i for i in code if f'Quiz("{chapter}")' in "".join(nb["cells"][i]["source"])]
    assert len(quiz_cells) == 1, f"chapter {chapter} shows Quiz({chapter!r}) once"
    assert quiz_cells[0] == code[-1], "the self-check is the chapter's last code cell"
    text = notebook(chapter).read_text()
    for seed in (0,):
        for q in selfcheck.questions(chapter, seed):
            assert json.dumps(q.explain)[1:-1] not in text  # the explanation (which states the answer) is not stored
    assert "The answer:" not in text and "Right. " not in text


def test_the_hybrid_question_explains_the_number_the_manager_holds():
    """Chapter 13's window question: the package's manager counts the blocks; the explanation's own arithmetic
    (full groups keep all, window groups what reaches back to n - window + 1) must give the same number."""
    for seed in range(40):
        q = selfcheck.questions("13", seed)[1]
        terms = re.search(r"(\d+)·(\d+) \+ (\d+)·(\d+) = (\d+)\.$", q.explain)
        assert terms is not None, q.explain
        a, b, c, d, total = map(int, terms.groups())
        assert a * b + c * d == total == q.answer


def test_the_layer_weights_question_counts_smollm2s_own_matrices() -> None:
    from minipaged.model_loader import ensure_converted, load_hf_model

    hf = load_hf_model(ensure_converted())
    layers = sum(p.numel() for p in hf.parameters()) - hf.config.vocab_size * hf.config.hidden_size  # tied head
    assert abs(layers - selfcheck.SMOLLM2_LAYER_WEIGHTS) < 0.005 * layers, layers
