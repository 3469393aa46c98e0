"""scorefn HTTP handler: schemas, validation, errors, a framework-free core and its ASGI/WSGI faces.

Never imports JAX: the runtime engine is reached only through `runtime.interface.ScoringEngine`.
"""
