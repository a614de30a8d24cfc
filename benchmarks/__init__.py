"""Benchmarks: the papers' experiments on scikit-learn's digits (``python -m benchmarks``)."""
