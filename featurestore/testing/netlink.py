"""A network link of a set speed between ``bench s3`` and its SeaweedFS server (``--link-gbit``): the
bench in a child process in a private network namespace, the S3 port's responses shaped by ``tc``
(HTB). Why and what it needs (Linux, root, iproute2): docs/STORAGE.md, "Over a network link".
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import subprocess
import traceback
from collections.abc import Callable
from typing import Any

from featurestore.errors import FeatureStoreError, InvalidOption

_CLONE_NEWNET = 0x40000000
_isolated = False


def isolated() -> bool:
    """Whether this process already runs in the private network namespace of :func:`run_isolated`."""
    return _isolated


def run_isolated(fn: Callable[[Any], Any], arg: Any) -> Any:
    """``fn(arg)`` in a spawned child process in a private network namespace; its return value.
    The child's output goes to this process's stdout and stderr."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise InvalidOption(f"--link-gbit needs iproute2's {' and '.join(missing)} on PATH (apt-get install "
                            "iproute2), or leave --link-gbit out")
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads yet, nothing inherited
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(fn, arg, sender), name="featurestore-bench-link")
    child.start()
    sender.close()
    try:
        status, value = receiver.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the bench's child process exited with code {child.exitcode} before it answered "
                           "(see its output above)") from None
    finally:
        receiver.close()
    child.join()
    if status == "refused":
        raise InvalidOption(value)
    if status == "raise":  # the bench's own one-line errors, as they would be without the link
        raise value
    if status == "error":
        raise RuntimeError(f"the bench failed in its child process:\n{value}")
    return value


def shape(port: int, gbit: float) -> str:
    """Shape the responses from TCP ``port`` on this namespace's loopback to ``gbit`` Gbit/s;
    a description of the link for the report."""
    if not _isolated:
        raise RuntimeError("shape() only runs inside run_isolated(): it changes the loopback it runs on")
    rate_bytes = gbit * 1e9 / 8
    burst = max(64 << 10, int(rate_bytes / 250))  # 4 ms of traffic: above a timer tick's worth at any rate
    for command in (
        "qdisc add dev lo root handle 1: htb default 10",
        "class add dev lo parent 1: classid 1:10 htb rate 400gbit",  # the rest of loopback: unshaped
        f"class add dev lo parent 1: classid 1:20 htb rate {gbit}gbit burst {burst} cburst {burst}",
        f"filter add dev lo parent 1: protocol ip u32 match ip sport {int(port)} 0xffff flowid 1:20",
    ):
        done = subprocess.run(["tc", *command.split()], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise InvalidOption(f"--link-gbit: `tc {command}` failed ({done.stderr.strip() or done.returncode}): "
                                "this kernel may lack HTB (CONFIG_NET_SCH_HTB); leave --link-gbit out")
    return f"{gbit:g} Gbit/s link (responses from the S3 port shaped by tc htb, private network namespace)"


def _child(fn: Callable[[Any], Any], arg: Any, sender: Any) -> None:
    global _isolated
    try:
        refusal = _enter_private_network()
        if refusal is not None:
            sender.send(("refused", refusal))
            return
        _isolated = True
        sender.send(("ok", fn(arg)))
    except FeatureStoreError as error:
        sender.send(("raise", error))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, which raises it
        sender.send(("error", traceback.format_exc()))
    finally:
        sender.close()


def _enter_private_network() -> str | None:
    """Move this (single-threaded) process into a new network namespace with its loopback up;
    the refusal's message if it may not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        return (f"--link-gbit needs root to make a private network namespace (unshare: {os.strerror(error)}): "
                "run the bench as root, or leave --link-gbit out")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)
    return None
