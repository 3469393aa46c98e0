"""scorefn runtime: JAX model, weights, buckets and the scoring engine.

Importing this package is cheap: JAX is imported only by the modules that need it.
"""

import time

# When this process started importing scorefn (for the cold-start breakdown in the warm-up log).
PROCESS_STARTED = time.monotonic()
