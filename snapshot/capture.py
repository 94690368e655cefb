"""Capture mode: snapshot what a setup command added, changed or deleted under some paths.

Not every dependency is a venv: CUDA extensions built into ``/usr/local``, a tool unpacked
into ``/opt/tool``, model assets under ``/data/cache``. ``ensure_capture`` records the state
of the capture roots (type, size, mtime, ctime, inode, mode, link target of every entry), runs
the command, and packs every entry that is new or different, plus the list of deletions. The
snapshot's member paths are relative to ``/`` (``opt/tool/bin/x``).

Replay extracts each root's members into a staging directory beside that root (same
filesystem), then moves every entry into place with ``rename`` (atomic per file) through
directory descriptors opened with ``O_NOFOLLOW`` — a host symlink on the way is a conflict,
never followed — and applies the deletions. Members outside the roots the caller named are
refused: the roots of an untrusted snapshot are never trusted, only the caller's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsspec.callbacks import DEFAULT_CALLBACK, Callback

from striped_fs.private import make_dir

from .ensure import EnsureResult, open_store, publish_tree
from .errors import SnapshotError, StoreUnavailable, UnsafeMemberError
from .extract import Extractor
from .install import run_command
from .key import EnvKey, compute_key
from .manifest import DIR, FILE, HARDLINK, SYMLINK, Manifest, Member
from .restore import _ChunkPipeline, fetch_toc
from .safety import Plan, check_path, plan_extraction
from .store import SnapshotStore

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def state_dir() -> Path:
    """Where replayed captures are recorded: ``BOOTSEER_STATE_DIR``, else /var/lib/bootseer
    (root) or ~/.cache/bootseer."""
    explicit = os.environ.get("BOOTSEER_STATE_DIR")
    if explicit:
        return Path(explicit)
    if os.geteuid() == 0:
        return Path("/var/lib/bootseer")
    return Path.home() / ".cache" / "bootseer"


def normalize_roots(paths: Sequence[str]) -> list[str]:
    roots = sorted({os.path.normpath(os.path.abspath(p)) for p in paths})
    for root in roots:
        if root == "/":
            raise SnapshotError("--capture / is not allowed: name the directories the setup "
                                "command changes (e.g. /usr/local, /opt/tool)")
        for other in roots:
            if other != root and other.startswith(root + "/"):
                raise SnapshotError(f"capture paths {root} and {other} overlap; name one")
    return roots


# -- recording -------------------------------------------------------------------------------

Signature = tuple[Any, ...]


def scan(root: str) -> dict[str, Signature]:
    """``{path relative to /: signature}`` of everything under ``root`` (root included)."""
    found: dict[str, Signature] = {}
    if not os.path.lexists(root):
        return found

    def sig(st: os.stat_result, link: str = "") -> Signature:
        return (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns,
                st.st_ctime_ns, st.st_ino, link)

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
    pruned = [p for p in deleted
              if not any(p.startswith(d + "/") for d in deleted if d != p)]
    return Changes(changed, pruned)


# -- entry point -----------------------------------------------------------------------------

def ensure_capture(paths: Sequence[str], command: Sequence[str], *,
                   store: str | SnapshotStore | None,
                   storage_options: dict[str, Any] | None = None, key: EnvKey | None = None,
                   rebuild: bool = False, progress: Callback = DEFAULT_CALLBACK
                   ) -> EnsureResult:
    """Hit: replay the captured changes (or only verify them). Miss: run ``command``,
    capture what it changed under ``paths``, publish."""
    start = time.perf_counter()
    roots = normalize_roots(paths)
    env_key = key or compute_key((), command, capture=roots)
    shown = " ".join(roots)
    if not rebuild and verify_capture(env_key.key):
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
        replay(snapshots, manifest, roots, progress=progress)
        return EnsureResult(env_key.key, shown, "restored", time.perf_counter() - start)
    before = {}
    for root in roots:
        before.update(scan(root))
    run_command(list(command), prefix=Path(roots[0]))
    after = {}
    for root in roots:
        after.update(scan(root))
    changes = diff(before, after)
    log.info("setup changed %d and deleted %d entries under %s", len(changes.changed),
             len(changes.deleted), shown)
    outcome = "installed-locally"
    if snapshots is not None:
        try:
            _publish_capture(snapshots, env_key, roots, changes)
            outcome = "built"
        except (SnapshotError, OSError) as exc:
            warnings.append(f"captured the setup but could not publish it: {exc}")
            log.warning("%s", warnings[-1])
    _record(env_key.key, roots, [Member(p, _kind(after[p]), 0, 0) for p in changes.changed],
            changes.deleted)
    return EnsureResult(env_key.key, shown, outcome, time.perf_counter() - start,
                        warnings=warnings)


def _kind(sig: Signature) -> str:
    fmt = sig[0]
    return DIR if fmt == stat.S_IFDIR else SYMLINK if fmt == stat.S_IFLNK else FILE


def _publish_capture(snapshots: SnapshotStore, env_key: EnvKey, roots: list[str],
                     changes: Changes) -> None:
    publish_tree(snapshots, env_key, Path("/"), kind="capture", installer="capture",
                 paths=changes.changed, capture={"roots": roots, "deleted": changes.deleted})


# -- replay ----------------------------------------------------------------------------------

def _root_of(path: str, roots: list[str]) -> str | None:
    absolute = "/" + path
    for root in roots:
        if absolute == root or absolute.startswith(root + "/"):
            return root
    return None


def replay(snapshots: SnapshotStore, manifest: Manifest, roots: list[str], *,
           progress: Callback = DEFAULT_CALLBACK) -> None:
    """Apply a capture snapshot under ``roots`` (the caller's; see the module docstring)."""
    if manifest.kind != "capture":
        raise SnapshotError(f"snapshot {manifest.key} is an environment for "
                            f"{manifest.prefix}, not a capture; use --prefix")
    declared = manifest.capture.get("roots")
    if declared != roots:
        raise SnapshotError(f"snapshot {manifest.key} captured {declared}, not {roots}")
    deleted = manifest.capture.get("deleted", [])
    if not isinstance(deleted, list):
        raise SnapshotError(f"snapshot {manifest.key}: invalid list of deletions")
    members = fetch_toc(snapshots, manifest)
    plan_extraction(members, manifest.stream_size)  # the rules, on the whole TOC first
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
            raise UnsafeMemberError(member.path, "member outside the capture paths "
                                                 f"{', '.join(roots)}")
        rel = member.path[len(root):].lstrip("/") if "/" + member.path != root else ""
        if rel:
            link = member.link
            if member.kind == HARDLINK:
                if _root_of(link, [root]) is None:
                    raise UnsafeMemberError(member.path, "hardlink to another capture root")
                link = link[len(root):].lstrip("/")
            per_root[root].append(Member(rel, member.kind, member.mode, member.mtime_ns,
                                         member.size, member.offset, link))
    staged: list[tuple[str, Path, Plan]] = []
    try:
        extractors = []
        for root, root_members in per_root.items():
            Path(root).mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{Path(root).name}.bootseer-capture-",
                                            dir=Path(root).parent))
            plan = plan_extraction(root_members, manifest.stream_size)
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
            _delete("/" + path)
        for root, staging, plan in staged:
            _apply(staging, Path(root), plan)
    finally:
        for _, staging, _ in staged:
            shutil.rmtree(staging, ignore_errors=True)
    _record(manifest.key, roots, members, deleted)


class _Fanout:
    def __init__(self, extractors: list[Extractor]) -> None:
        self.extractors = extractors

    def feed(self, index: int, raw: bytes | memoryview) -> None:
        for extractor in self.extractors:
            extractor.feed(index, raw)


def _open_dir(root_fd: int, rel: str, *, create: bool) -> int:
    """A descriptor of ``root/rel``, never following a symlink on the way."""
    fd = os.dup(root_fd)
    for part in [p for p in rel.split("/") if p]:
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                os.close(fd)
                raise
            os.mkdir(part, 0o755, dir_fd=fd)
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise SnapshotError(f"cannot replay into {rel!r}: {part!r} is not a directory on "
                                f"this host ({exc.strerror}); a symlink there is never "
                                f"followed") from exc
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
                raise SnapshotError(f"cannot replay into {root / sub}: it is not a directory "
                                    f"on this host; a symlink there is never followed")

    for member in plan.dirs:
        dirs_on_the_way(member.path)
    for member in plan.files + plan.symlinks + plan.hardlinks:
        parent = member.path.rpartition("/")[0]
        if parent:
            dirs_on_the_way(parent)
        try:
            if stat.S_ISDIR(os.lstat(root / member.path).st_mode):
                raise SnapshotError(f"cannot replay {root / member.path}: a directory is in "
                                    f"the way of a file")
        except FileNotFoundError:
            pass


def _apply(staging: Path, root: Path, plan: Plan) -> None:
    """Move every staged entry into ``root`` (rename: atomic per entry)."""
    root_fd = os.open(root, _DIR_FLAGS)
    staging_fd = os.open(staging, _DIR_FLAGS)
    try:
        for member in plan.dirs:
            fd = _open_dir(root_fd, member.path, create=True)
            os.close(fd)
        for member in plan.files + plan.symlinks + plan.hardlinks:
            parent, _, name = member.path.rpartition("/")
            src_fd = _open_dir(staging_fd, parent, create=False)
            dst_fd = _open_dir(root_fd, parent, create=True)
            try:
                try:
                    st = os.lstat(name, dir_fd=dst_fd)
                    if stat.S_ISDIR(st.st_mode):
                        raise SnapshotError(f"cannot replay {root}/{member.path}: a directory "
                                            f"is in the way of a file")
                except FileNotFoundError:
                    pass
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            finally:
                os.close(src_fd)
                os.close(dst_fd)
        for member in sorted(plan.dirs, key=lambda m: m.path.count("/"), reverse=True):
            fd = _open_dir(root_fd, member.path, create=False)
            try:
                os.fchmod(fd, member.mode)
                os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
        os.close(staging_fd)


def _delete(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


# -- local record (the warm path) --------------------------------------------------------------

def _record(key: str, roots: list[str], members: list[Member], deleted: list[str]) -> None:
    rows = []
    for m in members:
        try:
            st = os.lstat("/" + m.path)
        except FileNotFoundError:
            continue
        rows.append([m.path, stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns])
    directory = make_dir(state_dir() / "captures", tighten=True)  # the node's state: 0700
    record = {"key": key, "roots": roots, "entries": rows, "deleted": deleted,
              "written": time.time()}
    tmp = directory / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / f"{key}.json")


def verify_capture(key: str) -> bool:
    """The captured changes of ``key`` are in place on this host (stats only)."""
    try:
        record = json.loads((state_dir() / "captures" / f"{key}.json").read_text())
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
