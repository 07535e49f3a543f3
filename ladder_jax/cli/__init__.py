"""The command lines: argparse and `main` only, one module per `python -m ladder_jax.X`. The
library never imports these."""
