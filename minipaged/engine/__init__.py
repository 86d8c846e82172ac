"""The engine a user holds: ``LLM`` (``llm.py``), the step driver it shares with the simulator and the tests
(``step.py``), prompts and outputs, engine events, the snapshot a failed step is rolled back with, and the
disaggregated engine. It imports everything below it, nothing above (``serving``, ``lab``, ``classroom``).

``LLM`` is imported on first use: ``minipaged.engine.step`` (the simulator's driver) does not load torch."""

from typing import Any

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'minipaged.engine' has no attribute {name!r}")
