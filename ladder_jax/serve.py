"""`python -m ladder_jax.serve`: see `ladder_jax.cli.serve`."""

import sys

from ladder_jax.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
