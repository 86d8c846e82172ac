"""Widgets (ipywidgets + plotly) that make the course's memory pictures move."""
from .kv_widgets import KVCalculator, KVGrowthView
from .block_viz import BlockPoolGrid, BlockTableView, ContiguousVsPaged, contiguous_layouts

__all__ = ["KVCalculator", "KVGrowthView", "BlockPoolGrid", "BlockTableView", "ContiguousVsPaged", "contiguous_layouts"]
