"""The service images: what the one Dockerfile builds for each SERVICE and what the chart runs from them.

No Docker daemon here, so the Dockerfile is read, not built: every COPY source must exist and
survive .dockerignore, the stages must be the ones the chart relies on (non-root 10001, stubs
generated in the build stage), and each ENTRYPOINT must be a console script the service declares
and the command the chart starts.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest
from chart_support import REPO_ROOT, only_container, render_set

SERVICES = {
    # service directory: (chart component, project name)
    "engine": ("engine", "abada-engine"),
    "credential-broker": ("broker", "abada-credential-broker"),
    "agent-worker": ("worker", "abada-agent-worker"),
}


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]


DOCKERFILE = REPO_ROOT / "Dockerfile"


def parse_dockerfile(
    text: str, build_args: dict[str, str] | None = None
) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults (overridden by `build_args`, as `--build-arg` does) and the stages, with line
    continuations joined and `${NAME}` replaced by the argument's value."""
    joined = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    stages: list[Stage] = []

    def expand(value: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)

    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(expand(parts[0]), name))
        elif keyword == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = (build_args or {}).get(key, default)
        elif stages:
            stages[-1].instructions.append((keyword, expand(rest)))
    return args, stages


def image_of(service: str) -> tuple[Stage, Stage]:
    """The build stage, and what `--build-arg SERVICE=service` makes the image from: the stages the
    last one stands on, their instructions in order, as one."""
    _, stages = parse_dockerfile(DOCKERFILE.read_text(), {"SERVICE": service})
    named = {stage.name: stage for stage in stages if stage.name}
    chain = [stages[-1]]
    while chain[-1].base in named:
        chain.append(named[chain[-1].base])
    image = Stage(chain[-1].base, stages[-1].name)
    for stage in reversed(chain):
        image.instructions += stage.instructions
    return named["build"], image


def dockerignore_patterns() -> list[tuple[bool, str]]:
    patterns = []
    for raw in (REPO_ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excluded = not line.startswith("!")
        patterns.append((excluded, line.lstrip("!").strip("/")))
    return patterns


def pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    index = 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            out += "(.*/)?"
            index += 3
        elif pattern.startswith("**", index):
            out += ".*"
            index += 2
        elif pattern[index] == "*":
            out += "[^/]*"
            index += 1
        elif pattern[index] == "?":
            out += "[^/]"
            index += 1
        elif pattern[index] == "[":
            end = pattern.index("]", index)
            out += pattern[index : end + 1]
            index = end + 1
        else:
            out += re.escape(pattern[index])
            index += 1
    return re.compile(f"^{out}$")


def ignored(path: str) -> bool:
    """Whether Docker leaves `path` out of the build context (moby's patternmatcher rules)."""
    parts = path.strip("/").split("/")
    result = False
    for excluded, pattern in dockerignore_patterns():
        regex = pattern_regex(pattern)
        # A pattern also matches everything below a directory it matches.
        match = any(regex.match("/".join(parts[:depth])) for depth in range(1, len(parts) + 1))
        if match:
            result = excluded
    return result


def context_files(source: str) -> list[str]:
    root = REPO_ROOT / source
    if root.is_file():
        return [source]
    return [str(p.relative_to(REPO_ROOT)) for p in root.rglob("*") if p.is_file()]


def test_the_matcher_reads_dockerignore_like_docker() -> None:
    # If the matcher ignored nothing, every context check below would pass for nothing.
    assert ignored(".venv/bin/python")
    assert ignored("api/python/abada/engine/v1/process_pb2.py")
    assert ignored("services/engine/src/abada_engine.egg-info/PKG-INFO")
    assert ignored("services/engine/src/abada_engine/__pycache__/x.cpython-311.pyc")
    assert not ignored("services/engine/src/abada_engine/__init__.py")
    assert not ignored("proto/abada/engine/v1/process.proto")


def test_one_dockerfile_has_a_stage_for_each_service_and_no_other() -> None:
    args, stages = parse_dockerfile(DOCKERFILE.read_text())
    assert args["SERVICE"] in SERVICES
    services = {stage.name.removeprefix("service-") for stage in stages if stage.name.startswith("service-")}
    projects = {p.parent.name for p in REPO_ROOT.glob("services/*/pyproject.toml")} - {"common"}
    assert services == set(SERVICES) == projects
    assert not list(REPO_ROOT.glob("services/*/Dockerfile")), "the root Dockerfile builds every service"


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_builds_stubs_then_runs_unprivileged(service: str) -> None:
    build, runtime = image_of(service)
    assert {build.base, runtime.base} == {"python:3.11-slim"}
    pinned = re.search(r"^grpcio-tools==(\S+)$", (REPO_ROOT / "requirements-dev.txt").read_text(), re.M)
    assert pinned is not None
    assert any(f"grpcio-tools=={pinned.group(1)}" in run for run in build.all("RUN"))
    assert any("scripts/gen_protos.py" in run for run in build.all("RUN"))
    assert any(
        "pip wheel" in run and "./api/python" in run and f"./services/{service}" in run
        for run in build.all("RUN")
    )
    # The runtime stage installs the wheels only, from the build stage, without an index.
    (install,) = [run for run in runtime.all("RUN") if "pip install" in run]
    assert "--no-index" in install and "from=build" in install
    assert runtime.all("USER") == ["10001:10001"]
    assert not runtime.all("COPY"), "the runtime stage takes nothing but the wheels"


@pytest.mark.parametrize("service", SERVICES)
def test_every_copied_source_is_in_the_build_context(service: str) -> None:
    build, image = image_of(service)
    copies = [shlex.split(c) for stage in (build, image) for c in stage.all("COPY")]
    assert copies
    for *sources, _destination in copies:
        for source in sources:
            assert not source.startswith("--"), f"COPY {source}: only the build context is copied"
            assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"
            files = context_files(source)
            sent = [f for f in files if not ignored(f)]
            assert sent, f"COPY {source}: .dockerignore leaves all of it out"
            if source.endswith("pyproject.toml"):
                assert sent == files


@pytest.mark.parametrize("service", SERVICES)
def test_the_entrypoint_is_the_services_script_and_the_charts_command(service: str) -> None:
    component, project = SERVICES[service]
    _, image = image_of(service)
    (entrypoint,) = image.all("ENTRYPOINT")
    (script,) = eval_exec_form(entrypoint)
    pyproject = tomllib.loads((REPO_ROOT / "services" / service / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == project
    assert script in pyproject["project"]["scripts"]
    (install,) = [run for run in image.all("RUN") if "pip install" in run]
    assert install.split()[-1] == project
    assert only_container(render_set("default").deployment_of(component))["command"] == [script]


def eval_exec_form(instruction: str) -> list[str]:
    words = re.findall(r'"([^"]*)"', instruction)
    assert instruction.startswith("[") and words, f"{instruction!r} is not in exec form"
    return words


def test_the_image_exposes_what_the_chart_probes() -> None:
    exposed = {}
    for service, (component, _) in SERVICES.items():
        _, image = image_of(service)
        exposed[component] = {int(p) for line in image.all("EXPOSE") for p in line.split()}
    release = render_set("default")
    for component, ports in exposed.items():
        container = only_container(release.deployment_of(component))
        assert {p["containerPort"] for p in container["ports"]} == ports
