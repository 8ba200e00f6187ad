"""UCM's OpenAI-compatible prefill/decode proxy."""

__version__ = "0.1.0"
