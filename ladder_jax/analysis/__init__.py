"""Analysis of compiled GPU programs, without a GPU: what gets compiled (`programs`), THE reader of
scheduled HLO (`hlo`), the overlap report (`overlap`) and the performance model (`perfmodel`)."""
