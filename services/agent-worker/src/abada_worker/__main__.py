"""`python -m abada_worker`: the same as the `abada-worker` console script."""

from .main import main

main()
