"""Sparse attention over paged KV: a common core (:mod:`.base`) and one module per algorithm."""
