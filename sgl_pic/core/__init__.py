"""The domain the engine, the SGLang binding and the HTTP layer share: marks and their
wire format, tenants and namespaces, requests admitted with their marks, runs of
positions, and the metric declarations. Imports nothing of ``binding``, ``engine`` or
``http``, and nothing of SGLang (``tests/test_layers.py``)."""
