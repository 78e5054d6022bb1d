"""The layers of docs/ARCHITECTURE.md, enforced: what each layer may import, at import time.

Each case imports every module of one layer in a fresh interpreter and lists which forbidden
top-level packages ended up in ``sys.modules``. A fresh process is the only honest way to see
this: the test process itself has imported everything already.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# layer -> packages it must not pull in when all its modules are imported
FORBIDDEN = {
    "featurestore.format": ["torch", "client", "server", "fastapi", "featurestore.core",
                            "featurestore.extract", "featurestore.probes", "featurestore.bench", "featurestore.testing"],
    "featurestore.core": ["torch", "client", "server", "fastapi", "featurestore.extract",
                          "featurestore.probes", "featurestore.demo", "featurestore.bench", "featurestore.testing"],
    "client": ["server", "fastapi", "uvicorn", "featurestore.extract", "featurestore.probes",
               "featurestore.demo", "featurestore.bench", "featurestore.testing"],
    "server": ["torch", "client", "featurestore.extract", "featurestore.probes", "featurestore.demo",
               "featurestore.bench", "featurestore.testing"],
    "featurestore.extract": ["client", "server", "fastapi", "featurestore.probes", "featurestore.demo",
                             "featurestore.bench", "featurestore.testing"],
    # torch only for python: slide encoders, when one is loaded
    "featurestore.embed": ["torch", "client", "server", "fastapi", "featurestore.probes", "featurestore.demo",
                           "featurestore.bench", "featurestore.testing"],
}

CHILD = r"""
import importlib, json, pkgutil, sys
layer, forbidden = sys.argv[1], json.loads(sys.argv[2])
package = importlib.import_module(layer)
names = [layer] + [m.name for m in pkgutil.walk_packages(package.__path__, layer + ".")]
for name in names:
    importlib.import_module(name)
loaded = sorted(f for f in forbidden if f in sys.modules)
print(json.dumps({"modules": names, "forbidden_loaded": loaded}))
"""


def _layer_modules(layer: str) -> list[str]:
    path = REPO.joinpath(*layer.split("."))
    return [m.name for m in pkgutil.walk_packages([str(path)], layer + ".")]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_stay_inside_its_layer(layer: str) -> None:
    result = subprocess.run([sys.executable, "-c", CHILD, layer, json.dumps(FORBIDDEN[layer])],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["modules"][1:] == _layer_modules(layer)  # every module of the layer was imported
    assert out["forbidden_loaded"] == [], (
        f"importing {layer} pulled in {out['forbidden_loaded']}: see docs/ARCHITECTURE.md for the layers")


def test_the_checker_sees_a_violation() -> None:
    # The check above must be able to fail: importing the probes layer does load the client.
    result = subprocess.run([sys.executable, "-c", CHILD, "featurestore.probes", json.dumps(["client", "torch"])],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "torch" in out["forbidden_loaded"]
