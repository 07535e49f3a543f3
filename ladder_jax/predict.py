"""`python -m ladder_jax.predict`: see `ladder_jax.cli.predict`."""

import sys

from ladder_jax.cli.predict import main

if __name__ == "__main__":
    sys.exit(main())
