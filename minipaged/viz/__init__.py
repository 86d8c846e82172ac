"""Widgets (ipywidgets + plotly) that make the course's memory pictures move."""
from .kv_widgets import KVCalculator, KVGrowthView  # chapter 01
from .block_viz import BlockPoolGrid, BlockTableView, ContiguousVsPaged  # chapters 02-04
from .kernel_viz import PagedReadView  # chapter 05
from .batching_viz import BatchingPlayer, BatchingTimeline, PrefixSharingView  # chapters 06-08

__all__ = ["KVCalculator", "KVGrowthView", "BlockPoolGrid", "BlockTableView", "ContiguousVsPaged",
           "PagedReadView", "BatchingPlayer", "BatchingTimeline", "PrefixSharingView"]
