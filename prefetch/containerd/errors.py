"""Errors shared by the containerd client and the snapshotter, each tied to the gRPC status
code containerd uses for it (containerd's errdefs map codes to errors and back: a
snapshotter answering ALREADY_EXISTS to a Prepare is the remote-snapshot handshake)."""

from __future__ import annotations

import grpc

from ..errors import PrefetchError


class ContainerdError(PrefetchError):
    """A containerd API call failed; ``code`` is the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class NotFoundError(ContainerdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ContainerdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(ContainerdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgumentError(ContainerdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class UnavailableError(ContainerdError):
    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE = {
    cls.code: cls
    for cls in (
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        InvalidArgumentError,
        UnavailableError,
    )
}


def from_status(code: grpc.StatusCode, message: str) -> ContainerdError:
    """The error class for a gRPC status (ContainerdError for codes without their own)."""
    cls = _BY_CODE.get(code, ContainerdError)
    return cls(message, code)
