"""How a process moves: the navigator over a definition's nodes, token moves, the output contract."""
