"""`python -m ladder_jax.convert`: see `ladder_jax.cli.convert`."""

import sys

from ladder_jax.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
