"""The memory tracker's old place: ``autopar.memory_tracker`` (below the planner, which measures
op memory with it). Kept for code that imports it from here."""
from autopar.memory_tracker import CATEGORIES, UNACCOUNTED, MemoryReport, MemoryTracker

__all__ = ["MemoryTracker", "MemoryReport", "CATEGORIES", "UNACCOUNTED"]
