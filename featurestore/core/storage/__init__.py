"""Key-value access to a store root: the interface, its backends, the factory and the chunk cache.

Layers inside the package, each importing only the ones below it:

* :mod:`.base` (the :class:`Storage` interface), :mod:`.files` (local file writes),
  :mod:`.process` (``pid_alive``), :mod:`.lock_files` (lock files a forked child lets go),
  :mod:`.options` (``storage_options`` -> obstore settings),
  :mod:`.io_loop` (the object-storage event loop);
* the backends: :mod:`.local`, :mod:`.fsspec`, :mod:`.obstore` (with :mod:`.obstore_client`);
* :mod:`.chunk_cache` (the cache directory) and :mod:`.cached` (a backend wrapped in it);
* :mod:`.factory`: :func:`open_storage`, a backend for a URL, wrapped in the cache when asked.

This ``__init__`` only re-exports the names the rest of featurestore uses; no module of the
package takes a name from it (each imports the submodule it needs).
"""

from featurestore.core.storage.base import Storage
from featurestore.core.storage.factory import open_storage
from featurestore.core.storage.files import temp_path, unlink_quietly
from featurestore.core.storage.fsspec import FsspecStorage
from featurestore.core.storage.local import LocalStorage

__all__ = ["FsspecStorage", "LocalStorage", "Storage", "open_storage", "temp_path", "unlink_quietly"]
