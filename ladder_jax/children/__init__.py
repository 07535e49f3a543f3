"""Programs a process of the package runs as child processes, from their files (`python -I
FILE`), importing the standard library only: `output_filters` (`ladder_jax.processes`)."""
