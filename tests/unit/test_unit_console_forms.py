"""Forms from a JSON Schema: what a person types is read back with the schema's types and checked
against it, each problem on its field, before anything is sent to the engine."""

from __future__ import annotations

from abada_engine.console import forms

SCHEMA = {
    "type": "object",
    "required": ["subject", "priority"],
    "properties": {
        "priority": {"type": "string", "enum": ["low", "high"]},
        "subject": {"type": "string", "minLength": 1, "description": "One line."},
        "amount": {"type": "number"},
        "count": {"type": "integer"},
        "notify": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
}


def fields_and(form: dict[str, str]) -> tuple[list[forms.Field], dict, list[str]]:
    fields = forms.fields_for(SCHEMA, {"subject": "Parcel", "priority": "high"})
    answers, readable = forms.read_answers(fields, {forms.PREFIX + k: v for k, v in form.items()})
    problems = forms.check(SCHEMA, answers, fields) if readable else []
    return fields, answers, problems


def test_fields_follow_the_schema_required_first() -> None:
    fields = forms.fields_for(SCHEMA, {"subject": "Parcel", "priority": "high"})
    assert [(f.name, f.kind, f.required) for f in fields] == [
        ("subject", "text", True),
        ("priority", "select", True),
        ("amount", "number", False),
        ("count", "integer", False),
        ("notify", "boolean", False),
        ("tags", "json", False),
    ]
    assert fields[1].options == ["low", "high"] and fields[0].description == "One line."


def test_answers_keep_their_types() -> None:
    _, answers, problems = fields_and(
        {
            "subject": "Lost",
            "priority": "low",
            "amount": "12.5",
            "count": "3",
            "notify": "true",
            "tags": '["a"]',
        }
    )
    assert problems == []
    assert answers == {
        "subject": "Lost",
        "priority": "low",
        "amount": 12.5,
        "count": 3,
        "notify": True,
        "tags": ["a"],
    }


def test_each_problem_lands_on_its_field() -> None:
    fields, _, _ = fields_and({"subject": "x", "priority": "high", "count": "two", "tags": "[oops"})
    by_name = {f.name: f for f in fields}
    assert by_name["count"].error == "a whole number"
    assert by_name["tags"].error.startswith("not JSON")
    fields, _, problems = fields_and({"subject": "", "priority": "urgent"})
    by_name = {f.name: f for f in fields}
    assert "non-empty" in by_name["subject"].error or "short" in by_name["subject"].error
    assert "is not one of" in by_name["priority"].error
    assert problems == []


def test_without_a_schema_the_proposed_types_are_kept() -> None:
    schema = forms.inferred_schema({"subject": "x", "count": 2, "urgent": False, "meta": {"a": 1}})
    assert schema["required"] == ["count", "meta", "subject", "urgent"]
    assert [schema["properties"][k]["type"] for k in ("subject", "count", "urgent", "meta")] == [
        "string",
        "integer",
        "boolean",
        "object",
    ]


def test_a_hostile_pattern_is_checked_in_linear_time() -> None:
    # Python's re would backtrack for minutes on this; the engine's checker runs patterns on RE2.
    schema = {"type": "object", "properties": {"subject": {"type": "string", "pattern": "^(a+)+$"}}}
    fields = forms.fields_for(schema, {"subject": ""})
    answers, _ = forms.read_answers(fields, {forms.PREFIX + "subject": "a" * 5000 + "!"})
    assert forms.check(schema, answers, fields) == []
    assert "does not match" in fields[0].error


def test_a_schema_that_names_something_to_fetch_fetches_nothing() -> None:
    schema = {"type": "object", "properties": {"subject": {"$ref": "http://127.0.0.1:9/schema.json"}}}
    fields = forms.fields_for(schema, {"subject": "x"})
    answers, readable = forms.read_answers(fields, {forms.PREFIX + "subject": '"x"'})
    assert readable and answers == {"subject": "x"}
    # Fails closed, without a network call.
    [problem] = forms.check(schema, answers, fields)
    assert "not resolved" in problem
