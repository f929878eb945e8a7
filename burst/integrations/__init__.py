"""Adapters that let other libraries' models run their attention through burst.

transformers: `burst.integrations.transformers.register(...)` (needs transformers and accelerate:
`pip install '.[hf]'` from the clone); a package whose face (its __init__.py) gathers the backend,
the recurrent layers, generation and the training loops.
"""
