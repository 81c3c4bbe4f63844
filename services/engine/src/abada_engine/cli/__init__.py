"""The `abada` command line: a pure client of the engine's gRPC API."""
