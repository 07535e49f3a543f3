"""`python -m ladder_jax.eval`: see `ladder_jax.cli.eval`."""

import sys

from ladder_jax.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
