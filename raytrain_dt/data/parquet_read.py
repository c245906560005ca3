"""Ray Data's parquet read, with its footer-reading actor pool sized to the files read.

Ray Data 2.60 lists a parquet read's row groups by reading every file's footer on a pool of
actors (`FooterFileIndexer`): 32 of them by default, whatever the number of files, each a new
Ray worker process that imports Ray Data (about 2 CPU-s) and lives until the listing ends. The
files are dealt out in batches (10 files each by default), so only as many actors as there are
batches ever get one. Measured on this project's 2-core test host: one read of a single local
file started 10 such processes, 22 CPU-s in all.

`read_parquet` asks for one actor per batch, up to Ray's default pool. The pool's size is read
from `RAY_DATA_PARQUET_FOOTER_NUM_ACTORS` when the read is planned, in this process, and travels
with the plan, so it is set only around that call. A value the user set is left alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

POOL_SIZE_VARIABLE = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
BATCH_SIZE_VARIABLE = "RAY_DATA_PARQUET_FOOTER_BATCH_SIZE"
# Ray's defaults (ray/data/_internal/datasource_v2/formats/parquet/footer_file_indexer.py).
RAY_DEFAULT_POOL_SIZE = 32
RAY_DEFAULT_BATCH_SIZE = 10

# The environment is the process's: two reads planned at once must not restore each other's.
_environment_lock = threading.Lock()


def footer_readers_for(num_files: int) -> int:
    """Actors that the footers of `num_files` files keep busy: one per batch of files."""
    batch = int(os.environ.get(BATCH_SIZE_VARIABLE, RAY_DEFAULT_BATCH_SIZE))
    return max(1, min(RAY_DEFAULT_POOL_SIZE, -(-num_files // max(1, batch))))


@contextlib.contextmanager
def _footer_pool_sized_for(num_files: int) -> Iterator[None]:
    with _environment_lock:
        if POOL_SIZE_VARIABLE in os.environ:  # the user's choice
            yield
            return
        os.environ[POOL_SIZE_VARIABLE] = str(footer_readers_for(num_files))
        try:
            yield
        finally:
            del os.environ[POOL_SIZE_VARIABLE]


def read_parquet(files: list[str], **options):
    """`ray.data.read_parquet(files, **options)`, listing their footers on as many actors as
    they keep busy."""
    import ray.data

    with _footer_pool_sized_for(len(files)):
        return ray.data.read_parquet(files, **options)
