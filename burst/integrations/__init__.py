"""Adapters that let other libraries' models run their attention through burst.

transformers: `burst.integrations.transformers.register(...)` (needs `pip install burst[hf]`).
"""
