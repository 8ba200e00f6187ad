"""UCM: Unified Cache Management for LLM serving."""

__version__ = "0.1.0"
