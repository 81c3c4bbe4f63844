"""A local endpoint speaking Gemini's generateContent REST API that plays scripted conversations.

The real `google-genai` client talks to it unchanged; see `server` for the routes, `script` for
the script format, `templates` for `{{...}}` references and `testing` for running it in tests.
"""

from scripted_gemini.script import (
    SUPPORT_TRIAGE_SCRIPT,
    ScriptBook,
    ScriptError,
    load_script_file,
    parse_script_text,
)
from scripted_gemini.server import build_app

__all__ = [
    "SUPPORT_TRIAGE_SCRIPT",
    "ScriptBook",
    "ScriptError",
    "build_app",
    "load_script_file",
    "parse_script_text",
]
