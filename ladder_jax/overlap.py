"""`python -m ladder_jax.overlap`: see `ladder_jax.cli.overlap`."""

import sys

from ladder_jax.cli.overlap import main

if __name__ == "__main__":
    sys.exit(main())
