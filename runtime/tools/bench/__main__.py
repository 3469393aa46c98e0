"""`python -m runtime.tools.bench --compile-only MODEL_DIR`: the fresh process `scorefn bench --compile-times` times
(the benchmark itself runs as `scorefn bench`)."""

import logging
import sys

from runtime.tools.bench.compile_times import compile_only

if len(sys.argv) == 3 and sys.argv[1] == "--compile-only":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sys.exit(compile_only(sys.argv[2]))
sys.exit("usage: python -m runtime.tools.bench --compile-only MODEL_DIR (the benchmark itself: scorefn bench)")
