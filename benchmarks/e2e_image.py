"""The training image of the end-to-end scenario, built from this machine without a Dockerfile.

Two gzip layers, as ``docker build`` would push them:

1. ``base``: Debian bookworm + python3.11 (``bench_prefetch.build_base``: debootstrap, or a
   minimal rootfs copied from this host's Debian packages when the mirror is out of reach);
2. ``runtime``: the job's code and the bootseer entrypoint with its dependencies, under
   ``/opt/bootseer`` (``site/`` on ``PYTHONPATH``, ``bin/uv``), pip, and ``/app/train.py``.
   torch is *not* in the image: it is the job's environment (``/job/requirements.txt``),
   installed by ``pip`` in the baseline and restored from a snapshot by bootseer;
3. ``deps`` (the do-it-yourself image only, ``build_deps_tree``): the job's requirements (torch
   and its dependencies) installed from the same wheels into the image's
   ``/usr/local/lib/python3.X/dist-packages``, where the baseline's ``pip install`` puts them:
   the image a team bakes so that no start installs anything.

The runtime's distributions are copied from the virtual environment running the benchmark (the
closure of the project's dependencies without torch): same Python minor, same wheels. Layers
are cached under ``CACHE/image/e2e`` by a digest of what goes into them (``e2e_cache``), and
their gzip blobs by the sha256 of their (deterministic) tar stream.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata as md
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import e2e_cache
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HOST_LIBFUSE = "/usr/lib/x86_64-linux-gnu/libfuse.so.2"
LIBFUSE = "/usr/lib/x86_64-linux-gnu/libfuse.so.2"  # in the runtime layer
PROJECT_PACKAGES = ("bootseer", "ckpt", "snapshot", "striped_fs", "prefetch")
EXCLUDED = {"torch"}  # the job's environment, not the image
EXTRA_TOOLS = ("pip", "uv")
SITE = "opt/bootseer/site"
IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONPATH": f"/{SITE}",
    "BOOTSEER_ENV_UV": "/opt/bootseer/bin/uv",  # key env.uv
    "LANG": "C.UTF-8",
    "HOME": "/root",
}
MiB = 1 << 20


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions() -> list[md.Distribution]:
    """The installed distributions the project needs at run time (torch excluded), + pip, uv."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(d).name for d in deps] + list(EXTRA_TOOLS)
    seen: dict[str, md.Distribution] = {}
    while todo:
        name = _norm(todo.pop())
        if name in seen or name in EXCLUDED:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as exc:
            raise RuntimeError(
                f"{name} is not installed in {sys.prefix}: run `make setup`"
            ) from exc
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def runtime_sources() -> tuple[dict[str, Path], list[str]]:
    """Every file the runtime layer copies, by its path in the tree, and the distributions
    (``name==version``): what :func:`build_runtime_tree` builds from, and the layer's cache key
    is a digest of."""
    files: dict[str, Path] = {}
    dists = runtime_distributions()
    for dist in dists:
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel))
            if not src.exists() or "__pycache__" in rel.parts:
                continue
            if rel.parts[0] == "..":  # console scripts and binaries under the venv's bin/
                if src.name == "uv":
                    files["opt/bootseer/bin/uv"] = src
                continue
            files[f"{SITE}/{rel}"] = src
    for pkg in PROJECT_PACKAGES:  # bootseer.testing is not part of the runtime
        for dirpath, dirs, names in os.walk(ROOT / pkg):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "testing"))
            for name in names:
                if not name.endswith(".pyc") and name != "testing":
                    src = Path(dirpath) / name
                    files[f"{SITE}/{src.relative_to(ROOT)}"] = src
    # libfuse2 for a lazy environment (bootseer-lazy: fusepy loads it by FUSE_LIBRARY_PATH,
    # the minimal rootfs has no ldconfig cache); no fusermount: the container's root mounts
    if os.path.exists(HOST_LIBFUSE):
        files[LIBFUSE.lstrip("/")] = Path(os.path.realpath(HOST_LIBFUSE))
    files["app/train.py"] = ROOT / "benchmarks/e2e_train.py"
    return files, [f"{d.metadata['Name']}=={d.version}" for d in dists]


def build_runtime_tree(dest: Path, files: dict[str, Path]) -> None:
    """``dest`` becomes the runtime layer's tree: ``files`` (:func:`runtime_sources`), the
    entrypoint's distribution metadata and the bytecode."""
    (dest / SITE).mkdir(parents=True)
    (dest / "opt/bootseer/bin").mkdir(parents=True)
    for rel, src in files.items():
        _copy_file(src, dest / rel)
    site = dest / SITE
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "bootseer/__init__.py").read_text())
    info = site / f"bootseer-{version.group(1) if version else '0'}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: bootseer\nVersion: {version.group(1) if version else '0'}\n"
    )
    (info / "entry_points.txt").write_text(
        "[console_scripts]\nbootseer = bootseer.cli:main\n\n"
        "[fsspec.specs]\nstriped = striped_fs.filesystem:StripedFileSystem\n"
    )
    (info / "RECORD").write_text("")
    compile_tree(site, f"/{SITE}")


def compile_tree(tree: Path, ddir: str) -> None:
    """Bytecode now (as an image build does), not in every container's first start.
    unchecked-hash: valid whatever the files' mtimes (the layer's tar sets them all alike)."""
    compileall.compile_dir(
        str(tree),
        quiet=2,
        ddir=ddir,
        workers=os.cpu_count() or 1,
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )


def build_deps_tree(dest: Path, wheel_dir: Path, requirements: list[str]) -> dict[str, Any]:
    """``dest`` becomes the baked-dependencies layer's tree: ``requirements`` installed offline
    from ``wheel_dir`` (the wheels the package index serves) into the image's system
    site-packages, as the ``RUN pip install`` line of a Dockerfile would."""
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"  # the image's python3 (the runtime layer's rule)
    rel = f"usr/local/lib/python{pyver}/dist-packages"
    site = dest / rel
    site.mkdir(parents=True)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(wheel_dir),
            "--no-compile",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(site),
            *requirements,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"pip install --target {site} {' '.join(requirements)} failed "
            f"(wheels from {wheel_dir}): {r.stderr[-2000:]}"
        )
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with this host's shebang
    compile_tree(site, f"/{rel}")
    return {"requirements": requirements, "site": f"/{rel}"}


def layer_from_tree(tree: Path, cache: Path, name: str, level: int = 6) -> dict[str, Any]:
    """``tar --sort=name`` of ``tree`` (its sha256 is the diff ID), gzip -6 (``docker
    build``'s level) once per diff ID. ``level`` 1: a quick run's (CI builds the image afresh
    each time; -1 packed 763 MB of torch in 9.3 s against -6's 28.2 s, 234 MB against 204 MB),
    cached apart."""
    cache.mkdir(parents=True, exist_ok=True)
    tar_path = cache / f"{name}.tar.partial"
    run = subprocess.run(
        [
            "tar",
            "-C",
            str(tree),
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "--sort=name",
            "--mtime=@1700000000",
            "-cf",
            str(tar_path),
            ".",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"tar of {tree} failed: {run.stderr[-2000:]}")
    diff = hashlib.sha256()
    with open(tar_path, "rb") as f:
        while block := f.read(8 * MiB):
            diff.update(block)
    diff_id = "sha256:" + diff.hexdigest()
    tag = diff.hexdigest()[:16] + ("" if level == 6 else f"-gz{level}")
    meta_path = cache / f"{name}-{tag}.json"
    gz_path = cache / f"{name}-{tag}.tar.gz"
    if meta_path.exists() and e2e_cache.layer_intact(json.loads(meta_path.read_text())):
        tar_path.unlink()
        return json.loads(meta_path.read_text())
    with open(gz_path.with_suffix(".partial"), "wb") as out:
        subprocess.run(["gzip", f"-{level}", "-n", "-c", str(tar_path)], stdout=out, check=True)
    os.replace(gz_path.with_suffix(".partial"), gz_path)
    gz = hashlib.sha256()
    with open(gz_path, "rb") as f:
        while block := f.read(8 * MiB):
            gz.update(block)
    meta = {
        "name": name,
        "diff_id": diff_id,
        "tar_bytes": tar_path.stat().st_size,
        "path": str(gz_path),
        "digest": "sha256:" + gz.hexdigest(),
        "size": gz_path.stat().st_size,
    }
    tar_path.unlink()
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def image_config(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The training image's OCI config."""
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": [f"{k}={v}" for k, v in IMAGE_ENV.items()],
            "Cmd": ["/usr/bin/python3"],
            "WorkingDir": "/app",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer["diff_id"] for layer in layers]},
    }


def push_image(
    registry: str, repo: str, tag: str, layers: list[dict[str, Any]], config: dict[str, Any]
) -> str:
    """Push gzip layers (``path``, ``digest``, ``size``), the OCI config and the manifest;
    returns the manifest digest."""
    from prefetch.mediatypes import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST
    from prefetch.registry import SyncRegistry

    async def chunks(path: str) -> Any:
        with open(path, "rb") as f:
            while block := f.read(8 * MiB):
                yield block

    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    config_digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    with SyncRegistry(registry) as reg:
        for layer in layers:
            reg.put_blob(repo, chunks(layer["path"]), layer["digest"])
        reg.put_blob(repo, blob, config_digest)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(blob)},
                "layers": [
                    {"mediaType": OCI_LAYER_GZIP, "digest": layer["digest"], "size": layer["size"]}
                    for layer in layers
                ],
            },
            separators=(",", ":"),
        ).encode()
        return reg.put_manifest(repo, tag, manifest, OCI_MANIFEST)


def training_layers(cache: Path, work: Path, base_choice: str, level: int = 6) -> dict[str, Any]:
    """The training image's layers at gzip ``level``, built once per content under
    ``cache/image`` (``e2e_cache.cached_layer``): the base (``bench_prefetch.build_base``'s
    ``base_choice``), keyed by its record and its tree, and the runtime layer, keyed by the
    files it copies; both by this module's source (the recipe). ``work`` holds the runtime tree
    while it is packed. Returns ``{"base", "layers", "distributions"}``."""
    import bench_prefetch as bp

    image_dir = cache / "image"
    image_dir.mkdir(parents=True, exist_ok=True)
    layers_dir = image_dir / "e2e"
    recipe = e2e_cache.file_sha256(Path(__file__))
    base = bp.build_base(image_dir, base_choice)
    name = f"base-{base['source']}"
    base_tree = image_dir / name
    base_key = e2e_cache.content_key(
        e2e_cache.tree_files(base_tree), recipe, json.dumps(base, sort_keys=True), str(level)
    )
    layers = [
        e2e_cache.cached_layer(
            layers_dir, name, base_key, lambda: layer_from_tree(base_tree, layers_dir, name, level)
        )
    ]
    files, dists = runtime_sources()

    def runtime() -> dict[str, Any]:
        tree = work / "runtime-tree"
        try:
            build_runtime_tree(tree, files)
            return layer_from_tree(tree, layers_dir, "runtime", level)
        finally:
            shutil.rmtree(tree, ignore_errors=True)

    runtime_key = e2e_cache.content_key(files, recipe, sys.version, str(level))
    layers.append(e2e_cache.cached_layer(layers_dir, "runtime", runtime_key, runtime))
    return {"base": base, "layers": layers, "distributions": dists}
