"""Training: the trainer (`trainer`, run by `python -m ladder_jax.train`), its run directory
(`rundir`), the step (`step`), the data pipeline (`data`) and checkpoints (`checkpoint`)."""
