"""Capture mode: snapshot what a setup command added, changed or deleted under some paths.

Not every dependency is a venv: CUDA extensions built into ``/usr/local``, a tool unpacked
into ``/opt/tool``, model assets under ``/data/cache``. ``ensure_capture`` records the state
of the capture roots (type, size, mtime, ctime, inode, mode, link target of every entry), runs
the command, and packs every entry that is new or different, plus the list of deletions. The
snapshot's member paths are relative to ``/`` (``opt/tool/bin/x``).

Replay extracts each root's members into a staging directory beside that root (same
filesystem), then moves every entry into place with ``rename`` (atomic per file) through
directory descriptors opened with ``O_NOFOLLOW`` — a host symlink on the way is a conflict,
never followed — and applies the deletions the same way: each directory on the way opened
from the root with ``O_NOFOLLOW``, the entry removed relative to its parent's descriptor, so
a deletion under a symlink (the host's, or one an earlier snapshot planted) is refused before
anything changes. Members outside the roots the caller named are refused: the roots of an
untrusted snapshot are never trusted, only the caller's; nor may a root hold bootseer's state
directory (``state_dir``, given by the caller: ``bootseer`` passes the key ``state.dir``),
whose record is written through descriptors too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsspec.callbacks import DEFAULT_CALLBACK, Callback

from striped_fs import make_dir

from .ensure import EnsureResult, open_store, publish_tree
from .errors import SnapshotError, StoreUnavailable, UnsafeMemberError
from .extract import Extractor
from .install import run_command
from .key import EnvKey, compute_key
from .manifest import DIR, FILE, HARDLINK, SYMLINK, Manifest, Member
from .restore import _ChunkPipeline, fetch_toc
from .safety import Plan, check_path, plan_extraction
from .state import DIR_FLAGS, open_in, replace_file
from .store import SnapshotStore

log = logging.getLogger(__name__)


def normalize_roots(paths: Sequence[str], state_dir: str | os.PathLike) -> list[str]:
    roots = sorted({os.path.normpath(os.path.abspath(p)) for p in paths})
    for root in roots:
        if root == "/":
            raise SnapshotError(
                "--capture / is not allowed: name the directories the setup "
                "command changes (e.g. /usr/local, /opt/tool)"
            )
        for other in roots:
            if other != root and other.startswith(root + "/"):
                raise SnapshotError(f"capture paths {root} and {other} overlap; name one")
    check_state_dir(roots, state_dir)
    return roots


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def check_state_dir(roots: Sequence[str], state_dir: str | os.PathLike) -> None:
    """No capture path may hold bootseer's state directory or lie inside it: a snapshot's
    members land under the capture paths, and could otherwise replace the state (a link)."""
    state = os.path.abspath(state_dir)
    real = os.path.realpath(state)
    for root in roots:
        if _overlap(root, state) or _overlap(os.path.realpath(root), real):
            raise SnapshotError(
                f"capture path {root} and bootseer's state directory {state} "
                f"overlap; a snapshot could replace the state. Choose "
                f"another state directory (state.dir: BOOTSEER_STATE_DIR, "
                f"--state-dir), or capture other paths"
            )


# -- recording -------------------------------------------------------------------------------

Signature = tuple[Any, ...]


def scan(root: str) -> dict[str, Signature]:
    """``{path relative to /: signature}`` of everything under ``root`` (root included)."""
    found: dict[str, Signature] = {}
    if not os.path.lexists(root):
        return found

    def sig(st: os.stat_result, link: str = "") -> Signature:
        return (
            stat.S_IFMT(st.st_mode),
            stat.S_IMODE(st.st_mode),
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            st.st_ino,
            link,
        )

    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise SnapshotError(f"capture path {root} is not a directory")
    found[root.lstrip("/")] = sig(st)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            found[path.lstrip("/")] = sig(st, link)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return found


@dataclass
class Changes:
    changed: list[str]  # new or different entries, relative to /
    deleted: list[str]


def diff(before: dict[str, Signature], after: dict[str, Signature]) -> Changes:
    changed = sorted(p for p, s in after.items() if before.get(p) != s)
    deleted = sorted(p for p in before if p not in after)
    # A deleted directory's children are implied.
    pruned = [p for p in deleted if not any(p.startswith(d + "/") for d in deleted if d != p)]
    return Changes(changed, pruned)


# -- entry point -----------------------------------------------------------------------------


def ensure_capture(
    paths: Sequence[str],
    command: Sequence[str],
    *,
    store: str | SnapshotStore | None,
    state_dir: str | os.PathLike,
    storage_options: dict[str, Any] | None = None,
    key: EnvKey | None = None,
    rebuild: bool = False,
    progress: Callback = DEFAULT_CALLBACK,
) -> EnsureResult:
    """Hit: replay the captured changes (or only verify them). Miss: run ``command``,
    capture what it changed under ``paths``, publish. What was replayed or captured here is
    recorded under ``state_dir`` (the warm path's verification)."""
    start = time.perf_counter()
    roots = normalize_roots(paths, state_dir)
    env_key = key or compute_key((), command, capture=roots)
    shown = " ".join(roots)
    if not rebuild and verify_capture(env_key.key, state_dir):
        return EnsureResult(env_key.key, shown, "verified", time.perf_counter() - start)
    warnings: list[str] = []
    snapshots = None
    manifest = None
    try:
        snapshots = open_store(store, storage_options)
        if snapshots is not None and not rebuild:
            manifest = snapshots.read_manifest(env_key.key)
    except StoreUnavailable as exc:
        warnings.append(f"snapshot store unreachable, running the setup here: {exc}")
        log.warning("%s", warnings[-1])
        snapshots = None
    if manifest is not None:
        replay(snapshots, manifest, roots, state_dir=state_dir, progress=progress)
        return EnsureResult(env_key.key, shown, "restored", time.perf_counter() - start)
    before = {}
    for root in roots:
        before.update(scan(root))
    run_command(list(command), prefix=Path(roots[0]))
    after = {}
    for root in roots:
        after.update(scan(root))
    changes = diff(before, after)
    log.info(
        "setup changed %d and deleted %d entries under %s",
        len(changes.changed),
        len(changes.deleted),
        shown,
    )
    outcome = "installed-locally"
    if snapshots is not None:
        try:
            _publish_capture(snapshots, env_key, roots, changes)
            outcome = "built"
        except (SnapshotError, OSError) as exc:
            warnings.append(f"captured the setup but could not publish it: {exc}")
            log.warning("%s", warnings[-1])
    _record(
        state_dir,
        env_key.key,
        roots,
        [Member(p, _kind(after[p]), 0, 0) for p in changes.changed],
        changes.deleted,
    )
    return EnsureResult(env_key.key, shown, outcome, time.perf_counter() - start, warnings=warnings)


def _kind(sig: Signature) -> str:
    fmt = sig[0]
    return DIR if fmt == stat.S_IFDIR else SYMLINK if fmt == stat.S_IFLNK else FILE


def _publish_capture(
    snapshots: SnapshotStore, env_key: EnvKey, roots: list[str], changes: Changes
) -> None:
    publish_tree(
        snapshots,
        env_key,
        Path("/"),
        kind="capture",
        installer="capture",
        paths=changes.changed,
        capture={"roots": roots, "deleted": changes.deleted},
    )


# -- replay ----------------------------------------------------------------------------------


def _root_of(path: str, roots: list[str]) -> str | None:
    absolute = "/" + path
    for root in roots:
        if absolute == root or absolute.startswith(root + "/"):
            return root
    return None


def replay(
    snapshots: SnapshotStore,
    manifest: Manifest,
    roots: list[str],
    *,
    state_dir: str | os.PathLike,
    progress: Callback = DEFAULT_CALLBACK,
) -> None:
    """Apply a capture snapshot under ``roots`` (the caller's; see the module docstring)."""
    if manifest.kind != "capture":
        raise SnapshotError(
            f"snapshot {manifest.key} is an environment for "
            f"{manifest.prefix}, not a capture; use --prefix"
        )
    declared = manifest.capture.get("roots")
    if declared != roots:
        raise SnapshotError(f"snapshot {manifest.key} captured {declared}, not {roots}")
    check_state_dir(roots, state_dir)
    deleted = manifest.capture.get("deleted", [])
    if not isinstance(deleted, list):
        raise SnapshotError(f"snapshot {manifest.key}: invalid list of deletions")
    members = fetch_toc(snapshots, manifest)
    # The rules, on the whole TOC first (no state directory is written into capture paths).
    plan_extraction(members, manifest.stream_size, reserve_state=False)
    for path in deleted:
        check_path(path)
        if _root_of(path, roots) is None or "/" + path in roots:
            raise UnsafeMemberError(path, "deletion outside the capture paths")
    per_root: dict[str, list[Member]] = {root: [] for root in roots}
    for member in members:
        root = _root_of(member.path, roots)
        if root is None:
            if member.kind == DIR and any(r.startswith("/" + member.path + "/") for r in roots):
                continue  # an ancestor of a root: exists on the host, left as it is
            raise UnsafeMemberError(
                member.path, f"member outside the capture paths {', '.join(roots)}"
            )
        rel = member.path[len(root) :].lstrip("/") if "/" + member.path != root else ""
        if rel:
            link = member.link
            if member.kind == HARDLINK:
                if _root_of(link, [root]) is None:
                    raise UnsafeMemberError(member.path, "hardlink to another capture root")
                link = link[len(root) :].lstrip("/")
            per_root[root].append(
                Member(
                    rel, member.kind, member.mode, member.mtime_ns, member.size, member.offset, link
                )
            )
    staged: list[tuple[str, Path, Plan]] = []
    try:
        extractors = []
        for root, root_members in per_root.items():
            Path(root).mkdir(parents=True, exist_ok=True)
            staging = Path(
                tempfile.mkdtemp(
                    prefix=f".{Path(root).name}.bootseer-capture-", dir=Path(root).parent
                )
            )
            plan = plan_extraction(root_members, manifest.stream_size, reserve_state=False)
            extractor = Extractor(staging, plan, manifest.chunks)
            extractor.prepare()
            extractors.append(extractor)
            staged.append((root, staging, plan))
        fan = _Fanout(extractors)
        progress.set_size(manifest.stream_size)
        try:
            _ChunkPipeline(snapshots, manifest, fan, 4, 16, progress).run()  # type: ignore[arg-type]
            for extractor in extractors:
                extractor.finish()
        finally:
            for extractor in extractors:
                extractor.close()
        for root, _, plan in staged:
            _check_apply(Path(root), plan)  # conflicts first: nothing applied on a refusal
        for path in deleted:
            with _deletion_parent(path, roots):
                pass  # a symlink on the way is refused here, before anything changes
        for path in deleted:
            _delete(path, roots)
        for root, staging, plan in staged:
            _apply(staging, Path(root), plan)
    finally:
        for _, staging, _ in staged:
            shutil.rmtree(staging, ignore_errors=True)
    _record(state_dir, manifest.key, roots, members, deleted)


class _Fanout:
    def __init__(self, extractors: list[Extractor]) -> None:
        self.extractors = extractors

    def feed(self, index: int, raw: bytes | memoryview) -> None:
        for extractor in self.extractors:
            extractor.feed(index, raw)


def _open_dir(
    root_fd: int, root: str | Path, rel: str, *, create: bool, member: str | None = None
) -> int:
    """A descriptor of ``root/rel``, never following a symlink on the way: one is refused
    (:class:`UnsafeMemberError` naming ``member``, else ``root/rel``)."""
    fd = os.dup(root_fd)
    done = str(root)
    for part in [p for p in rel.split("/") if p]:
        done = f"{done}/{part}"
        try:
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                raise
            os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise UnsafeMemberError(
                member or f"{root}/{rel}",
                f"{done} is a symlink or not a directory on this host; a "
                f"symlink there is never followed",
            ) from None
        os.close(fd)
        fd = nxt
    return fd


def _check_apply(root: Path, plan: Plan) -> None:
    """Refuse before changing anything: a host symlink or file where the snapshot has a
    directory on the way, or a directory where it has a file."""
    checked: set[str] = set()

    def dirs_on_the_way(rel: str) -> None:
        parts = rel.split("/")
        for depth in range(1, len(parts) + 1):
            sub = "/".join(parts[:depth])
            if sub in checked:
                continue
            checked.add(sub)
            try:
                st = os.lstat(root / sub)
            except FileNotFoundError:
                return  # created by the replay
            if not stat.S_ISDIR(st.st_mode):
                raise SnapshotError(
                    f"cannot replay into {root / sub}: it is not a directory "
                    f"on this host; a symlink there is never followed"
                )

    for member in plan.dirs:
        dirs_on_the_way(member.path)
    for member in plan.files + plan.symlinks + plan.hardlinks:
        parent = member.path.rpartition("/")[0]
        if parent:
            dirs_on_the_way(parent)
        try:
            if stat.S_ISDIR(os.lstat(root / member.path).st_mode):
                raise SnapshotError(
                    f"cannot replay {root / member.path}: a directory is in the way of a file"
                )
        except FileNotFoundError:
            pass


def _apply(staging: Path, root: Path, plan: Plan) -> None:
    """Move every staged entry into ``root`` (rename: atomic per entry)."""
    root_fd = os.open(root, DIR_FLAGS)
    staging_fd = os.open(staging, DIR_FLAGS)
    try:
        for member in plan.dirs:
            fd = _open_dir(root_fd, root, member.path, create=True)
            os.close(fd)
        for member in plan.files + plan.symlinks + plan.hardlinks:
            parent, _, name = member.path.rpartition("/")
            src_fd = _open_dir(staging_fd, staging, parent, create=False)
            dst_fd = _open_dir(root_fd, root, parent, create=True)
            try:
                try:
                    st = os.lstat(name, dir_fd=dst_fd)
                    if stat.S_ISDIR(st.st_mode):
                        raise SnapshotError(
                            f"cannot replay {root}/{member.path}: a directory "
                            f"is in the way of a file"
                        )
                except FileNotFoundError:
                    pass
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            finally:
                os.close(src_fd)
                os.close(dst_fd)
        for member in sorted(plan.dirs, key=lambda m: m.path.count("/"), reverse=True):
            fd = _open_dir(root_fd, root, member.path, create=False)
            try:
                os.fchmod(fd, member.mode)
                os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
        os.close(staging_fd)


@contextlib.contextmanager
def _deletion_parent(path: str, roots: list[str]) -> Iterator[tuple[int, str] | None]:
    """The descriptor of the directory holding ``/path``, opened from its capture root one
    component at a time with ``O_NOFOLLOW`` (a symlink on the way is refused), and the name
    to delete in it; None when a directory on the way is absent (nothing to delete)."""
    root = _root_of(path, roots)
    assert root is not None  # replay() refused deletions outside the roots
    parent, _, name = ("/" + path)[len(root) + 1 :].rpartition("/")
    with contextlib.ExitStack() as stack:
        root_fd = open_in(stack, root, DIR_FLAGS)
        try:
            fd = _open_dir(root_fd, root, parent, create=False, member=path)
        except FileNotFoundError:
            yield None
            return
        stack.callback(os.close, fd)
        yield fd, name


def _delete(path: str, roots: list[str]) -> None:
    """Delete ``/path`` relative to its parent's descriptor: a directory with ``rmtree``
    (which opens every level with ``O_NOFOLLOW`` too), anything else, a link included, with
    ``unlink`` (the link goes, never what it points at)."""
    with _deletion_parent(path, roots) as found:
        if found is None:
            return
        fd, name = found
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)


# -- local record (the warm path) --------------------------------------------------------------


def _record(
    state_dir: str | os.PathLike,
    key: str,
    roots: list[str],
    members: list[Member],
    deleted: list[str],
) -> None:
    rows = []
    for m in members:
        try:
            st = os.lstat("/" + m.path)
        except FileNotFoundError:
            continue
        rows.append([m.path, stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns])
    record = {
        "key": key,
        "roots": roots,
        "entries": rows,
        "deleted": deleted,
        "written": time.time(),
    }
    _write_record(state_dir, f"{key}.json", json.dumps(record).encode())


def _write_record(state_dir: str | os.PathLike, name: str, data: bytes) -> None:
    """``<state dir>/captures/<name>``, through descriptors: ``captures`` opened with
    ``O_NOFOLLOW``, the record created with ``O_EXCL | O_NOFOLLOW`` under a temporary name and
    renamed over the old one (a link there is replaced, never written through)."""
    directory = make_dir(Path(state_dir))  # the node's state: 0700 when created here
    with contextlib.ExitStack() as stack:
        state_fd = open_in(stack, directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        with contextlib.suppress(FileExistsError):
            os.mkdir("captures", 0o700, dir_fd=state_fd)
        try:
            fd = open_in(stack, "captures", DIR_FLAGS, state_fd)
        except OSError as exc:
            raise SnapshotError(
                f"{directory}/captures is a symlink or not a directory "
                f"({exc.strerror}); the capture record is never written "
                f"through one"
            ) from None
        os.fchmod(fd, 0o700)  # private whatever the umask, also on nodes set up before
        replace_file(fd, name, data, 0o600)


def verify_capture(key: str, state_dir: str | os.PathLike) -> bool:
    """The captured changes of ``key`` are in place on this host (stats only)."""
    try:
        record = json.loads((Path(state_dir) / "captures" / f"{key}.json").read_text())
    except (OSError, ValueError):
        return False
    for path, fmt, size, mtime_ns in record.get("entries", []):
        try:
            st = os.lstat("/" + path)
        except OSError:
            return False
        if stat.S_IFMT(st.st_mode) != fmt:
            return False
        if fmt == stat.S_IFREG and (st.st_size != size or st.st_mtime_ns != mtime_ns):
            return False
    return all(not os.path.lexists("/" + p) for p in record.get("deleted", []))
