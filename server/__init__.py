"""The HTTP face of a featurestore: ``create_app(store_url=None, settings=None)``.

Needs the ``server`` extra (fastapi, uvicorn, pydantic-settings, prometheus-client); never
imports torch.
"""

from __future__ import annotations

from server.app import app_from_env, create_app
from server.settings import Settings

__all__ = ["Settings", "app_from_env", "create_app"]
