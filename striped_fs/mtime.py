"""A file's modification time on a striped filesystem: reading it, and setting it.

A striped file's mtime is its manifest's ``mtime_ns`` when one was set, otherwise the time
the target gives the manifest object (when it was committed). Setting it writes a new
manifest naming the same stripes, in the one atomic step every commit uses (an S3 PUT, a
local ``rename``): the stripes are never touched, so a reader that holds the old manifest
reads the same bytes, and one that reads the new manifest does too.

Setting it is read-modify-write, so it must not undo a writer that commits in between (that
writer's commit deletes the stripes the old manifest names). On S3 the PUT is conditional
(``If-Match`` on the ETag read before the manifest); on a local disk the manifest's inode is
compared just before the rename (a window of microseconds remains); on other targets (HDFS,
memory) the manifest is read again just before it is replaced. A lost race is retried on the
new manifest, and a persistent one is an error, never a stale manifest.

Plain files and directories keep their time where the target has one to set: on a local disk
(``os.utime``). A plain object or a directory (a prefix) on an object store has no settable
time: ``EOPNOTSUPP``, naming it and what to do.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

from .backend import RetryPolicy, fsync_dir
from .layout import Manifest, split_path

if TYPE_CHECKING:
    from .filesystem import StripedFileSystem

log = logging.getLogger("striped_fs")

#: How many times a manifest replaced under us is read again before giving up.
ATTEMPTS = 5
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "modified", "updated", "created", "ctime")


def mtime_ns_of(info: dict[str, Any]) -> int | None:
    """Modification time (ns) from an fsspec ``info`` dict, whatever key and type the backend
    uses (``mtime_ns``, float seconds, datetime, ISO string); None when it gives none."""
    exact = info.get("mtime_ns")
    if isinstance(exact, int) and not isinstance(exact, bool):
        return exact
    for key in _MTIME_KEYS:
        val = info.get(key)
        if val is None:
            continue
        try:
            if isinstance(val, _dt.datetime):
                return int(val.timestamp() * 1e9)
            if isinstance(val, str):
                return int(_dt.datetime.fromisoformat(val.replace("Z", "+00:00")).timestamp() * 1e9)
            return int(float(val) * 1e9)
        except (TypeError, ValueError, OverflowError):
            continue
    return None


def set_mtime(fs: StripedFileSystem, path: str, mtime_ns: int) -> None:
    """Set the mtime of ``path`` (normalized, on ``fs``'s target); see the module docstring."""
    for attempt in range(ATTEMPTS):
        token, info = _token(fs, path)
        if (
            info["type"] == "directory"
            or (manifest := fs._probe(path, info.get("size"))[0]) is None
        ):
            _set_plain(fs, path, info, mtime_ns)
            return
        if manifest.mtime_ns == mtime_ns:
            return
        data = dataclasses.replace(manifest, mtime_ns=mtime_ns).to_bytes()
        if _replace_if_unchanged(fs, path, data, token, manifest):
            return
        log.info(
            "%s: its manifest was replaced while its mtime was being set; reading it again "
            "(attempt %d of %d)",
            path,
            attempt + 2,
            ATTEMPTS,
        )
    raise OSError(
        errno.EBUSY,
        f"{path}: replaced by other writers {ATTEMPTS} times while its "
        "mtime was being set; nothing was changed: try again",
        path,
    )


def _set_plain(fs: StripedFileSystem, path: str, info: dict[str, Any], mtime_ns: int) -> None:
    if fs.backend.is_local:
        os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        return
    protocol = fs.target.protocol if isinstance(fs.target.protocol, str) else fs.target.protocol[0]
    if info["type"] == "directory":
        raise OSError(
            errno.EOPNOTSUPP,
            f"{path} is a directory on {protocol}://, which keeps "
            "no directory times (a prefix); nothing was changed",
            path,
        )
    raise OSError(
        errno.EOPNOTSUPP,
        f"{path} is a plain (not striped) object on {protocol}://: its time cannot be "
        "set without rewriting it; copy it again through striped_fs (`bootseer fs cp`, "
        "or through the mount) to make it a striped file whose time can be set",
        path,
    )


def _token(fs: StripedFileSystem, path: str) -> tuple[Any, dict[str, Any]]:
    """What identifies the object now at ``path`` (taken before its bytes are read), and its
    info: the inode on a local disk, the ETag on S3."""
    if fs.backend.is_local:
        st = os.stat(path, follow_symlinks=False)
        info = fs.target.info(path)
        return (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns, st.st_size), info
    fs.target.invalidate_cache(path)  # s3fs answers info from cached listings
    info = fs.target.info(path)
    return info.get("ETag"), info


def _replace_if_unchanged(
    fs: StripedFileSystem, path: str, data: bytes, token: Any, manifest: Manifest
) -> bool:
    """Put ``data`` at ``path`` unless the object there is no longer the one ``token`` names;
    False when it was replaced (nothing written)."""
    opts = fs.options
    retry = RetryPolicy.from_options(opts)
    if fs.backend.is_local:
        parent, name = split_path(path)
        tmp = f"{parent}/.{name}.commit-{uuid.uuid4().hex}"
        fs.backend.write_object(
            tmp, data, retry=retry, durable=opts.fsync, what=f"manifest of {path}"
        ).result()
        try:
            st = os.stat(path, follow_symlinks=False)
            if (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns, st.st_size) != token:
                return False
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        if opts.fsync:
            fsync_dir(parent)
        return True
    if _is_s3(fs) and token:
        try:
            fs.target.pipe_file(path, data, IfMatch=token)
        except OSError as exc:
            if _precondition_failed(exc):
                return False
            raise
        return True
    if fs._manifest_or_none(path) != manifest:
        return False
    fs._atomic_put(path, data, opts, retry)
    return True


def _is_s3(fs: StripedFileSystem) -> bool:
    protocols = (fs.target.protocol,) if isinstance(fs.target.protocol, str) else fs.target.protocol
    return bool({"s3", "s3a"} & set(protocols))


def _precondition_failed(exc: BaseException) -> bool:
    """s3fs turns a 412 into OSError(EINVAL); the botocore error is its cause. A 409
    (ConditionalRequestConflict: another conditional write in flight) is the same race."""
    cause = exc.__cause__ or exc.__context__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code")
    return code in ("PreconditionFailed", "ConditionalRequestConflict")
