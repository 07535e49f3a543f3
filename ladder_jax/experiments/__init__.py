"""Experiments that reproduce the paper's claims at a scale a CPU runs: `corpora`,
`paper_quality` (`benchmarks/paper_quality.py`) and `adaptation` (a real pretrained model)."""
