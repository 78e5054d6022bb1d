"""numpy's BLAS on one thread in a server process (``FEATURESTORE_UI_BLAS_THREADS``, default 1).

The pictures' products are skinny (``[1024, 3072] @ [3072, 8]``) and memory-bound: a second BLAS
thread gains little on an idle machine, and on a busy one OpenBLAS's threads wait on each other.
Measured on a shared 2-core VM (load average 7-10): the
components of a ``[1024, 3072]`` sample took a median 217-654 ms with OpenBLAS's default 2
threads and 53-78 ms with one, in four runs (docs/SERVER.md, "The web page"). The server computes up to
``FEATURESTORE_UI_PICTURES_AT_ONCE`` pictures side by side anyway; that is where its cores go.
Nothing else in the server uses BLAS.

The limit is process-wide and is set once, by the process's entry point (``featurestore serve``,
``server.app:app_from_env``), never by ``create_app``: an application that builds the app
in-process keeps its own BLAS settings. threadpoolctl (in the ``server`` extra) sets it; it lets
only one Python thread change OpenBLAS's limits, which is why this is done once at start-up and
not around each picture.
"""

from __future__ import annotations


def limit_blas_threads(threads: int) -> bool:
    """Set numpy's BLAS to ``threads`` threads for this process; False when threadpoolctl is
    missing (pictures then run with the default threads) or ``threads`` is 0 (leave it)."""
    if threads <= 0:
        return False
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    threadpool_limits(limits=threads, user_api="blas")
    return True
