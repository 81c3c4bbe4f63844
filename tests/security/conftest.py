"""Security regression tests: each one is an attack from a review, run against the real parts."""
