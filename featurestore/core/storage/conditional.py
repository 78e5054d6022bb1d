"""Conditional writes for the storage backends: create-if-absent and replace-if-unchanged, the
atomic primitive ``--worker`` claims rest on (featurestore.core.claims). ``LocalStorage`` and
``ObjectStorage`` expose them as ``put_if_absent`` / ``read_versioned`` / ``replace_if``; a
*token* names one version of a key and changes with every write.

* Local disks and NFS: a create is a finished temp file hard-linked to the name (``link`` fails
  when the name exists, on NFS too), so nobody sees a half-written file; a replace checks the
  token (inode, mtime, size) and renames a fresh file over the name while holding a POSIX record
  lock (``lockf``: honoured over NFS, released when the process dies) on one ``.lock`` file per
  directory.
* Object stores (obstore): ``PUT`` with ``If-None-Match: *`` (create) and ``If-Match: <etag>``
  (replace); the server enforces them. SeaweedFS and moto do (tests/test_workers.py); a server
  that ignores them is caught by ``claims.probe`` before any claim.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from featurestore.format.names import tmp_name

__all__ = ["local_put_if_absent", "local_read_versioned", "local_replace_if", "object_put",
           "object_read_versioned"]


def _token(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _write_temp(path: str, data: bytes) -> str:
    """A finished file beside ``path`` under storage.temp_path's naming (a resume's clean-up of
    killed writers' leftovers, core.leftovers, knows it)."""
    tmp = os.path.join(os.path.dirname(path), tmp_name(os.path.basename(path), os.getpid(), uuid.uuid4().hex[:8]))
    with open(tmp, "wb") as f:
        f.write(data)
    return tmp


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def local_put_if_absent(path: str, data: bytes) -> str | None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _write_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return None
    finally:
        unlink_quietly(tmp)
    return _token(os.stat(path))


def local_read_versioned(path: str) -> tuple[bytes, str]:
    with open(path, "rb") as f:
        return f.read(), _token(os.fstat(f.fileno()))


def local_replace_if(path: str, data: bytes, token: str) -> str | None:
    import fcntl

    fd = os.open(os.path.join(os.path.dirname(path), ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        try:
            if _token(os.stat(path)) != token:
                return None
        except FileNotFoundError:
            return None
        tmp = _write_temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        return _token(os.stat(path))
    finally:
        os.close(fd)  # releases the lock


def object_put(store: Any, key: str, data: bytes, mode: Any, error: Callable[[BaseException, str, str], BaseException]
               ) -> str | None:
    """``mode``: "create" or ``{"e_tag": token}``; None when the server refused the condition."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

    try:
        result = obstore.put(store, key, data, mode=mode, use_multipart=False)
    except (AlreadyExistsError, PreconditionError, NotFoundError, FileNotFoundError):
        return None
    except Exception as exc:  # noqa: BLE001
        raise error(exc, key, "PUT") from None
    return str(result["e_tag"])


def object_read_versioned(store: Any, key: str, error: Callable[[BaseException, str, str], BaseException]
                          ) -> tuple[bytes, str]:
    import obstore

    try:
        result = obstore.get(store, key)
        return bytes(result.bytes()), str(result.meta["e_tag"])
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise error(exc, key, "GET") from None
