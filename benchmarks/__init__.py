"""The benchmark of tritonep, kept out of the library: ``python -m benchmarks`` from the
repository root (``python -m benchmarks --help``; ``__main__.py`` lists the modes).

Nothing here is imported by tritonep, and this package imports tritonep's internals in one
module only (``internals.py``).
"""
