"""`python -m ladder_jax.decode`: see `ladder_jax.cli.decode`."""

import sys

from ladder_jax.cli.decode import main

if __name__ == "__main__":
    sys.exit(main())
