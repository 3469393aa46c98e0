"""scorefn runtime: JAX model, weights, buckets and the scoring engine.

Importing this package is cheap: JAX is imported only by the modules that need it.
"""
