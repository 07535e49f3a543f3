"""`python -m ladder_jax.serve`: see `ladder_jax.cli.serve`."""

from ladder_jax.cli.serve import exit_now, main

if __name__ == "__main__":
    exit_now(main())
