"""A whole Abada on one machine: what `abada dev` runs and `make demo` narrates.

`processes` starts and stops the services as child processes, `identities` writes the callers
and tokens that let them talk to one another, `stack` puts them together.
"""
