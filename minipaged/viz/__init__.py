"""Widgets (ipywidgets + plotly) that make the course's memory pictures move."""
from .kv_widgets import KVCalculator, KVGrowthView

__all__ = ["KVCalculator", "KVGrowthView"]
