"""The web console: Abada's operator and approver pages, served under /console/ on the engine's HTTP
port. It reads and acts only through the engine's public gRPC API, as the signed-in person."""

from .app import build_console
from .engine import Engine

__all__ = ["Engine", "build_console"]
