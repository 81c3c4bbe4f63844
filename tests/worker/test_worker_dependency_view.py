"""What one worker process believes is down: an outage is logged once; a call that was already on its
way when the dependency came back does not open a second one, nor does the engine's word that it is
up end one before the engine has heard of it."""

from __future__ import annotations

import logging
import time

from abada_worker.dependencies import _ProcessView, model

GEMINI = model("gemini-3.6-flash")


def outage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "abada_worker.dependencies"]


def test_a_late_failure_of_a_call_sent_before_the_dependency_came_back_is_not_a_new_outage(caplog):
    caplog.set_level(logging.WARNING)
    view = _ProcessView()
    sent_during_the_outage = time.monotonic() - 1.0
    view.failed(GEMINI, "503", sent_during_the_outage)
    view.engine_heard(GEMINI)  # the engine answered the report of that failure
    assert view.forget(GEMINI)  # then: another worker's probe got through
    view.failed(GEMINI, "503", sent_during_the_outage)  # a slow call of the outage answers late
    assert not view.is_down(GEMINI)
    assert outage_lines(caplog) == ["dependency down", "dependency back"]


def test_a_failure_of_a_call_sent_after_the_dependency_came_back_is_a_new_outage(caplog):
    caplog.set_level(logging.WARNING)
    view = _ProcessView()
    view.failed(GEMINI, "503", time.monotonic())
    view.answered(GEMINI, time.monotonic())
    view.failed(GEMINI, "503 again", time.monotonic())
    assert view.is_down(GEMINI)
    assert outage_lines(caplog) == ["dependency down", "dependency back", "dependency down"]


def test_a_success_of_a_call_sent_before_the_outage_was_seen_proves_nothing(caplog):
    caplog.set_level(logging.WARNING)
    view = _ProcessView()
    sent_before = time.monotonic() - 1.0
    view.failed(GEMINI, "503", time.monotonic())
    view.answered(GEMINI, sent_before)
    assert view.is_down(GEMINI)
    assert outage_lines(caplog) == ["dependency down"]


def test_the_engine_saying_up_before_it_heard_of_the_outage_does_not_end_it(caplog):
    """At an outage's start, a task held back by this worker's view may ask the engine before the
    report of the failure that holds it back arrives: the engine's "up" is older news."""
    caplog.set_level(logging.WARNING)
    view = _ProcessView()
    view.failed(GEMINI, "503", time.monotonic())
    assert not view.forget(GEMINI)
    assert view.is_down(GEMINI)
    view.engine_heard(GEMINI)
    assert view.forget(GEMINI)
    assert not view.is_down(GEMINI)
    assert outage_lines(caplog) == ["dependency down", "dependency back"]
