"""Attack tests for striped manifests: the bytes are crafted here, by hand, never by the
project's writer (which refuses to produce them).

A manifest is untrusted input: every size and count it declares is checked against the others
and against caps before anything is allocated from it, a read allocates no more than the
stripe bytes that came back and checked out, and a manifest cannot make a reader (or a
remover) touch any object outside the file's own ``.NAME.stripes/<version>/`` directory.
Every refusal names the file and the rule.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from canary import Canary

from striped_fs import ManifestError, StripeChecksumError, StripedFileSystem
from striped_fs.layout import MAGIC, MAX_MANIFEST_SIZE, MAX_STRIPES, Manifest

# The manifest magic, spelled out: these tests write manifests byte by byte.
RAW_MAGIC = b"BOOTSEER-STRIPED\x00v1\n"
VERSION = "0123456789abcdef" * 2
GiB = 1 << 30


def raw_manifest(**fields: object) -> bytes:
    """A format-1 manifest with ``fields`` replacing (or, as ``None``, removing) the defaults:
    a valid empty file unless told otherwise."""
    body: dict[str, object] = {
        "format": 1,
        "size": 0,
        "stripe_size": 4096,
        "version": VERSION,
        "checksum": "crc32",
        "stripes": [],
        "created": 0,
    }
    body.update(fields)
    body = {k: v for k, v in body.items() if v is not None}
    return RAW_MAGIC + json.dumps(body, separators=(",", ":")).encode()


# The attack: ~150 bytes (165) declaring a 4 GiB file in one 4 GiB stripe (over the
# stripe size cap, refused as it is parsed) ...
HUGE_ONE_STRIPE = raw_manifest(size=4 * GiB, stripe_size=4 * GiB, stripes=[0])
# ... and 171 bytes declaring 4 GiB within every cap (four 1 GiB stripes): only the stripes
# can tell, and nothing may be allocated before they do.
HUGE = raw_manifest(size=4 * GiB, stripe_size=GiB, stripes=[0, 0, 0, 0])


def test_the_crafted_manifests_are_small():
    assert RAW_MAGIC == MAGIC
    assert len(HUGE_ONE_STRIPE) == 165 and len(HUGE) == 171
    manifest = Manifest.from_bytes(HUGE, path="f")
    assert (manifest.size, manifest.stripe_count) == (4 * GiB, 4)


@pytest.fixture(params=["file", "memory"])
def target(request, tmp_path):
    """A striped filesystem over local disk or fsspec's memory store, and a root directory."""
    if request.param == "file":
        fs = StripedFileSystem(
            target_protocol="file",
            concurrency=4,
            retries=1,
            backoff_s=0.01,
            skip_instance_cache=True,
        )
        root = str(tmp_path)
    else:
        fs = StripedFileSystem(
            target_protocol="memory",
            concurrency=4,
            retries=1,
            backoff_s=0.01,
            skip_instance_cache=True,
        )
        root = f"/attack-{tmp_path.name}"
        fs.target.mkdir(root)
    yield fs, root
    if request.param == "memory":
        fs.target.rm(root, recursive=True)


# -- a huge declared size: nothing allocated from it -----------------------------------------

_PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from striped_fs import StripedFileSystem

    path, op, out = sys.argv[1], sys.argv[2], sys.argv[3]
    fs = StripedFileSystem(target_protocol="file", concurrency=4, retries=1, backoff_s=0.01,
                           skip_instance_cache=True)
    fs.target.info(path)  # warm up: imports
    fs.backend._executor()  # and the thread pool
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = None
    try:
        if op == "cat_file":
            fs.cat_file(path)
        elif op == "cat_range":
            fs.cat_file(path, 3 * 2**30, 3 * 2**30 + 4096)
        elif op == "read":
            with fs.open(path, "rb") as f:
                f.read()
        elif op == "get_file":
            fs.get_file(path, out)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew_kib": after - before, "error": error}))
""")


@pytest.mark.parametrize("stripes", ["one 4 GiB stripe", "missing", "short"])
@pytest.mark.parametrize("op", ["cat_file", "cat_range", "read", "get_file"])
def test_huge_declared_size_fails_without_allocating_it(stripes, op, tmp_path):
    """A manifest of 150-odd bytes declaring 4 GiB: refused as parsed (a 4 GiB stripe is over
    the cap), or the read fails at the first stripe that is missing or shorter than declared;
    either way the error names the file and the rule, and the process's peak memory
    (ru_maxrss, in a fresh subprocess) grows by megabytes, not gigabytes."""
    (tmp_path / "f").write_bytes(HUGE_ONE_STRIPE if stripes == "one 4 GiB stripe" else HUGE)
    if stripes == "short":
        vdir = tmp_path / ".f.stripes" / VERSION
        vdir.mkdir(parents=True)
        for i in range(4):
            (vdir / f"{i:08d}").write_bytes(b"x")
    out = tmp_path / "out.bin"
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "f"), op, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    error = result["error"]
    assert error is not None, "a 4 GiB file with bad stripes was read without an error"
    assert f"{tmp_path}/f" in error and "stripe" in error
    if stripes == "one 4 GiB stripe":
        assert error.startswith("ManifestError") and "striped manifest refused" in error
        assert f"stripe_size {4 * GiB} must be an integer from 1 to {GiB}" in error
    elif stripes == "missing":
        assert error.startswith("FileNotFoundError") and "does not exist" in error
        assert f"{tmp_path}/.f.stripes/{VERSION}/0000000" in error
    else:
        assert error.startswith("StripeChecksumError")
        assert f"holds 1 bytes, manifest says {GiB}" in error
    assert result["grew_kib"] < 64 * 1024, f"peak memory grew by {result['grew_kib']} KiB"
    if out.exists():  # a failed download never takes the declared size
        assert out.stat().st_size < 1 << 20


def test_huge_declared_size_on_s3_fails_at_the_stripes(s3_bucket):
    """The same attack against a real object store (moto): missing, empty and over-long
    stripe objects are each named with the rule they break."""
    bucket, options = s3_bucket
    fs = StripedFileSystem(
        target_protocol="s3",
        target_options=options,
        retries=1,
        backoff_s=0.01,
        skip_instance_cache=True,
    )
    fs.target.pipe_file(f"{bucket}/huge", HUGE)
    with pytest.raises(FileNotFoundError, match=rf"stripe \d of {bucket}/huge.*does not exist"):
        fs.cat_file(f"{bucket}/huge")
    small = raw_manifest(size=8192, stripes=[0, 0])
    fs.target.pipe_file(f"{bucket}/small", small)
    fs.target.pipe_file(f"{bucket}/.small.stripes/{VERSION}/00000000", b"")
    fs.target.pipe_file(f"{bucket}/.small.stripes/{VERSION}/00000001", b"y" * 5000)
    with pytest.raises(
        StripeChecksumError, match="stripe 0 of .*holds 0 bytes, manifest says 4096"
    ):
        fs.cat_file(f"{bucket}/small", 0, 4096)
    with pytest.raises(
        StripeChecksumError, match="stripe 1 of .*holds more than 4096 bytes, manifest says 4096"
    ):
        fs.cat_file(f"{bucket}/small", 4096, 8192)


# -- declared sizes and counts that do not add up -------------------------------------------

_REFUSED = [
    # (case, manifest bytes, what the error must say)
    ("negative size", raw_manifest(size=-1), "size -1 must be an integer from 0"),
    (
        "size not an integer",
        raw_manifest(size=4096.0, stripes=[0]),
        "size 4096.0 must be an integer",
    ),
    ("size a boolean", raw_manifest(size=True, stripes=[0]), "size True must be an integer"),
    ("size over the cap", raw_manifest(size=1 << 62), f"size {1 << 62} must be an integer from 0"),
    ("negative stripe size", raw_manifest(stripe_size=-4096), "stripe_size -4096 must be"),
    ("zero stripe size", raw_manifest(stripe_size=0), "stripe_size 0 must be"),
    (
        "stripe size over the cap",
        raw_manifest(size=4 * GiB, stripe_size=4 * GiB, stripes=[0]),
        f"stripe_size {4 * GiB} must be an integer from 1 to {GiB}",
    ),
    (
        "fewer checksums than stripes",
        raw_manifest(size=3 * 4096, stripes=[0, 0]),
        "(3 stripes) but lists 2 checksums",
    ),
    (
        "more checksums than stripes",
        raw_manifest(size=4096, stripes=[0, 0, 0, 0]),
        "(1 stripes) but lists 4 checksums",
    ),
    (
        "stripes for an empty file",
        raw_manifest(size=0, stripes=[0]),
        "(0 stripes) but lists 1 checksums",
    ),
    (
        "stripe count over the cap",
        raw_manifest(size=1 << 40, stripe_size=1, stripes=[0]),
        f"{1 << 40} stripes: over the limit of {MAX_STRIPES}",
    ),
    ("stripes not a list", raw_manifest(size=4096, stripes={"0": 0}), "stripes must be a list"),
    (
        "checksum negative",
        raw_manifest(size=8192, stripes=[0, -1]),
        "checksum of stripe 1 (-1) must be a crc32",
    ),
    (
        "checksum too wide",
        raw_manifest(size=4096, stripes=[1 << 32]),
        f"checksum of stripe 0 ({1 << 32}) must be a crc32",
    ),
    ("checksum a string", raw_manifest(size=4096, stripes=["0"]), "checksum of stripe 0 ('0')"),
    # v1 derives each stripe's offset (index x stripe_size) and length: a manifest trying to
    # declare its own offsets (overlapping, out of order) is refused, whatever the field.
    (
        "overlapping stripes as objects",
        raw_manifest(size=8192, stripes=[{"offset": 0, "crc": 0}, {"offset": 100, "crc": 0}]),
        "checksum of stripe 0 ({'offset': 0, 'crc': 0}) must be a crc32",
    ),
    (
        "out-of-order offsets",
        raw_manifest(size=8192, stripes=[0, 0], offsets=[4096, 0]),
        "unknown field(s) 'offsets'",
    ),
    (
        "stripe lengths",
        raw_manifest(size=8192, stripes=[0, 0], lengths=[8192, 8192]),
        "unknown field(s) 'lengths'",
    ),
    (
        "duplicate size field",
        RAW_MAGIC
        + b'{"format":1,"size":0,"size":4294967296,"stripe_size":4096,"version":"'
        + VERSION.encode()
        + b'","checksum":"crc32","stripes":[],"created":0}',
        "field 'size' appears twice",
    ),
    ("missing field", raw_manifest(stripe_size=None), "missing field(s) stripe_size"),
    ("not an object", RAW_MAGIC + b"[1, 2, 3]", "not a JSON object"),
    ("format as a boolean", raw_manifest(format=True), "format True/'crc32' is not supported"),
    ("created not a number", raw_manifest(created="yesterday"), "created 'yesterday' must be"),
    (
        "created NaN",
        RAW_MAGIC + raw_manifest()[len(RAW_MAGIC) :].replace(b'"created":0', b'"created":NaN'),
        "created nan must be a finite number",
    ),
    # Format 2 is format 1 plus an mtime_ns (integer nanoseconds, signed 64-bit).
    ("mtime_ns in format 1", raw_manifest(mtime_ns=5), "unknown field(s) 'mtime_ns'"),
    ("format 2 without mtime_ns", raw_manifest(format=2), "format 2 is format 1 with an mtime_ns"),
    ("mtime_ns a float", raw_manifest(format=2, mtime_ns=1.5), "mtime_ns 1.5 must be an integer"),
    ("mtime_ns a string", raw_manifest(format=2, mtime_ns="1"), "mtime_ns '1' must be an integer"),
    (
        "mtime_ns a boolean",
        raw_manifest(format=2, mtime_ns=True),
        "mtime_ns True must be an integer",
    ),
    (
        "mtime_ns null",
        RAW_MAGIC
        + raw_manifest(format=2, mtime_ns=0)[len(RAW_MAGIC) :].replace(
            b'"mtime_ns":0', b'"mtime_ns":null'
        ),
        "mtime_ns None must be an integer",
    ),
    (
        "mtime_ns over 64 bits",
        raw_manifest(format=2, mtime_ns=1 << 63),
        f"mtime_ns {1 << 63} must be an integer",
    ),
    (
        "mtime_ns under 64 bits",
        raw_manifest(format=2, mtime_ns=-(1 << 63) - 1),
        f"mtime_ns {-(1 << 63) - 1} must be an integer",
    ),
    (
        "duplicate mtime_ns",
        raw_manifest(format=2, mtime_ns=1)[:-1] + b',"mtime_ns":2}',
        "field 'mtime_ns' appears twice",
    ),
    ("format 3", raw_manifest(format=3, mtime_ns=1), "format 3/'crc32' is not supported"),
    (
        "unknown field in format 2",
        raw_manifest(format=2, mtime_ns=1, mode=0o644),
        "unknown field(s) 'mode'",
    ),
]


def test_mtime_ns_round_trip_and_format_number():
    """A manifest carries an mtime only when one was set, and only then is format 2: files
    nobody set a time on stay readable by readers that know format 1 alone."""
    plain = Manifest(size=0, stripe_size=4096, version=VERSION, created=0)
    assert json.loads(plain.to_bytes()[len(MAGIC) :])["format"] == 1
    timed = Manifest(size=0, stripe_size=4096, version=VERSION, created=0, mtime_ns=-(1 << 63))
    body = json.loads(timed.to_bytes()[len(MAGIC) :])
    assert (body["format"], body["mtime_ns"]) == (2, -(1 << 63))
    assert Manifest.from_bytes(timed.to_bytes(), path="f") == timed
    assert (
        Manifest.from_bytes(raw_manifest(format=2, mtime_ns=(1 << 63) - 1), path="f").mtime_ns
        == (1 << 63) - 1
    )


@pytest.mark.parametrize("case, data, rule", _REFUSED, ids=[c[0] for c in _REFUSED])
def test_inconsistent_manifest_is_refused_naming_file_and_rule(target, case, data, rule):
    fs, root = target
    fs.target.pipe_file(f"{root}/f", data)
    for read in (
        lambda: fs.cat_file(f"{root}/f"),
        lambda: fs.open(f"{root}/f", "rb"),
        lambda: fs.info(f"{root}/f"),
    ):
        with pytest.raises(ManifestError) as err:
            read()
        assert f"{root}/f" in str(err.value) and rule in str(err.value), str(err.value)
        assert err.value.path == f"{root}/f"


def test_oversized_manifest_bytes_are_refused():
    data = raw_manifest() + b" " * MAX_MANIFEST_SIZE
    with pytest.raises(ManifestError, match=f"over the {MAX_MANIFEST_SIZE}-byte limit"):
        Manifest.from_bytes(data, path="big")


def test_deeply_nested_manifest_is_a_manifest_error():
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_bytes(RAW_MAGIC + b"[" * 100_000 + b"]" * 100_000, path="deep")


# -- stripe objects: only ever inside the file's own stripes directory ------------------------

_ESCAPES = [
    ("parent directory", "../other"),
    ("the canary beside the file", "../canary"),  # .f.stripes/../canary
    ("absolute path", "/etc/passwd"),
    ("another file's stripes", f"../../.g.stripes/{VERSION}"),
    ("trailing newline", VERSION + "\n"),
    ("upper-case hex", VERSION.upper()),
    ("too short", VERSION[:31]),
    ("not a string", 12345),
]


@pytest.mark.parametrize("case, version", _ESCAPES, ids=[c[0] for c in _ESCAPES])
def test_version_cannot_point_outside_the_stripes_directory(target, case, version, tmp_path):
    """Reading, replacing or removing the file touches nothing outside its own stripes."""
    fs, root = target
    canary = Canary.plant(tmp_path / "canary")  # beside f on the file target
    fs.target.pipe_file(f"{root}/f", raw_manifest(size=4096, stripes=[0], version=version))
    with pytest.raises(ManifestError, match="version .* must be 32 lowercase hex digits") as err:
        fs.cat_file(f"{root}/f")
    assert f"{root}/f" in str(err.value)
    for remove in (lambda: fs.pipe_file(f"{root}/f", b"new f"), lambda: fs.rm(f"{root}/f")):
        try:
            remove()
        except ManifestError:
            pass  # refusing is fine too; touching the canary is not
    canary.assert_unchanged()


@pytest.mark.parametrize("field", ["stripe_paths", "objects", "stripes_dir", "prefix"])
def test_manifest_cannot_name_its_stripe_objects(target, field):
    fs, root = target
    data = raw_manifest(size=4096, stripes=[0], **{field: ["../g", f"{root}/g"]})
    fs.target.pipe_file(f"{root}/f", data)
    with pytest.raises(ManifestError, match=f"unknown field\\(s\\) '{field}'"):
        fs.cat_file(f"{root}/f")


def test_another_files_manifest_reads_only_its_own_stripes(target):
    """g's manifest copied byte for byte to f (same version): f's stripes are looked up under
    ``.f.stripes``, never g's; replacing and removing f leaves g's stripes alone."""
    fs, root = target
    secret = b"g's private bytes " * 1000
    fs.pipe_file(f"{root}/g", secret)  # an honest file, written by the writer
    fs.target.pipe_file(f"{root}/f", fs.target.cat_file(f"{root}/g"))  # the copy, raw
    with pytest.raises(
        FileNotFoundError, match=r"\.f\.stripes/[0-9a-f]{32}/00000000 does not exist"
    ):
        fs.cat_file(f"{root}/f")
    with pytest.raises(FileNotFoundError, match=r"\.f\.stripes/"):
        fs.open(f"{root}/f", "rb").read()
    fs.pipe_file(f"{root}/f", b"new f")  # commits over the copy: removes f's "previous version"
    fs.rm(f"{root}/f")
    assert fs.cat_file(f"{root}/g") == secret


def test_stripe_names_are_derived_and_validated():
    from striped_fs.layout import stripe_path, version_dir

    assert stripe_path("d/f", VERSION, 3) == f"d/.f.stripes/{VERSION}/00000003"
    for bad in ("../x", VERSION + "\n", ""):
        with pytest.raises(ValueError, match="32 lowercase hex digits"):
            version_dir("d/f", bad)
    with pytest.raises(ValueError, match="non-negative integer"):
        stripe_path("d/f", VERSION, -1)


def test_writer_refuses_more_stripes_than_readers_accept(monkeypatch):
    import striped_fs.writer as writer

    monkeypatch.setattr(writer, "MAX_STRIPES", 3)
    fs = StripedFileSystem(target_protocol="memory", stripe_size=4096, skip_instance_cache=True)
    with pytest.raises(
        ValueError, match="more than 3 stripes of 4096 bytes; write it with a larger stripe_size"
    ):
        with fs.open("/many", "wb") as f:
            f.write(b"z" * 4 * 4096)
    assert not fs.exists("/many")
