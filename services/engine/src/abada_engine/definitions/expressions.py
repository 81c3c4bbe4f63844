"""`${path}` references into process variables, and CEL conditions over them."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import celpy
import celpy.celtypes
import celpy.evaluation
import lark

_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*$")
_SEGMENT = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


class ExpressionError(Exception):
    """A reference or condition could not be evaluated against the variables."""


def reference_syntax_errors(text: str) -> list[str]:
    """The malformed `${...}` references in a template, for deploy-time validation."""
    return [
        f"bad reference ${{{path}}}" for path in _REFERENCE.findall(text) if not _PATH.match(path.strip())
    ]


def lookup(variables: Mapping[str, Any], path: str) -> Any:
    value: Any = variables
    for name, index in _SEGMENT.findall(path.strip()):
        if name:
            if not isinstance(value, Mapping) or name not in value:
                raise ExpressionError(f"variable ${{{path}}} is not set")
            value = value[name]
        else:
            if not isinstance(value, list) or int(index) >= len(value):
                raise ExpressionError(f"variable ${{{path}}} is out of range")
            value = value[int(index)]
    return value


def render(template: Any, variables: Mapping[str, Any]) -> Any:
    """Resolve references in a template value.

    A string that is exactly one reference keeps the referenced JSON type; a
    reference inside other text is interpolated (non-strings as compact JSON).
    Lists and mappings are rendered element by element.
    """
    if isinstance(template, str):
        whole = _REFERENCE.fullmatch(template.strip())
        if whole:
            return lookup(variables, whole.group(1))

        def interpolate(match: re.Match[str]) -> str:
            value = lookup(variables, match.group(1))
            return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))

        return _REFERENCE.sub(interpolate, template)
    if isinstance(template, list):
        return [render(item, variables) for item in template]
    if isinstance(template, Mapping):
        return {key: render(value, variables) for key, value in template.items()}
    return template


def render_prompt(
    prompt: str, inputs: Mapping[str, Any], variables: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The prompt with every `${path}` turned into a pointer to an input, and the inputs it points to.

    A variable's value is data (a customer's message, a model's answer) and may be written to steer
    the model, so it never goes into the instructions: the prompt names the input that carries it,
    and the value travels in `inputs`, which the worker sends as escaped, delimited `<input>` blocks.
    Only names from the definition reach the prompt text.
    """
    pointed = dict(inputs)

    def pointer(match: re.Match[str]) -> str:
        path = match.group(1).strip()
        value = lookup(variables, path)
        name = path
        if name in pointed and pointed[name] != value:
            # The definition's own inputs use this name for something else; keep both.
            name = f"prompt.{path}"
        pointed[name] = value
        return f'[input "{name}"]'

    return _REFERENCE.sub(pointer, prompt), pointed


_CEL_ENV = celpy.Environment()

# Limits on conditions. A condition is written by whoever deploys, but evaluated on variables a worker
# or a model wrote, so its cost must be bounded whatever the data: short, shallow, and at most two
# comprehensions deep (each level multiplies the work by the length of a list), and it is stopped
# once it has run for its time budget.
MAX_CONDITION_CHARS = 1_000
MAX_NESTING = 12
MAX_COMPREHENSION_NESTING = 2
CONDITION_BUDGET_SECONDS = 0.5
MAX_CONDITION_VALUES = 10_000
_COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter"})


def cel_syntax_error(expression: str) -> str | None:
    """Why a condition cannot be deployed (syntax or limits); None when it can."""
    try:
        _compile(expression)
    except ExpressionError as error:
        return str(error)
    return None


def _compile(expression: str) -> lark.Tree:
    if len(expression) > MAX_CONDITION_CHARS:
        raise ExpressionError(f"the condition is longer than {MAX_CONDITION_CHARS} characters")
    try:
        ast = _CEL_ENV.compile(expression)
    except celpy.CELParseError as error:
        raise ExpressionError(f"invalid CEL: {' '.join(str(error).split())}") from None
    nesting, comprehensions = _depths(ast)
    if nesting > MAX_NESTING:
        raise ExpressionError(f"the condition nests deeper than {MAX_NESTING} levels")
    if comprehensions > MAX_COMPREHENSION_NESTING:
        raise ExpressionError(
            f"the condition nests comprehensions (all, exists, exists_one, map, filter) "
            f"deeper than {MAX_COMPREHENSION_NESTING}"
        )
    return ast


def _depths(ast: lark.Tree) -> tuple[int, int]:
    """How deeply sub-expressions nest, and how deeply comprehensions nest (iteratively: no recursion)."""
    deepest = deepest_comprehension = 0
    stack: list[tuple[lark.Tree, int, int]] = [(ast, 0, 0)]
    while stack:
        tree, nesting, comprehensions = stack.pop()
        if tree.data == "expr":
            nesting += 1
        if tree.data == "member_dot_arg" and any(
            isinstance(child, lark.Token) and child.value in _COMPREHENSIONS for child in tree.children
        ):
            comprehensions += 1
        deepest = max(deepest, nesting)
        deepest_comprehension = max(deepest_comprehension, comprehensions)
        stack.extend(
            (child, nesting, comprehensions) for child in tree.children if isinstance(child, lark.Tree)
        )
    return deepest, deepest_comprehension


class _OutOfTime(Exception):
    pass


class _BudgetedEvaluator(celpy.evaluation.Evaluator):
    """celpy's tree-walking evaluator, stopped once its deadline passes (checked at every node)."""

    def __init__(self, ast: lark.Tree, activation: celpy.evaluation.Activation, deadline: float) -> None:
        super().__init__(ast, activation)
        self._deadline = deadline

    def visit_children(self, tree: lark.Tree) -> list[Any]:
        if time.monotonic() > self._deadline:
            raise _OutOfTime
        return super().visit_children(tree)

    def sub_evaluator(self, ast: lark.Tree) -> celpy.evaluation.Evaluator:
        # Comprehension bodies run in sub-evaluators; they share the deadline.
        return _BudgetedEvaluator(ast, self.activation, self._deadline)


@lru_cache(maxsize=1024)
def _identifiers(expression: str) -> frozenset[str]:
    return frozenset(
        str(tree.children[0]) for tree in _program(expression).ast.find_data("ident") if tree.children
    )


def _count_values(value: Any, limit: int) -> int:
    """How many JSON values `value` holds, counting stops a little past `limit`."""
    count = 0
    stack = [value]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


@lru_cache(maxsize=1024)
def _program(expression: str) -> celpy.InterpretedRunner:
    # Checked again here, not only at deploy: a definition frozen before a limit existed obeys it too.
    return celpy.InterpretedRunner(_CEL_ENV, _compile(expression))


def evaluate_condition(
    expression: str, variables: Mapping[str, Any], budget_seconds: float = CONDITION_BUDGET_SECONDS
) -> bool:
    """Evaluate a condition within its time budget; call it off the event loop (it is CPU work)."""
    program = _program(expression)
    names = _identifiers(expression)
    used = {name: value for name, value in variables.items() if name in names}
    # Converting values to CEL cannot be interrupted, so what a condition may look at is bounded first.
    if _count_values(used, MAX_CONDITION_VALUES) > MAX_CONDITION_VALUES:
        raise ExpressionError(
            f"condition {expression!r} reads variables holding more than {MAX_CONDITION_VALUES} values"
        )
    activation = {name: celpy.json_to_cel(value) for name, value in used.items()}
    evaluator = _BudgetedEvaluator(program.ast, program.new_activation(), time.monotonic() + budget_seconds)
    try:
        result = evaluator.evaluate(activation)
    except _OutOfTime:
        raise ExpressionError(
            f"condition {expression!r} ran longer than its {budget_seconds:g} s budget and was stopped"
        ) from None
    except celpy.CELEvalError as error:
        cause = error.args[1].__name__ if len(error.args) > 1 and isinstance(error.args[1], type) else ""
        detail = error.args[2] if len(error.args) > 2 else ""
        raise ExpressionError(f"condition {expression!r} failed: {cause} {detail}".strip()) from None
    except RecursionError:
        raise ExpressionError(f"condition {expression!r} nests too deeply to evaluate") from None
    if not isinstance(result, (bool, celpy.celtypes.BoolType)):
        raise ExpressionError(f"condition {expression!r} gave {type(result).__name__}, not a bool")
    return bool(result)
