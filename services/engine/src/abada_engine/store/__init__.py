"""The engine's persistence layer: every SQL statement the engine runs lives in this package.

One module per table family (`tasks`, `journal_steps`, `incidents`, `history`, `instances`,
`definitions`, and `moves` for the one statement that moves a token across several of them), with
one named function per transition. Functions take the caller's connection, so the runtime decides
what shares a transaction; they return typed rows (dataclasses), never driver records. States are
the enums of `states`. Statements are SQLAlchemy Core unless `hand_written` explains otherwise.
"""
