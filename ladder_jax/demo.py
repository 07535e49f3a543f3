"""`python -m ladder_jax.demo`: see `ladder_jax.cli.demo`."""

import sys

from ladder_jax.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
