"""Experiments that reproduce the paper's claims at a scale a CPU runs: the corpora they train
on (`corpora`) and the quality experiment (`paper_quality`, run by
`benchmarks/paper_quality.py` and `notebooks/paper.ipynb`)."""
