"""`python -m abada_broker`: the same as the `abada-broker` command."""

from abada_broker.main import main

main()
