"""Ember's benchmark runner: Ember against eager PyTorch, TorchInductor and ONNX Runtime.

Run it from the repository root with ``python3 -m bench`` (``--help`` lists the options); it
writes a Markdown report, ``bench/RESULTS.md`` by default.
"""
