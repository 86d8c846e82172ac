"""Widgets (ipywidgets + plotly) that make the course's memory pictures move.

``minipaged.classroom.viz.layout`` holds the rules every figure here follows (``check_layout``: titled axes, the
legend off the plot, distinct legend names, round ticks on a second y axis; ``contrast_ratio``), which the
tests assert on each figure.
"""

from .batching_viz import (
    BatchingPlayer,
    BatchingTimeline,
    PrefixSharingView,
    batch_and_latency_figure,
    watermark_sweep_figure,
)
from .block_viz import BlockPoolGrid, BlockTableView, ContiguousVsPaged  # chapters 02-04
from .kernel_viz import PagedReadView  # chapter 05
from .kv_widgets import KVCalculator, KVGrowthView  # chapter 01
from .monitor import EngineMonitor  # chapter 09: a live engine
from .quiz import Quiz  # every chapter's self-check

__all__ = [
    "BatchingPlayer",
    "BatchingTimeline",
    "BlockPoolGrid",
    "BlockTableView",
    "ContiguousVsPaged",
    "EngineMonitor",
    "KVCalculator",
    "KVGrowthView",
    "PagedReadView",
    "PrefixSharingView",
    "Quiz",
    "batch_and_latency_figure",
    "watermark_sweep_figure",
]
