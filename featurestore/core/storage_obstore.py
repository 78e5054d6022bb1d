"""Deprecated import path: the obstore backend lives in :mod:`featurestore.core.storage.obstore`
(its client, requests and errors in :mod:`featurestore.core.storage.obstore_client`)."""

from featurestore.core.storage.io_loop import run, settled
from featurestore.core.storage.obstore import MULTIPART_BYTES, PART_BYTES, STREAM_PIECE_BYTES, ObjectStorage
from featurestore.core.storage.obstore_client import plan_requests

__all__ = ["MULTIPART_BYTES", "PART_BYTES", "STREAM_PIECE_BYTES", "ObjectStorage", "plan_requests", "run", "settled"]
