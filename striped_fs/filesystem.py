"""``striped``: an fsspec filesystem that stripes reads and writes over any other one.

Chained the fsspec way::

    fs, path = fsspec.core.url_to_fs("striped::s3://bucket/ckpt", s3={...})
    with fsspec.open("striped::file:///data/big.bin", "rb") as f: ...

Reads of *any* file are split into stripe-sized ranges over concurrent streams; files
written through it use the striped layout (see :mod:`striped_fs.layout`), committed by a
manifest written last.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import fsspec
from fsspec.core import split_protocol
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.utils import isfilelike

from . import tree
from .backend import Backend, RetryPolicy, fsync_dir
from .config import FILESYSTEM_OPTIONS, OPTION_NAMES, StripeOptions
from .errors import ManifestError, OptionError
from .layout import (
    MAGIC,
    MAX_MANIFEST_SIZE,
    SMALL_FILE_PROBE,
    Manifest,
    is_stripes_dir_name,
    split_path,
    stripe_path,
    stripes_dir,
    version_dir,
)
from .mirror import MIRRORED_PROTOCOLS, Mirror
from .mtime import mtime_ns_of, set_mtime
from .reader import (
    InlineSource,
    PlainSource,
    Source,
    StripedReader,
    StripedSource,
    download,
    read_range,
)
from .writer import StripedWriter

log = logging.getLogger("striped_fs")

# Options fsspec itself consumes when it builds and caches filesystem instances.
_FSSPEC_OPTIONS = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "asynchronous",
    "loop",
}
_READ_MODES = {"rb"}
_WRITE_MODES = {"wb", "xb"}


class StripedFileSystem(ChainedFileSystem):
    """Parallel striped I/O over a target filesystem.

    Options (constructor, storage options under the ``striped`` key, or per call):
    ``stripe_size`` (bytes or "8MiB"), ``concurrency`` (streams), ``readahead`` (stripes a
    sequential reader keeps ahead), ``retries``, ``backoff_s``, ``fsync`` and ``direct_io``
    (local targets); of the filesystem only (not per call): ``mirror`` and
    ``mirror_timeout_s`` (an HTTP cache that stripe reads of an S3 target try first, see
    :mod:`striped_fs.mirror`).
    """

    protocol = "striped"
    root_marker = ""

    def __init__(
        self,
        target_protocol: str | None = None,
        target_options: dict | None = None,
        fs: fsspec.AbstractFileSystem | None = None,
        fo: str | None = None,
        **options: Any,
    ) -> None:
        unknown = set(options) - OPTION_NAMES - _FSSPEC_OPTIONS
        if unknown:
            raise OptionError(
                f"unknown striped_fs option(s) {', '.join(sorted(unknown))}; known options: "
                f"{', '.join(sorted(OPTION_NAMES))}"
            )
        stripe_opts = {k: v for k, v in options.items() if k in OPTION_NAMES}
        super().__init__(**{k: v for k, v in options.items() if k in _FSSPEC_OPTIONS})
        self.options = StripeOptions.resolve(**stripe_opts)
        if fs is None:
            if target_protocol is None:
                target_protocol = (split_protocol(fo)[0] if fo else None) or "file"
            fs = fsspec.filesystem(
                target_protocol,
                **_target_defaults(target_protocol, target_options or {}, self.options),
            )
        self.target = fs
        self.backend = Backend(fs, max_workers=max(64, self.options.concurrency))
        self.backend.direct_io = self.options.direct_io
        self.backend.mirror = _mirror_for(fs, self.options)

    # -- paths -------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = fsspec.utils.stringify_path(path)
        for prefix in ("striped::", "striped://"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        return path

    def _norm(self, path: str) -> str:
        return self.target._strip_protocol(self._strip_protocol(path))

    def unstrip_protocol(self, name: str) -> str:
        return f"striped::{self.target.unstrip_protocol(name)}"

    def _opts(self, overrides: dict[str, Any]) -> StripeOptions:
        unknown = set(overrides) - OPTION_NAMES
        if unknown:
            raise OptionError(
                f"unknown striped_fs option(s) {', '.join(sorted(unknown))}; known options: "
                f"{', '.join(sorted(OPTION_NAMES))}"
            )
        whole = sorted(FILESYSTEM_OPTIONS & {k for k, v in overrides.items() if v is not None})
        if whole:
            raise OptionError(
                f"striped_fs option(s) {', '.join(whole)} belong to the filesystem, not to one "
                "call: give them in the storage options (striped={...}) or the constructor"
            )
        return self.options.updated(**overrides) if overrides else self.options

    # -- resolving a path to a source ----------------------------------------------------
    def _probe(self, path: str, size: int | None) -> tuple[Manifest | None, bytes | None]:
        """Is ``path`` a striped manifest? Returns (manifest, whole bytes of a small file)."""
        if size is None:
            raise OSError(
                f"{path}: the target did not report a size; striped reads need one "
                "(an HTTP server must send Content-Length)"
            )
        if size <= SMALL_FILE_PROBE:
            data = self.target.cat_file(path)
            if data.startswith(MAGIC):
                return Manifest.from_bytes(data, path=path), None
            return None, data
        if size <= MAX_MANIFEST_SIZE and self.target.cat_file(path, 0, len(MAGIC)) == MAGIC:
            # bounded: the object may have grown since its size was asked
            data = self.target.cat_file(path, 0, MAX_MANIFEST_SIZE + 1)
            return Manifest.from_bytes(data, path=path), None
        return None, None

    def _target_file_info(self, path: str) -> dict[str, Any]:
        info = self.target.info(path)
        if info["type"] == "directory":
            raise IsADirectoryError(path)
        return info

    def _resolve(self, path: str, opts: StripeOptions) -> Source:
        info = self._target_file_info(path)
        manifest, data = self._probe(path, info.get("size"))
        retry = RetryPolicy.from_options(opts)
        if manifest is not None:
            return StripedSource(self.backend, path, manifest, retry)
        if data is not None:
            return InlineSource(path, data)
        return PlainSource(self.backend, path, info["size"], opts.stripe_size, retry)

    def _manifest_or_none(self, path: str) -> Manifest | None:
        """The manifest at ``path``; None for a plain file, a directory or nothing there.

        One bounded read answers all of these (no stat first: on S3 a stat of a missing key
        is two requests). Other errors (a store that does not answer) are raised.
        """
        retry = RetryPolicy.from_options(self.options)
        try:
            data = self.backend.read_object(
                path, what=f"manifest of {path}", retry=retry, limit=SMALL_FILE_PROBE
            ).result()
            if data.startswith(MAGIC) and len(data) >= SMALL_FILE_PROBE:
                data = self.backend.read_object(
                    path, what=f"manifest of {path}", retry=retry, limit=MAX_MANIFEST_SIZE + 1
                ).result()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if not data.startswith(MAGIC):
            return None
        try:
            return Manifest.from_bytes(data, path=path)
        except ManifestError:
            return None

    # -- metadata ----------------------------------------------------------------------
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._norm(path)
        info = self.target.info(path, **kwargs)
        # A size the target cannot tell (an HTTP directory page without Content-Length)
        # is not a striped manifest: report what the target says rather than fail.
        if info["type"] == "file" and info.get("size") is not None:
            manifest, _ = self._probe(path, info.get("size"))
            if manifest is not None:
                info = _logical(info, manifest)
        return info

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        path = self._norm(path)
        entries = self.target.ls(path, detail=True, **kwargs)
        if (
            len(entries) == 1
            and entries[0]["type"] == "file"
            and self._norm(entries[0]["name"]).rstrip("/") == path.rstrip("/")
        ):
            info = self.info(path)  # ``path`` is a file: what it holds, not its manifest
            return [info] if detail else [info["name"]]
        names = {split_path(e["name"].rstrip("/"))[1] for e in entries}
        shown, probes = [], {}
        for entry in entries:
            name = split_path(entry["name"].rstrip("/"))[1]
            if entry["type"] == "directory" and is_stripes_dir_name(name):
                continue
            shown.append(entry)
            size = entry.get("size") or 0
            if (
                entry["type"] == "file"
                and f".{name}.stripes" in names
                and size <= MAX_MANIFEST_SIZE
            ):
                probes[entry["name"]] = self.backend.read_object(
                    entry["name"],
                    what="manifest",
                    retry=RetryPolicy.from_options(self.options),
                    limit=MAX_MANIFEST_SIZE + 1,
                )
        gone = set()
        for i, entry in enumerate(shown):
            fut = probes.get(entry["name"])
            if fut is None:
                continue
            try:
                data = fut.result()
            except FileNotFoundError:  # removed after the listing (a writer cleaning up its
                gone.add(i)  # stale files): not there, not an error of the listing
                continue
            if data.startswith(MAGIC):
                shown[i] = _logical(entry, Manifest.from_bytes(data, path=entry["name"]))
        shown = [e for i, e in enumerate(shown) if i not in gone]
        return shown if detail else [e["name"] for e in shown]

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.target.exists(self._norm(path))

    def isdir(self, path: str) -> bool:
        return self.target.isdir(self._norm(path))

    def isfile(self, path: str) -> bool:
        return self.target.isfile(self._norm(path))

    def modified(self, path: str):
        info = self.info(path)
        if "mtime_ns" in info:  # set on a striped file (utime, rsync -a)
            return datetime.datetime.fromtimestamp(info["mtime_ns"] / 1e9, tz=datetime.UTC)
        return self.target.modified(self._norm(path))

    def set_mtime(self, path: str, mtime_ns: int) -> None:
        """Set a file's modification time (integer ns): a striped file's in a new manifest
        naming the same stripes, atomically; a plain file's or directory's where the target
        can (local disk); otherwise ``OSError(EOPNOTSUPP)``. See :mod:`striped_fs.mtime`."""
        set_mtime(self, self._norm(path), mtime_ns)

    def created(self, path: str):
        return self.target.created(self._norm(path))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(self._norm(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """On an object store, directories under a bucket do not exist, so ``exist_ok``
        makedirs of ``bucket/key`` does nothing. s3fs would check the bucket first and create
        it when it cannot see it: right after an outage a pooled connection fails that check,
        and the CreateBucket that follows fails a checkpoint save (the soak's store outage,
        ``InvalidLocationConstraint``); a save never creates a bucket."""
        path = self._norm(path)
        if exist_ok and "/" in path.strip("/") and _object_store(self.target):
            return
        self.target.makedirs(path, exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.target.rmdir(self._norm(path))

    # -- reading -----------------------------------------------------------------------
    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ):
        path = self._norm(path)
        opts = self._opts(kwargs)
        if mode in _READ_MODES:
            return StripedReader(self._resolve(path, opts), window=opts.window, name=path)
        if mode in _WRITE_MODES:
            if _read_only(self.target):
                raise PermissionError(
                    f"cannot write {path}: the {self.target.protocol} target is read-only "
                    "for striped_fs (write to file://, s3:// or hdfs:// instead)"
                )
            exclusive = mode == "xb"
            if exclusive and self.target.exists(path):
                raise _exists_error(path)  # early; the commit decides again, atomically
            return self._writer(path, opts, exclusive=exclusive, autocommit=autocommit)
        raise ValueError(
            f"striped_fs cannot open {path} in mode {mode!r}: striped files are read with 'rb' "
            "and written whole with 'wb' (no append or update in place)"
        )

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        path = self._norm(path)
        opts = self._opts(kwargs)
        source = self._resolve(path, opts)
        start, end = _clip(start, end, source.size)
        return read_range(source, start, end, opts.concurrency)

    def get_file(self, rpath: str, lpath: Any, callback=None, outfile=None, **kwargs: Any) -> None:
        """Copy one file out: to a local path (parents created, positioned writes as stripes
        arrive) or into a file object (``lpath`` or ``outfile``, written in order)."""
        rpath = self._norm(rpath)
        if isfilelike(lpath):
            outfile = lpath
        if outfile is None and self.isdir(rpath):
            os.makedirs(lpath, exist_ok=True)
            return
        opts = self._opts(kwargs)
        source = self._resolve(rpath, opts)
        if callback is not None:
            callback.set_size(source.size)
        progress = callback.relative_update if callback is not None else None
        if outfile is not None:
            with StripedReader(source, window=opts.window, name=rpath) as reader:
                while chunk := reader.read1():
                    outfile.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
            return
        tree.local_parent(lpath)
        download(source, lpath, opts.concurrency, progress)

    # -- writing -----------------------------------------------------------------------
    def _writer(
        self, path: str, opts: StripeOptions, *, exclusive: bool = False, autocommit: bool = True
    ) -> StripedWriter:
        return StripedWriter(
            path,
            self.backend,
            opts,
            commit=lambda p, m: self._commit(p, m, opts, exclusive=exclusive),
            prepare=self._prepare_version,
            discard_version=self._remove_version,
            autocommit=autocommit,
        )

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        """Write ``value`` as the whole file; ``mode="create"`` refuses an existing one."""
        with self.open(path, _write_mode(mode, path), **kwargs) as f:
            f.write(value)

    def put_file(
        self, lpath: str, rpath: str, callback=None, mode: str = "overwrite", **kwargs: Any
    ) -> None:
        """Upload a local file, striped; ``mode="create"`` refuses an existing one."""
        rpath = self._norm(rpath)
        write_mode = _write_mode(mode, rpath)
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        opts = self._opts(kwargs)
        size = os.path.getsize(lpath)
        if callback is not None:
            callback.set_size(size)
        with open(lpath, "rb") as src, self.open(rpath, write_mode, **kwargs) as dst:
            while chunk := src.read(opts.stripe_size):
                dst.write(chunk)
                if callback is not None:
                    callback.relative_update(len(chunk))

    def _prepare_version(self, path: str, version: str) -> None:
        if self.backend.is_local:
            os.makedirs(version_dir(path, version), exist_ok=True)

    def _commit(
        self, path: str, manifest: Manifest, opts: StripeOptions, *, exclusive: bool = False
    ) -> None:
        """Make ``manifest`` the file at ``path`` in one atomic step, then drop the old version.

        ``exclusive``: only if nothing is at ``path``, decided in that same step where the
        target can (local disk, S3, memory); otherwise ``FileExistsError``.
        """
        previous = None if exclusive else self._manifest_or_none(path)
        retry = RetryPolicy.from_options(opts)
        if manifest.stripe_count == 0:
            # An empty file has no stripes; a marker keeps its hidden directory listable, which
            # is how listings know which small files to probe for a manifest.
            self.backend.write_object(
                stripe_path(path, manifest.version, 0),
                b"",
                retry=retry,
                durable=opts.fsync,
                what=f"marker of {path}",
            ).result()
        self._atomic_put(path, manifest.to_bytes(), opts, retry, exclusive)
        if previous is not None and previous.version != manifest.version:
            self._remove_version(path, previous.version)

    def _atomic_put(
        self,
        path: str,
        data: bytes,
        opts: StripeOptions,
        retry: RetryPolicy,
        exclusive: bool = False,
    ) -> None:
        if self.backend.is_local:
            parent, name = split_path(path)
            tmp = f"{parent}/.{name}.commit-{uuid.uuid4().hex}"
            self.backend.write_object(
                tmp, data, retry=retry, durable=opts.fsync, what=f"manifest of {path}"
            ).result()
            try:
                if exclusive:
                    os.link(tmp, path)  # fails if anything is at path: atomic create
                    os.unlink(tmp)
                else:
                    os.replace(tmp, path)
            except FileExistsError:
                os.unlink(tmp)
                raise _exists_error(path) from None
            if opts.fsync:
                fsync_dir(parent)
        elif self.backend.is_async or isinstance(self.target, MemoryFileSystem):
            # Object stores replace a key atomically (or create it only if absent, with
            # If-None-Match); memory assigns a dict entry.
            try:
                self.backend.write_object(
                    path, data, retry=retry, exclusive=exclusive, what=f"manifest of {path}"
                ).result()
            except FileExistsError:
                raise _exists_error(path) from None
        else:
            # Other sync filesystems (HDFS): write aside, then rename over the path. HDFS
            # rename does not replace, so the old manifest is removed first (a short window
            # in which the path is absent, never torn). Exclusive creation is checked just
            # before, not atomically.
            parent, name = split_path(path)
            tmp = f"{parent}/.{name}.commit-{uuid.uuid4().hex}"
            self.target.pipe_file(tmp, data)
            if self.target.exists(path):
                if exclusive:
                    self.target.rm_file(tmp)
                    raise _exists_error(path)
                self.target.rm_file(path)
            self.target.mv(tmp, path)

    def _remove_version(self, path: str, version: str) -> None:
        tree.remove_literal(self.target, version_dir(path, version))
        if self.backend.is_local:
            try:
                os.rmdir(stripes_dir(path))
            except OSError:
                pass  # other versions (a concurrent writer's) still there

    def _copy_striped(
        self, src: str, manifest: Manifest, dst: str, *, link: bool, mtime_ns: int | None = None
    ) -> None:
        """A new version of ``dst`` holding ``src``'s stripes, committed (or, inside a
        transaction, deferred). Stripes go ``concurrency`` at a time, each retried like any
        stripe: server-side copies on S3, hard links on local disk when ``link``. ``mtime_ns``:
        the time the new manifest records (a move keeps the source's)."""
        opts, retry = self.options, RetryPolicy.from_options(self.options)
        copy = Manifest(
            size=manifest.size,
            stripe_size=manifest.stripe_size,
            version=uuid.uuid4().hex,
            checksums=manifest.checksums,
            mtime_ns=mtime_ns,
        )
        pending: set[Future[None]] = set()
        try:
            self._prepare_version(dst, copy.version)
            for index in range(manifest.stripe_count):
                if len(pending) >= opts.concurrency:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        fut.result()
                pending.add(
                    self.backend.copy_object(
                        stripe_path(src, manifest.version, index),
                        stripe_path(dst, copy.version, index),
                        what=f"stripe {index} of {src} to {dst}",
                        retry=retry,
                        durable=opts.fsync,
                        link=link,
                    )
                )
            for fut in wait(pending).done:
                fut.result()
            if self.backend.is_local and opts.fsync and manifest.stripe_count:
                fsync_dir(version_dir(dst, copy.version))
        except BaseException:
            for fut in pending:
                fut.cancel()
            wait(pending)  # nothing lands after the removal below
            self._remove_version(dst, copy.version)
            raise
        self._commit_or_defer(dst, copy)

    def _commit_or_defer(self, path: str, manifest: Manifest) -> None:
        """Commit now, or at the end of the transaction this filesystem is in."""
        if not self._intrans:
            try:
                self._commit(path, manifest, self.options)
            except BaseException:
                self._remove_version(path, manifest.version)
                raise
            return
        self.transaction.files.append(_DeferredCommit(self, path, manifest))

    def _not_in_transaction(self, operation: str) -> None:
        if self._intrans:
            raise NotImplementedError(
                f"striped_fs: {operation} inside a transaction cannot wait for its end (only "
                "file writes and copies of striped files are deferred); call it after the "
                "transaction"
            )

    # -- removing, moving, copying -------------------------------------------------------
    def rm_file(self, path: str) -> None:
        """Remove one file: its manifest first (it is gone for readers), then its stripes."""
        self._not_in_transaction("rm_file")
        path = self._norm(path)
        self.target.rm_file(path)
        tree.remove_literal(self.target, stripes_dir(path))

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(
        self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None
    ) -> None:
        """Remove files or (with ``recursive``) directories; see :mod:`striped_fs.tree` for
        which paths a glob names."""
        self._not_in_transaction("rm")
        paths, _ = tree.sources(self, path)
        removed: list[str] = []
        for p in paths:
            if tree.under(p, removed):
                continue
            if self.target.isdir(p):
                if not recursive:
                    raise IsADirectoryError(
                        errno.EISDIR, "is a directory: pass recursive=True to remove it", p
                    )
                if maxdepth is None:
                    tree.remove_literal(self.target, p)
                else:
                    for f in self.find(p, maxdepth=maxdepth):
                        self.rm_file(f)
                    tree.remove_empty_dirs(self.target, p)
                removed.append(p)
            else:
                self.rm_file(p)
        self.invalidate_cache()

    def mv(
        self,
        path1: str | list[str],
        path2: str | list[str],
        recursive: bool = False,
        maxdepth: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Move files, globs, lists and directories (a directory moves whole, ``recursive``
        or not); each destination is committed before its source is removed."""
        self._not_in_transaction("mv")
        for src, dst in tree.move_pairs(self, path1, path2):
            if self.target.isdir(src):
                self._move_tree(src, dst, maxdepth)
            else:
                self._move_file(src, dst)
        self.invalidate_cache()

    def _move_tree(self, src: str, dst: str, maxdepth: int | None) -> None:
        if self.target.isfile(dst):
            raise NotADirectoryError(
                errno.ENOTDIR, f"cannot move the directory {src} over a file", dst
            )
        if self.backend.is_local and maxdepth is None and not os.path.lexists(dst):
            tree.local_parent(dst)
            os.rename(src, dst)  # the whole tree, manifests and stripes, in one atomic step
            if self.options.fsync:
                fsync_dir(os.path.dirname(src) or ".")
                fsync_dir(os.path.dirname(dst) or ".")
            return
        found = self.find(src, maxdepth=maxdepth, withdirs=True, detail=True)
        for name, info in sorted(found.items()):
            moved = dst + name[len(src) :]
            if info["type"] == "directory":
                self.makedirs(moved, exist_ok=True)
            else:
                self._move_file(name, moved)
        self.invalidate_cache()
        if maxdepth is None and not self.find(src):
            tree.remove_literal(self.target, src)  # what is left is hidden (stale stripes)
        else:
            tree.remove_empty_dirs(self.target, src)

    def _move_file(self, src: str, dst: str) -> None:
        """Move one file: the destination is committed before the source goes."""
        manifest = self._manifest_or_none(src)
        if manifest is None:
            self._move_plain(src, dst)
            return
        # rename keeps the file's mtime, also one that was the old manifest's own time
        keep = manifest.mtime_ns
        if keep is None:
            keep = mtime_ns_of(self.target.info(src))
        self._copy_striped(src, manifest, dst, link=True, mtime_ns=keep)
        self.rm_file(src)

    def _move_plain(self, src: str, dst: str) -> None:
        previous = self._manifest_or_none(dst)
        if self.backend.is_local:
            tree.local_parent(dst)
            os.rename(src, dst)
        else:
            self.target.cp_file(src, dst)
            self.target.rm_file(src)
        if previous is not None:  # a plain file replaced a striped one: its stripes go too
            self._remove_version(dst, previous.version)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy one file; a striped source is copied stripe by stripe and committed at the
        destination (at the end of a transaction, inside one)."""
        src, dst = self._norm(path1), self._norm(path2)
        manifest = self._manifest_or_none(src)
        if manifest is None:
            if self.target.isdir(src):  # copy() hands directories over too
                self.makedirs(dst, exist_ok=True)
                return
            self._not_in_transaction(f"copying the plain (not striped) file {src}")
            self.target.cp_file(src, dst)
            return
        self._copy_striped(src, manifest, dst, link=False)

    # -- housekeeping ------------------------------------------------------------------
    def gc(
        self,
        path: str,
        older_than_s: float = 3600.0,
        on_remove: Callable[[str], None] | None = None,
    ) -> int:
        """Remove stripe versions no manifest references (killed or failed writers).

        Only versions untouched for ``older_than_s`` go, so a writer still uploading is
        safe. Returns how many versions were removed.
        """
        removed = 0
        now = time.time()
        for dirpath, dirs, _files in self.target.walk(self._norm(path)):
            for name in dirs:
                if not is_stripes_dir_name(name):
                    continue
                owner = f"{dirpath}/{name[1 : -len('.stripes')]}"
                current = self._manifest_or_none(owner)
                for version_path in self.target.ls(f"{dirpath}/{name}", detail=False):
                    version = split_path(version_path.rstrip("/"))[1]
                    if current is not None and version == current.version:
                        continue
                    if now - _newest_mtime(self.target, version_path) < older_than_s:
                        continue
                    tree.remove_literal(self.target, version_path)
                    removed += 1
                    if on_remove is not None:
                        on_remove(version_path)
        return removed

    def invalidate_cache(self, path: str | None = None) -> None:
        """Forget the target's cached listings (s3fs caches them), e.g. before polling."""
        self.target.invalidate_cache(None if path is None else self._norm(path))

    def close(self) -> None:
        self.backend.close()


def _mirror_for(fs: fsspec.AbstractFileSystem, opts: StripeOptions) -> Mirror | None:
    """The mirror the options name, for a target whose paths are ``bucket/key`` (S3); a
    mirror configured for every store (bootseer's ``striped.mirror``) does nothing for a
    local or HDFS one, whose reads do not leave the cluster."""
    if not opts.mirror:
        return None
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not MIRRORED_PROTOCOLS & set(protocols):
        log.debug("striped mirror %s: not used for a %s target", opts.mirror, protocols[0])
        return None
    return Mirror(opts.mirror, opts.mirror_timeout_s)


class _DeferredCommit:
    """A copied striped file waiting for the end of a transaction (fsspec calls
    ``commit`` or ``discard`` on everything in ``transaction.files``)."""

    def __init__(self, fs: StripedFileSystem, path: str, manifest: Manifest) -> None:
        self.fs, self.path, self.manifest = fs, path, manifest

    def commit(self) -> None:
        try:
            self.fs._commit(self.path, self.manifest, self.fs.options)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        self.fs._remove_version(self.path, self.manifest.version)


def _write_mode(mode: str, path: str) -> str:
    """fsspec's ``mode`` of ``pipe_file``/``put_file`` as an ``open`` mode."""
    if mode not in ("overwrite", "create"):
        raise ValueError(
            f"{path}: mode {mode!r} is not 'overwrite' (replace the file) or "
            "'create' (refuse an existing one)"
        )
    return "xb" if mode == "create" else "wb"


def _exists_error(path: str) -> FileExistsError:
    return FileExistsError(
        errno.EEXIST,
        "already exists (exclusive creation: mode 'xb' / "
        "mode='create'; use 'wb' / mode='overwrite' to replace it)",
        path,
    )


def _read_only(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return bool({"http", "https"} & set(protocols))


def _logical(info: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
    out = {
        **info,
        "size": manifest.size,
        "striped": True,
        "stripes": manifest.stripe_count,
        "stripe_size": manifest.stripe_size,
        "version": manifest.version,
    }
    if manifest.mtime_ns is not None:
        out["mtime_ns"] = manifest.mtime_ns
        out["mtime"] = manifest.mtime_ns / 1e9
    return out


def _clip(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    start = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
    end = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return start, end


def _newest_mtime(fs: fsspec.AbstractFileSystem, path: str) -> float:
    newest = 0.0
    for info in fs.find(path, detail=True, withdirs=False).values():
        stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
        if hasattr(stamp, "timestamp"):
            stamp = stamp.timestamp()
        newest = max(newest, float(stamp or 0.0))
    return newest


def _object_store(target: Any) -> bool:
    """Whether ``target`` keeps objects under keys, with no directories (S3, GCS, Azure)."""
    protocols = (target.protocol,) if isinstance(target.protocol, str) else target.protocol
    return bool({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"} & set(protocols))


def _target_defaults(protocol: str, options: dict[str, Any], opts: StripeOptions) -> dict[str, Any]:
    """Give the target enough connections for ``concurrency`` streams."""
    options = dict(options)
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", max(opts.concurrency * 2, 10))
        # striped_fs retries every stripe with bounded backoff; botocore retrying underneath
        # as well would multiply the time a dead endpoint takes to be reported.
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
    return options
