"""Unix sockets only root reaches: bound where nobody else can connect, made 0600, then
renamed into place (the snapshotter's gRPC socket, the holder's). Standard library only: the
holder imports it and stays small."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def private_socket(address: str) -> Iterator[str]:
    """Yield a path to bind a unix socket at; when the block ends without an error the
    socket is made 0600 and renamed onto ``address`` (atomically replacing a stale one).

    A socket is created with the umask's mode, so it is bound in a fresh 0700 directory
    beside ``address``, where no other user can reach it before its mode is set. A missing
    parent directory is created 0700 (under the daemons' umask 077); an existing one keeps
    its mode."""
    parent = os.path.dirname(os.path.abspath(address))
    if not os.path.isdir(parent):
        umask = os.umask(0o077)
        try:
            os.makedirs(parent, 0o700, exist_ok=True)
        finally:
            os.umask(umask)
    staging = tempfile.mkdtemp(prefix=".sock-", dir=parent)  # 0700, whatever the umask
    try:
        bound = os.path.join(staging, "s")
        yield bound
        os.chmod(bound, 0o600)
        os.replace(bound, address)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
