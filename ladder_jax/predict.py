"""`python -m ladder_jax.predict`: the command line of the performance model,
`ladder_jax.perfmodel` (its docstring is the spec).

The code lives in `perfmodel` so that the name `predict` on the package stays the notebook
call, `lj.predict(...)`: importing a submodule named `predict` would replace that function.
"""

import sys

from ladder_jax.perfmodel import main

if __name__ == "__main__":
    sys.exit(main())
