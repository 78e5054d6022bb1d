"""Where the docker files are, and tests/docker/wheelhouse.py loaded once for the tests that
check them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_TEST = DOCKER / "compose.test.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
STANDIN_DOCKERFILE = DOCKER / "Dockerfile.s3-standin"
RUN_SH = REPO / "tests" / "docker" / "run.sh"


def _load_wheelhouse():
    """tests/docker/wheelhouse.py (a script beside run.sh, not a package module)."""
    spec = importlib.util.spec_from_file_location("docker_wheelhouse", RUN_SH.parent / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


wheelhouse = _load_wheelhouse()
