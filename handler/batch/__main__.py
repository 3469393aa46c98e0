"""`python -m handler.batch ...`: what `scorefn batch ...` runs (runtime.tools.cli starts it by module name)."""

import sys

from handler.batch.cli import main

sys.exit(main(sys.argv[1:]))
