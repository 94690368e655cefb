"""The end-to-end benchmark's content-keyed cache under ``--cache``: work one run did that the
next (the same cache directory: the one-node quick run, then the 2-node run on its cache, as
test_e2e.py runs them) takes instead of doing it again.

* Image layers (:func:`cached_layer`): keyed by a digest of what goes into the layer (the
  files' contents, modes and paths, and the recipe), so a hit skips building the tree, tar and
  gzip. :func:`tree_files` lists a tree for :func:`content_key`.
* Conversions to bootseer's layer format (:func:`convert_cached`): keyed by the source
  manifest's digest (content-addressed: the same layers and config give the same digest in a
  fresh registry); the converted blobs, manifest and the conversion's result are kept and pushed
  into the run's registry instead of converting again.

An entry is used only after every blob it names digests to its recorded digest; a stale or
damaged one is rebuilt (a layer) or converted again (an image), never pushed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
CONVERTED = "image/e2e/converted"  # under --cache: one entry per source manifest digest


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            h.update(block)
    return "sha256:" + h.hexdigest()


def tree_files(root: Path) -> dict[str, Path]:
    """Every entry under ``root`` (files, symlinks, directories; symlinks not followed) by its
    path relative to ``root``: a tree's content for :func:`content_key`."""
    found: dict[str, Path] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = path
    return found


def content_key(files: dict[str, Path], *parts: str) -> str:
    """A digest of ``files`` (path in the layer -> source: a symlink's target, a directory's
    mode, a file's mode and sha256) and ``parts`` (what else decides the layer: the recipe,
    the Python version, the gzip level). Equal keys: equal layer contents."""
    h = hashlib.sha256(json.dumps(parts).encode())
    for rel in sorted(files):
        path = files[rel]
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = f"L {os.readlink(path)}"
        elif stat.S_ISDIR(st.st_mode):
            what = f"D {stat.S_IMODE(st.st_mode):o}"
        elif stat.S_ISREG(st.st_mode):
            what = f"F {stat.S_IMODE(st.st_mode):o} {file_sha256(path)}"
        else:  # a device node (debootstrap's /dev), a fifo: never read
            what = f"O {st.st_mode:o} {st.st_rdev}"
        h.update(f"{rel}\0{what}\n".encode())
    return h.hexdigest()


def intact(path: Path, digest: str, size: int | None = None) -> bool:
    """Whether ``path`` holds the blob ``digest`` (of ``size`` bytes when given)."""
    try:
        if size is not None and path.stat().st_size != size:
            return False
        return file_sha256(path) == digest
    except OSError:
        return False


def layer_intact(meta: dict[str, Any]) -> bool:
    """Whether a layer's recorded gzip blob (``path``, ``digest``, ``size``) is still it."""
    try:
        return intact(Path(meta["path"]), meta["digest"], int(meta["size"]))
    except (KeyError, TypeError, ValueError):
        return False


def cached_layer(
    directory: Path, name: str, key: str, build: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The layer ``name`` whose inputs digest to ``key``: the recorded one when its blob is
    intact, else ``build()``'s (``e2e_image.layer_from_tree``'s meta), recorded for the next
    run."""
    ref = directory / f"{name}-src-{key[:32]}.json"
    try:
        meta = json.loads(ref.read_text())
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and layer_intact(meta):
        return {**meta, "reused": True}
    meta = build()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_suffix(f".partial-{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, ref)
    return meta


# -- conversions ---------------------------------------------------------------------------------


def convert_cached(
    root: Path, src: str, dst: str, convert: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Image ``dst`` as the conversion of ``src``: the one kept under ``root`` for ``src``'s
    manifest digest, pushed, when it is intact; else ``convert()``'s (which converts ``src``
    into ``dst`` and returns the result to record), kept for the next run. Returns the result
    with the converted layers' ``"layer_digests"`` and ``"cached"``: whether it came from
    ``root``."""
    from prefetch.reference import Reference
    from prefetch.registry import SyncRegistry

    src_ref = Reference.parse(src)
    with SyncRegistry(src_ref.registry) as reg:
        source = reg.resolve_image(src_ref).digest
    entry = root / source.removeprefix("sha256:")
    kept = _read_entry(entry)
    cached = kept is not None
    if kept is not None:
        _push_entry(entry, kept, dst)
    else:
        kept = _keep_entry(entry, dst, source, convert())
    return {**kept["result"], "layer_digests": kept["layer_digests"], "cached": cached}


def _read_entry(entry: Path) -> dict[str, Any] | None:
    """The entry's record when it is the conversion of the source it is named by and its
    manifest and every blob the manifest names are intact."""
    from prefetch.image import SOURCE_ANNOTATION

    try:
        record = json.loads((entry / "entry.json").read_text())
        if not intact(entry / "manifest.json", record["manifest"]):
            return None
        doc = json.loads((entry / "manifest.json").read_bytes())
        source = f"sha256:{entry.name}"
        if record["source"] != source or doc["annotations"][SOURCE_ANNOTATION] != source:
            return None
        for desc in [doc["config"], *doc["layers"]]:
            if not intact(_blob(entry, desc["digest"]), desc["digest"], int(desc["size"])):
                return None
        record["layer_digests"] = [desc["digest"] for desc in doc["layers"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def _blob(entry: Path, digest: str) -> Path:
    return entry / "blobs" / digest.removeprefix("sha256:")


def _keep_entry(entry: Path, dst: str, source: str, result: dict[str, Any]) -> dict[str, Any]:
    """Copy ``dst``'s manifest and blobs (each checked against its digest as it is read) into
    ``entry``, written aside and renamed into place whole; returns the entry's record."""
    from prefetch.reference import Reference
    from prefetch.registry import SyncRegistry

    ref = Reference.parse(dst)
    tmp = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "blobs").mkdir(parents=True)
    with SyncRegistry(ref.registry) as reg:
        manifest = reg.get_manifest(ref.repository, ref.ref)
        doc = manifest.parsed
        for desc in [doc["config"], *doc["layers"]]:
            with open(_blob(tmp, desc["digest"]), "wb") as f:
                for chunk in reg.iter_blob(ref.repository, desc["digest"]):
                    f.write(chunk)
    (tmp / "manifest.json").write_bytes(manifest.data)
    record = {
        "source": source,
        "manifest": manifest.digest,
        "media_type": manifest.media_type,
        "layer_digests": [desc["digest"] for desc in doc["layers"]],
        "result": result,
    }
    (tmp / "entry.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(entry, ignore_errors=True)  # a damaged one
    try:
        os.replace(tmp, entry)
    except OSError:  # another run kept it first
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _push_entry(entry: Path, record: dict[str, Any], dst: str) -> None:
    """Push the kept conversion's blobs and manifest to ``dst``; the registry must give the
    manifest the digest it had."""
    from prefetch.reference import Reference
    from prefetch.registry import SyncRegistry

    ref = Reference.parse(dst)
    data = (entry / "manifest.json").read_bytes()
    doc = json.loads(data)
    with SyncRegistry(ref.registry) as reg:
        for desc in [doc["config"], *doc["layers"]]:
            reg.put_blob(ref.repository, _chunks(_blob(entry, desc["digest"])), desc["digest"])
        digest = reg.put_manifest(ref.repository, ref.ref, data, record["media_type"])
    if digest != record["manifest"]:
        raise RuntimeError(
            f"{dst}: the kept conversion in {entry} was pushed as {digest}, not "
            f"{record['manifest']}: remove {entry} and run again"
        )


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            yield block
