"""Training: the trainer and its run directory (`trainer`), the jitted step and optimizer
(`step`), the data pipeline (`data`) and checkpoints (`checkpoint`).

`python -m ladder_jax.train` runs `ladder_jax.cli.train`."""
