"""Static checks of docker/: the compose files' structure, the server's and the extraction job's
command lines (accepted by the CLI's own parser), and the Dockerfile's contract (SPEC.md). Fast and docker-free; tests/docker/run.sh builds and runs all of it for real.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from _docker_paths import COMPOSE, COMPOSE_TEST, DOCKER, DOCKERFILE, REPO, STANDIN_DOCKERFILE


yaml = pytest.importorskip("yaml")


SERVER_SETTINGS_ENV = {
    "FEATURESTORE_STORE",
    "FEATURESTORE_TOKEN",
    "FEATURESTORE_STORAGE_OPTIONS",
    "FEATURESTORE_MAX_RESPONSE_BYTES",
}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def compose_expand(value: str, env: dict[str, str] | None = None) -> str:
    """Compose-file interpolation as docker compose does it: ``${VAR:-default}``, ``$$``."""
    env = env or {}

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        if match.group(3) is not None:
            value = env.get(name)
            return match.group(3) if (value is None or (match.group(2) and not value)) else value
        return env.get(name, "")

    return _VAR.sub(sub, value)


def shell_expand(value: str, env: dict[str, str]) -> str:
    """What ``sh`` does to ``$VAR`` / ``${VAR}`` / ``${VAR:-x}`` (enough for these commands)."""
    return _VAR.sub(
        lambda m: (env.get(m.group(1) or m.group(4)) or (m.group(3) or "")) if m.group(0) != "$$" else "$",
        value,
    )


def load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def override() -> dict:
    return load(COMPOSE_TEST)


def env_of(service: dict) -> dict[str, str]:
    """The service's environment after compose interpolation with an empty host environment."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: compose_expand(str(v)) for k, v in environment.items()}


def published(service: dict) -> dict[int, int]:
    """{container port: host port} with compose defaults applied."""
    ports = {}
    for entry in service.get("ports", []):
        host, container = compose_expand(str(entry)).rsplit(":", 1)
        ports[int(container)] = int(host.rsplit(":", 1)[-1])
    return ports


# --------------------------------------------------------------------------------- compose.yaml
def test_services_and_profiles(compose):
    services = compose["services"]
    assert {"minio", "createbucket", "server", "extract"} <= set(services)
    assert services["minio"]["image"].startswith("minio/minio")
    assert services["createbucket"]["image"].startswith("minio/mc")
    assert services["extract"]["profiles"] == ["extract"]
    for name, service in services.items():
        if name != "extract":
            assert "profiles" not in service, f"{name} must start with a plain `up`"
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert spec["condition"] in {
                "service_started", "service_healthy", "service_completed_successfully"
            }
    assert published(services["minio"])[9000] == 9000
    assert published(services["server"])[8000] == 8000
    assert services["server"]["depends_on"]  # the bucket (and the store root) exist first


def test_every_variable_has_a_default():
    text = COMPOSE.read_text(encoding="utf-8") + COMPOSE_TEST.read_text(encoding="utf-8")
    for match in re.finditer(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)([^}]*)\}", text):
        assert match.group(2).startswith((":-", "-")), f"${{{match.group(1)}}} has no default"


@pytest.mark.parametrize("name,target", [("server", "server"), ("extract", "extract")])
def test_builds(compose, name, target):
    service = compose["services"][name]
    build = service["build"]
    assert build["target"] == target
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert build["network"] == "host"
    assert build["args"]["BASE_IMAGE"] == "${BASE_IMAGE:-python:3.12-slim}"
    assert service["init"] is True


def test_extract_build_uses_the_cpu_torch_index(compose):
    args = compose["services"]["extract"]["build"]["args"]
    assert compose_expand(args["TORCH_INDEX_URL"]) == "https://download.pytorch.org/whl/cpu"
    assert compose_expand(args["TORCH_FIND_LINKS"]) == ""
    assert compose_expand(args["TORCH_INDEX_URL"], {"TORCH_INDEX_URL": "https://x/simple"}) == (
        "https://x/simple"
    )


def test_server_environment_matches_the_settings(compose):
    env = env_of(compose["services"]["server"])
    featurestore_env = {k for k in env if k.startswith("FEATURESTORE_")}
    assert featurestore_env == SERVER_SETTINGS_ENV
    assert env["FEATURESTORE_STORE"] == "s3://featurestore/store"
    options = json.loads(env["FEATURESTORE_STORAGE_OPTIONS"])
    assert options == {"endpoint_url": "http://minio:9000"}
    assert env["AWS_ACCESS_KEY_ID"] == "minioadmin" and env["AWS_SECRET_ACCESS_KEY"] == "minioadmin"
    assert int(env["FEATURESTORE_MAX_RESPONSE_BYTES"]) == 268435456
    assert env["FEATURESTORE_TOKEN"] == ""  # empty = no auth, as server/settings.py reads it
    # Same credentials as MinIO's root user, whatever the user sets.
    user_env = {"MINIO_ROOT_USER": "u", "MINIO_ROOT_PASSWORD": "p"}
    minio_env = compose["services"]["minio"]["environment"]
    server_env = compose["services"]["server"]["environment"]
    assert compose_expand(server_env["AWS_ACCESS_KEY_ID"], user_env) == compose_expand(
        minio_env["MINIO_ROOT_USER"], user_env
    )
    assert compose_expand(server_env["AWS_SECRET_ACCESS_KEY"], user_env) == compose_expand(
        minio_env["MINIO_ROOT_PASSWORD"], user_env
    )


def test_settings_know_every_variable(compose):
    settings = pytest.importorskip("server.settings")
    fields = {f"FEATURESTORE_{name.upper()}" for name in settings.Settings.model_fields}
    assert SERVER_SETTINGS_ENV <= fields
    env = env_of(compose["services"]["server"])
    parsed = settings.Settings(
        store=env["FEATURESTORE_STORE"],
        storage_options=json.loads(env["FEATURESTORE_STORAGE_OPTIONS"]),
        max_response_bytes=int(env["FEATURESTORE_MAX_RESPONSE_BYTES"]),
        token=env["FEATURESTORE_TOKEN"],
    )
    assert parsed.token_value() is None


def test_server_command_is_accepted_by_the_cli(compose):
    from featurestore.cli import build_parser

    service = compose["services"]["server"]
    command = [compose_expand(str(part)) for part in service["command"]]
    assert "entrypoint" not in service  # exec form, straight to featurestore (PID 1 under init)
    assert command[0] == "featurestore"
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve"
    assert args.url == env_of(service)["FEATURESTORE_STORE"]
    assert args.host == "0.0.0.0"
    assert args.port == 8000 and args.workers == 1
    more = [compose_expand(str(p), {"FEATURESTORE_WORKERS": "4"}) for p in service["command"]]
    assert build_parser().parse_args(more[1:]).workers == 4


def test_server_healthcheck(compose):
    service = compose["services"]["server"]
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and "python" in test[1]
    assert "http://127.0.0.1:8000/healthz" in " ".join(test)
    assert "curl" not in " ".join(test)


def test_extract_command_is_accepted_by_the_cli(compose):
    from featurestore.cli import build_parser

    service = compose["services"]["extract"]
    assert service["entrypoint"][0] == "/bin/sh"
    script = compose_expand(service["command"][0])
    env = env_of(service)
    exec_part = script.split("exec ", 1)[1]
    argv = [shell_expand(word, env) for word in shlex.split(exec_part)]
    assert argv[0] == "featurestore"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "extract"
    assert args.store == env["FEATURESTORE_STORE"] == "s3://featurestore/store"
    assert args.images == "pannuke:/tmp/pannuke"
    assert args.encoder == "builtin:tiny-vit"
    assert args.device == "cpu"
    assert (args.dataset, args.split) == ("pannuke-synthetic", "fold1")
    # The synthetic fold it writes first comes from the generator the CLI documents.
    assert "make_synthetic_pannuke" in script and "/tmp/pannuke" in script
    synthetic = pytest.importorskip("featurestore.demo.synthetic")
    assert callable(synthetic.make_synthetic_pannuke)


def test_initstore_prepares_the_store_with_the_server_image(compose):
    services = compose["services"]
    init = services["initstore"]
    assert init["build"] == services["server"]["build"]
    assert services["server"]["depends_on"]["initstore"]["condition"] == (
        "service_completed_successfully"
    )
    assert env_of(init)["FEATURESTORE_STORE"] == env_of(services["server"])["FEATURESTORE_STORE"]
    assert 'mode="a"' in " ".join(init["command"])


# ---------------------------------------------------------------------------- compose.test.yaml
def test_override_swaps_only_the_object_store(compose, override):
    services = override["services"]
    assert set(services) == {"minio", "createbucket"}
    for name, service in services.items():
        build = service["build"]
        assert (COMPOSE_TEST.parent / build["context"] / build["dockerfile"]).resolve() == (
            STANDIN_DOCKERFILE
        )
        assert build["network"] == "host"
        assert build["args"]["BASE_IMAGE"] == "${BASE_IMAGE:-python:3.12-slim}"
        assert not service["image"].startswith("minio/"), f"{name} would be tagged as MinIO's"
    minio = services["minio"]
    assert minio["entrypoint"] == ["moto_server"]
    assert minio["command"] == ["-H", "0.0.0.0", "-p", "9000"]
    assert "ports" not in minio  # the base file's 9000 stays as is
    assert "healthcheck" in minio  # createbucket waits for service_healthy
    assert "featurestore" in services["createbucket"]["command"][0]


# ------------------------------------------------------------------------------------ Dockerfile
def _stages(text: str) -> dict[str, str]:
    stages, name, lines = {}, None, []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            if name is not None:
                stages[name] = "\n".join(lines)
            name, lines = (match.group(1) or f"stage{len(stages)}").lower(), []
        lines.append(line)
    stages[name] = "\n".join(lines)
    return stages


def test_dockerfile_contract():
    text = DOCKERFILE.read_text(encoding="utf-8")
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert instructions[0] == "ARG BASE_IMAGE=python:3.12-slim"
    assert "FROM ${BASE_IMAGE} AS base" in text
    assert not re.search(r"^#\s*syntax=", text, re.MULTILINE)  # no frontend pulled from a registry
    assert not any(i.startswith("RUN --mount") for i in instructions)  # classic builder too
    # Nothing depends on Python 3.12 beyond the default base image.
    code = "\n".join(instructions[1:])
    assert "3.12" not in code
    assert not re.search(r"python3\.\d+", code)
    stages = _stages(text)
    assert {"base", "server", "extract"} <= set(stages)
    server = stages["server"]
    assert re.search(r"^USER\s+(?!root|0\b)\S+", server, re.MULTILINE)
    assert "HEALTHCHECK" in server and "/healthz" in server and "curl" not in server
    assert re.search(r'^CMD \["', server, re.MULTILINE)  # exec form
    assert "featurestore serve" in server and "--host 0.0.0.0" in server
    assert "--port 8000" in server
    # The server's pip installs never mention torch; the extract build does, from an ARG index.
    server_build = stages["deps"] + stages["build-server"]
    assert "ARG SERVER_EXTRAS=server,s3" in text and 'pip install ".[${SERVER_EXTRAS}]"' in server_build
    assert not re.search(r"pip install[^\n]*torch", server_build)
    extract_build = stages["extract"]
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in extract_build
    assert "--index-url" in extract_build and "TORCH_FIND_LINKS" in extract_build
    assert re.search(r"^USER\s+(?!root|0\b)\S+", stages["extract"], re.MULTILINE)
    # Debian's Python refuses system pip installs: a venv is made before pip runs.
    assert "python3 -m venv /opt/venv" in stages["deps"]


def test_standin_dockerfile_uses_the_same_base():
    text = STANDIN_DOCKERFILE.read_text(encoding="utf-8")
    assert "ARG BASE_IMAGE=python:3.12-slim" in text and "FROM ${BASE_IMAGE}" in text
    assert "moto[server]" in text and "python3 -m venv" in text


def test_dockerignore_keeps_the_context_small():
    text = (REPO / ".dockerignore").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"  # allow-list
    assert {"!pyproject.toml", "!featurestore/", "!server/", "!client/"} <= set(lines)
    assert not any(line.startswith("!.venv") or line.startswith("!.git") for line in lines)


# ------------------------------------------------------------------- docker-compose, if present
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_v1_accepts_the_files():
    for files in (["compose.yaml"], ["compose.yaml", "compose.test.yaml"]):
        argv = ["docker-compose", "--profile", "extract"]
        for f in files:
            argv += ["-f", str(DOCKER / f)]
        result = subprocess.run(argv + ["config", "-q"], capture_output=True, text=True,
                                timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert result.returncode == 0, result.stderr
