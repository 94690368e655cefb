"""A small CRI client: the calls the kubelet makes to containerd's CRI plugin, so that the
Kubernetes path (CRI pulls a pod's image through the snapshotter, with the kubelet's pull
secret, then runs the pod) can be driven and tested without a kubelet.

It speaks the project's own definition of the CRI v1 API
(``prefetch/containerd/api/cri/runtime/v1/api.proto``) over containerd's socket; containerd
keeps everything CRI creates in its ``k8s.io`` namespace. gRPC failures are raised as
:mod:`prefetch.containerd.errors` classes naming the call and the object.

    with CRIClient("/run/containerd/containerd.sock") as cri:
        image_id = cri.pull_image("registry:5000/team/train:v1", auth=("user", "secret"))
        pod = host_network_pod("train", log_directory="/var/log/pods/train")
        sandbox = cri.run_pod_sandbox(pod)
        cid = cri.create_container(sandbox, pod, container_config(
            "main", "registry:5000/team/train:v1", ["python3", "train.py"], "main.log"))
        cri.start_container(cid)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import grpc

from .api.cri.runtime.v1 import api_pb2 as cri
from .api.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from .client import dial, unary
from .errors import ContainerdError

_T = TypeVar("_T")

STATES = {
    cri.CONTAINER_CREATED: "created",
    cri.CONTAINER_RUNNING: "running",
    cri.CONTAINER_EXITED: "exited",
    cri.CONTAINER_UNKNOWN: "unknown",
}


@dataclass(frozen=True)
class ImageFs:
    """One image filesystem as CRI reports it (``ImageFsInfo``): the kubelet statfs()es
    ``mountpoint`` for the capacity and garbage-collects images against ``used_bytes``."""

    mountpoint: str
    used_bytes: int
    inodes_used: int
    timestamp_ns: int


@dataclass(frozen=True)
class ContainerState:
    """A container's state (``ContainerStatus``): "created", "running", "exited", "unknown"."""

    id: str
    state: str
    exit_code: int
    reason: str
    message: str
    image_ref: str
    log_path: str


@dataclass(frozen=True)
class ExecResult:
    stdout: bytes
    stderr: bytes
    exit_code: int


def host_network_pod(
    name: str,
    *,
    log_directory: str,
    namespace: str = "default",
    uid: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> cri.PodSandboxConfig:
    """A pod sandbox on the node's network, PID and IPC namespaces off (a ``hostNetwork: true``
    pod): it needs no CNI plugin. Container logs go under ``log_directory``."""
    ns = cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(
            name=name, namespace=namespace, uid=uid or uuid.uuid4().hex
        ),
        log_directory=log_directory,
        labels=dict(labels or {}),
        linux=cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(namespace_options=ns)
        ),
    )


def container_config(
    name: str,
    image: str,
    command: Sequence[str],
    log_path: str,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    mounts: Sequence[tuple[str, str]] = (),
) -> cri.ContainerConfig:
    """A container of ``image`` running ``command`` with its output in ``log_path`` (relative
    to the pod's log directory); ``mounts`` are (host path, container path) bind mounts."""
    return cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name),
        image=cri.ImageSpec(image=image),
        command=list(command),
        args=list(args),
        log_path=log_path,
        envs=[cri.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
        mounts=[cri.Mount(host_path=h, container_path=c) for h, c in mounts],
    )


def log_text(raw: str) -> str:
    """The output a CRI log file holds: each line is ``<time> <stream> <P|F> <text>``; ``P``
    marks a partial line (continued by the next record), ``F`` a full one."""
    out: list[str] = []
    for record in raw.splitlines():
        parts = record.split(" ", 3)
        if len(parts) < 3:
            continue
        text = parts[3] if len(parts) == 4 else ""
        out.append(text if parts[2] == "P" else text + "\n")
    return "".join(out)


class CRIClient:
    """containerd's CRI services (``runtime.v1.RuntimeService`` and ``ImageService``)."""

    def __init__(self, address: str, *, timeout_s: float = 300.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = dial(address)
        self._runtime = cri_grpc.RuntimeServiceStub(self._channel)
        self._images = cri_grpc.ImageServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, what: str, method: Callable[..., _T], request: Any, timeout_s: float | None = None
    ) -> _T:
        return unary(what, method, request, self.timeout_s if timeout_s is None else timeout_s)

    # -- runtime ------------------------------------------------------------------------------
    def version(self) -> cri.VersionResponse:
        return self._call("CRI version", self._runtime.Version, cri.VersionRequest(version="v1"))

    def conditions(self) -> dict[str, bool]:
        """The runtime's conditions (``RuntimeReady``, ``NetworkReady``)."""
        resp = self._call("CRI status", self._runtime.Status, cri.StatusRequest())
        return {c.type: c.status for c in resp.status.conditions}

    def run_pod_sandbox(self, config: cri.PodSandboxConfig) -> str:
        """Starts the pod's sandbox (its pause container); returns the sandbox ID."""
        resp = self._call(
            f"run pod sandbox {config.metadata.name!r}",
            self._runtime.RunPodSandbox,
            cri.RunPodSandboxRequest(config=config),
        )
        return resp.pod_sandbox_id

    def stop_pod_sandbox(self, sandbox_id: str) -> None:
        self._call(
            f"stop pod sandbox {sandbox_id}",
            self._runtime.StopPodSandbox,
            cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
        )

    def remove_pod_sandbox(self, sandbox_id: str) -> None:
        self._call(
            f"remove pod sandbox {sandbox_id}",
            self._runtime.RemovePodSandbox,
            cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
        )

    def list_pod_sandboxes(self) -> dict[str, str]:
        """Every sandbox: ID -> pod name."""
        resp = self._call(
            "list pod sandboxes", self._runtime.ListPodSandbox, cri.ListPodSandboxRequest()
        )
        return {item.id: item.metadata.name for item in resp.items}

    def create_container(
        self, sandbox_id: str, sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig
    ) -> str:
        """Creates a container in the sandbox (its rootfs is prepared from the image's top
        snapshot); returns its ID."""
        resp = self._call(
            f"create container {config.metadata.name!r} of {config.image.image}",
            self._runtime.CreateContainer,
            cri.CreateContainerRequest(
                pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox
            ),
        )
        return resp.container_id

    def start_container(self, container_id: str) -> None:
        self._call(
            f"start container {container_id}",
            self._runtime.StartContainer,
            cri.StartContainerRequest(container_id=container_id),
        )

    def stop_container(self, container_id: str, timeout_s: int = 0) -> None:
        self._call(
            f"stop container {container_id}",
            self._runtime.StopContainer,
            cri.StopContainerRequest(container_id=container_id, timeout=timeout_s),
        )

    def remove_container(self, container_id: str) -> None:
        self._call(
            f"remove container {container_id}",
            self._runtime.RemoveContainer,
            cri.RemoveContainerRequest(container_id=container_id),
        )

    def container_status(self, container_id: str) -> ContainerState:
        s = self._call(
            f"status of container {container_id}",
            self._runtime.ContainerStatus,
            cri.ContainerStatusRequest(container_id=container_id),
        ).status
        return ContainerState(
            s.id,
            STATES.get(s.state, "unknown"),
            s.exit_code,
            s.reason,
            s.message,
            s.image_ref,
            s.log_path,
        )

    def wait_exited(self, container_id: str, timeout_s: float = 60.0) -> ContainerState:
        """Polls the container's status until it has exited (the kubelet polls the same way)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.container_status(container_id)
            if state.state == "exited":
                return state
            if time.monotonic() > deadline:
                raise ContainerdError(
                    f"container {container_id} is still {state.state} after {timeout_s:.0f} s",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
            time.sleep(0.1)

    def exec_sync(self, container_id: str, cmd: Sequence[str], timeout_s: int = 30) -> ExecResult:
        """Runs ``cmd`` in a running container and returns its output (``kubectl exec``)."""
        resp = self._call(
            f"exec {list(cmd)!r} in container {container_id}",
            self._runtime.ExecSync,
            cri.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout_s),
            timeout_s=timeout_s + 30,
        )
        return ExecResult(resp.stdout, resp.stderr, resp.exit_code)

    # -- images -------------------------------------------------------------------------------
    def pull_image(
        self,
        image: str,
        *,
        auth: tuple[str, str] | None = None,
        sandbox: cri.PodSandboxConfig | None = None,
    ) -> str:
        """Pulls ``image`` as the kubelet does, with ``auth`` = (user, password) from a pull
        secret; returns the image ID."""
        request = cri.PullImageRequest(image=cri.ImageSpec(image=image), sandbox_config=sandbox)
        if auth is not None:
            request.auth.CopyFrom(cri.AuthConfig(username=auth[0], password=auth[1]))
        return self._call(f"pull image {image}", self._images.PullImage, request).image_ref

    def image_status(self, image: str) -> cri.Image | None:
        """The image's record, or None when it is not present."""
        resp = self._call(
            f"status of image {image}",
            self._images.ImageStatus,
            cri.ImageStatusRequest(image=cri.ImageSpec(image=image)),
        )
        return resp.image if resp.HasField("image") else None

    def remove_image(self, image: str) -> None:
        self._call(
            f"remove image {image}",
            self._images.RemoveImage,
            cri.RemoveImageRequest(image=cri.ImageSpec(image=image)),
        )

    def image_fs_info(self) -> list[ImageFs]:
        resp = self._call(
            "image filesystem info", self._images.ImageFsInfo, cri.ImageFsInfoRequest()
        )
        return [
            ImageFs(fs.fs_id.mountpoint, fs.used_bytes.value, fs.inodes_used.value, fs.timestamp)
            for fs in resp.image_filesystems
        ]
