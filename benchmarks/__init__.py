"""Benchmarks of hf_lowbit (not part of the package): see benchmarks/README.md.

A plain package so that the scripts here and the tests import the driver as ``benchmarks.driver`` and
``benchmarks.corpus`` from the repository root.
"""
