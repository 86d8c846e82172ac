"""Widgets (ipywidgets + plotly) that make the course's memory pictures move."""
from .kv_widgets import KVCalculator, KVGrowthView
from .block_viz import BlockPoolGrid, BlockTableView, ContiguousVsPaged, contiguous_layouts
from .kernel_viz import PagedReadView  # noqa: E402  chapter 05

__all__ = ["KVCalculator", "KVGrowthView", "BlockPoolGrid", "BlockTableView", "ContiguousVsPaged", "contiguous_layouts",
           "PagedReadView"]
