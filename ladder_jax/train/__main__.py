import sys

from ladder_jax.cli.train import main

sys.exit(main())
