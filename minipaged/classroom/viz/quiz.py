"""The end-of-chapter self-check as a widget: type or pick an answer, press Check, read why.

Every question and every answer comes from ``minipaged.classroom.selfcheck`` when the widget is drawn, in the kernel's
memory only: the notebook stores the call ``Quiz("03")``, never an answer. "Show answer n" computes nothing new;
it prints what the question drew. "New numbers" draws every question again with the next seed::

    ┌ Self-check, chapter 03 ─────────────────────────────────────────┐
    │ 1. A BlockPool of 63 blocks hands 3 blocks to one request ...    │
    │    answer 1 [______]  (Check 1)  (Show answer 1)                 │
    │    Not yet. Section 5: one block of the pool is not for requests.│
    │ ...                                               (New numbers)  │
    └──────────────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import html

import ipywidgets as W
from IPython.display import display

from .. import selfcheck

RIGHT, WRONG, NEUTRAL = "#1d6b35", "#9b1c1c", "#333333"  # >= 7:1 on white


class Quiz:
    """The self-check of one chapter (``"01"`` ... ``"13"``), drawn with ``seed``."""

    def __init__(self, chapter: str, seed: int = 0) -> None:
        if chapter not in selfcheck.QUESTIONS:
            raise ValueError(f"no self-check for chapter {chapter!r}; chapters: {', '.join(selfcheck.CHAPTERS)}")
        self.chapter, self.seed = chapter, seed
        self.title = W.HTML()
        self.rows = W.VBox()
        self.new_numbers = W.Button(description="New numbers", tooltip="draw every question again")
        self.new_numbers.on_click(lambda _: self.redraw(self.seed + 1))
        self.widget = W.VBox([self.title, self.rows, self.new_numbers], layout=W.Layout(max_width="900px"))
        self.asked: list[selfcheck.Asked] = []
        self.inputs: list[W.Text | W.Dropdown] = []
        self.feedback: list[W.HTML] = []
        self.redraw(seed)

    def redraw(self, seed: int) -> None:
        self.seed = seed
        self.asked = selfcheck.questions(self.chapter, seed)
        self.title.value = (
            f"<b>Self-check, chapter {self.chapter}</b> — draw {seed + 1} of the numbers; every answer is computed "
            "by the package when you press Check."
        )
        rows, self.inputs, self.feedback = [], [], []
        for i, q in enumerate(self.asked, 1):
            prompt = W.HTML(f"<p style='margin:8px 0 2px 0'><b>{i}.</b> {html.escape(q.prompt)}</p>")
            box: W.Text | W.Dropdown
            if q.is_choice:
                box = W.Dropdown(options=["(pick one)", *q.choices], description=f"answer {i}")
                box.layout = W.Layout(width="680px")
            else:
                box = W.Text(description=f"answer {i}", placeholder=q.unit or "a number")
            check = W.Button(description=f"Check {i}", button_style="primary")
            check.on_click(lambda _, i=i: self.answer(i, self.inputs[i - 1].value))
            show = W.Button(description=f"Show answer {i}")
            show.on_click(lambda _, i=i: self.show(i))
            note = W.HTML()
            self.inputs.append(box)
            self.feedback.append(note)
            rows.append(W.VBox([prompt, W.HBox([box, check, show]), note]))
        self.rows.children = rows

    def answer(self, i: int, response: str) -> selfcheck.Verdict:
        """Check ``response`` to question ``i`` (from 1), as the Check button does; the verdict is shown too."""
        verdict = selfcheck.check(self.asked[i - 1], str(response))
        self._say(i, verdict.message, RIGHT if verdict.right else WRONG)
        return verdict

    def show(self, i: int) -> None:
        q = self.asked[i - 1]
        self._say(i, f"The answer: {q.shown()}. {q.explain}", NEUTRAL)

    def _say(self, i: int, text: str, color: str) -> None:
        self.feedback[i - 1].value = f"<span style='color:{color}'>{html.escape(text)}</span>"

    def _ipython_display_(self) -> None:
        display(self.widget)
