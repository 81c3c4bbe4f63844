"""Global options anywhere on the line: `abada instances --token-file F` means `abada --token-file F instances`.

Click only reads a group's options before the subcommand. Before parsing, the group's own options
found after the subcommand are moved in front of it, unless that subcommand has an option of the
same name (then it is the subcommand's: `abada start --timeout 60` is how long `--wait` waits).
`--help` and `-h` after a subcommand stay with it: `abada start --help` is start's own help.
"""

from __future__ import annotations

from typing import Any


def _names(params: list[Any]) -> dict[str, bool]:
    """Each option name of `params`, mapped to whether it takes a value.

    Read by duck typing: newer typer vendors its own click, whose classes are not click's."""
    names: dict[str, bool] = {}
    for param in params:
        if getattr(param, "param_type_name", "") == "option":
            for name in (*param.opts, *param.secondary_opts):
                names[name] = not (param.is_flag or param.count)
    return names


def _width(arg: str, takes_value: bool) -> int:
    """How many words an option occupies: `--opt=value` and flags one, `--opt value` two."""
    return 1 if "=" in arg or not takes_value else 2


HELP_OPTIONS = ("-h", "--help")


def hoist(group: Any, ctx: Any, args: list[str]) -> list[str]:
    global_names = _names(group.get_params(ctx))
    for name in HELP_OPTIONS:
        global_names.pop(name, None)  # before the command they are the group's anyway: click reads them
    front: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--" or not arg.startswith("-"):
            break
        name = arg.split("=", 1)[0]
        step = _width(arg, global_names.get(name, False))
        front += args[index : index + step]
        index += step
    if index >= len(args) or args[index] == "--":
        return args
    command_name = args[index]
    command = group.get_command(ctx, command_name)
    own = _names(command.params) if command is not None else {}
    # A group of commands (`abada batch ...`): an option any of its commands has is that command's.
    for sub in (getattr(command, "commands", None) or {}).values():
        own = {**_names(sub.params), **own}
    rest: list[str] = []
    position = index + 1
    while position < len(args):
        arg = args[position]
        if arg == "--":
            rest += args[position:]
            break
        name = arg.split("=", 1)[0]
        if name in global_names and name not in own:
            step = _width(arg, global_names[name])
            front += args[position : position + step]
            position += step
            continue
        step = _width(arg, own.get(name, False)) if name in own else 1
        rest += args[position : position + step]
        position += step
    return [*front, command_name, *rest]
