"""fsspec's own conformance suite (``fsspec.tests.abstract``) against ``striped::``.

fsspec ships the tests its backends must pass (copy, get, put, open, pipe); here they run
against ``striped::memory://``, ``striped::file://`` and ``striped::s3://`` (the session's
moto server), every test of every group, nothing skipped or expected to fail. One class per
group and target, as fsspec's own backends do it: in one class, ``AbstractPutTests``'
``test_copy_with_source_and_destination_as_list`` would be hidden by the copy group's test
of the same name.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec.tests.abstract as abstract
import pytest
from conftest import s3_bucket_of
from fsspec.implementations.memory import MemoryFileSystem

from striped_fs import StripedFileSystem


def _join(*parts: str) -> str:
    return "/".join(parts)


class _Fixtures(abstract.AbstractFixtures):
    """What every target shares: forward-slash paths."""

    @pytest.fixture
    def fs_join(self):
        return _join


class _Memory(_Fixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls) -> Iterator[StripedFileSystem]:
        target = MemoryFileSystem(skip_instance_cache=True)
        target.store, target.pseudo_dirs = {}, [""]  # private to this class, not the global one
        fs = StripedFileSystem(fs=target, skip_instance_cache=True)
        yield fs
        fs.close()

    @pytest.fixture
    def fs_path(self) -> str:
        return f"/suite-{uuid.uuid4().hex[:8]}"


class _Local(_Fixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls) -> Iterator[StripedFileSystem]:
        fs = StripedFileSystem(target_protocol="file", skip_instance_cache=True)
        yield fs
        fs.close()

    @pytest.fixture
    def fs_path(self, tmp_path) -> str:
        return str(tmp_path / "remote")


class _S3(_Fixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls, s3_server) -> Iterator[StripedFileSystem]:
        fs = StripedFileSystem(
            target_protocol="s3",
            skip_instance_cache=True,
            target_options={**s3_server.storage_options(), "skip_instance_cache": True},
        )
        yield fs
        fs.close()

    @pytest.fixture(scope="class")
    @classmethod
    def bucket(cls, s3_server) -> Iterator[str]:
        """One bucket per class (emptied and deleted after it); each test a fresh path in it."""
        for name, _ in s3_bucket_of(s3_server):
            yield name

    @pytest.fixture
    def fs_path(self, fs: StripedFileSystem, bucket: str) -> str:
        fs.invalidate_cache()
        return f"{bucket}/suite-{uuid.uuid4().hex[:8]}"

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return False


class TestMemoryCopy(_Memory, abstract.AbstractCopyTests):
    pass


class TestMemoryGet(_Memory, abstract.AbstractGetTests):
    pass


class TestMemoryPut(_Memory, abstract.AbstractPutTests):
    pass


class TestMemoryOpen(_Memory, abstract.AbstractOpenTests):
    pass


class TestMemoryPipe(_Memory, abstract.AbstractPipeTests):
    pass


class TestLocalCopy(_Local, abstract.AbstractCopyTests):
    pass


class TestLocalGet(_Local, abstract.AbstractGetTests):
    pass


class TestLocalPut(_Local, abstract.AbstractPutTests):
    pass


class TestLocalOpen(_Local, abstract.AbstractOpenTests):
    pass


class TestLocalPipe(_Local, abstract.AbstractPipeTests):
    pass


class TestS3Copy(_S3, abstract.AbstractCopyTests):
    pass


class TestS3Get(_S3, abstract.AbstractGetTests):
    pass


class TestS3Put(_S3, abstract.AbstractPutTests):
    pass


class TestS3Open(_S3, abstract.AbstractOpenTests):
    pass


class TestS3Pipe(_S3, abstract.AbstractPipeTests):
    pass
