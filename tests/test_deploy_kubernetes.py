"""deploy/kubernetes/ checked without a cluster: the kinds and their required fields, volumes,
and every command, flag, variable, port and path against bootseer's and torch's own parsers
and defaults (nothing here repeats a default by hand)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from bootseer.config import SCHEMA, ConfigError, config_from_args, parse_ranks
from bootseer.variables import known_variable

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"

# (apiVersion, kind) -> dotted paths that must be present (the API's required fields, and the
# ones a workload cannot do without).
KINDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("apps/v1", "DaemonSet"): (
        "metadata.name",
        "spec.selector.matchLabels",
        "spec.template.metadata.labels",
        "spec.template.spec.containers",
    ),
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): ("metadata.name", "spec.replicatedJobs"),
    ("v1", "Service"): ("metadata.name", "spec.selector", "spec.ports"),
}
JOB_REQUIRED = ("template.spec.containers", "template.spec.restartPolicy")


def documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = [
        (path, doc)
        for path in sorted(DEPLOY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]
    assert docs, f"no manifests under {DEPLOY}"
    return docs


def dig(doc: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        assert isinstance(doc, dict) and part in doc, f"missing {dotted} (at {part})"
        doc = doc[part]
    return doc


def one(kind: str) -> dict[str, Any]:
    [doc] = [d for _, d in documents() if d["kind"] == kind]
    return doc


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template in the manifests."""
    out = []
    for path, doc in documents():
        if doc["kind"] == "DaemonSet":
            out.append((f"{path.name}: {doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
        if doc["kind"] == "JobSet":
            for rj in doc["spec"]["replicatedJobs"]:
                out.append(
                    (f"{path.name}: {rj['name']}", rj["template"]["spec"]["template"]["spec"])
                )
    return out


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment, a placeholder for values Kubernetes fills in."""
    return {e["name"]: e.get("value", "0") for e in c.get("env", [])}


def bootseer_config(c: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    """The container's bootseer command parsed by bootseer's own parser and its
    configuration loaded (flags and BOOTSEER_* variables checked); (args, config)."""
    from bootseer.cli import build_parser

    monkeypatch.setattr("os.geteuid", lambda: 0)  # the containers run as root
    command = c["command"]
    assert command[0] == "bootseer", command
    argv, tail = command[1:], None
    if "--" in argv:  # as bootseer's main splits off the command to run
        argv, tail = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = build_parser().parse_args(argv)
    if tail is not None:
        assert args.takes_command, f"{command[:2]} takes no command after --"
        args.command = tail
    return args, config_from_args(args, env=container_env(c))


def bootseer_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [
        (where, spec, c)
        for where, spec in pod_specs()
        for c in containers(spec)
        if c["command"][0] == "bootseer"
    ]


def test_every_document_is_a_known_kind_with_its_required_fields() -> None:
    seen = set()
    for path, doc in documents():
        key = (doc.get("apiVersion"), doc.get("kind"))
        assert key in KINDS, f"{path.name}: unknown {key}"
        seen.add(key)
        for field in KINDS[key]:
            dig(doc, field)
        if doc["kind"] == "JobSet":
            for rj in doc["spec"]["replicatedJobs"]:
                assert rj["name"] and rj["replicas"] >= 1
                for field in JOB_REQUIRED:  # the batch/v1 Job template inside
                    dig(rj["template"]["spec"], field)
                assert rj["template"]["spec"]["template"]["spec"]["restartPolicy"] in (
                    "Never",
                    "OnFailure",
                )  # a Job's pods may not restart Always
        if doc["kind"] == "DaemonSet":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert seen == set(KINDS)


def test_containers_have_images_commands_and_declared_volumes() -> None:
    for where, spec in pod_specs():
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for c in containers(spec):
            assert c.get("image") and c.get("command"), f"{where}: {c.get('name')}"
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where}: {c['name']} mounts undeclared {m['name']}"
            for e in c.get("env", []):
                assert ("value" in e) != ("valueFrom" in e), f"{where}: env {e['name']}"


def test_bootseer_variables_are_known_and_their_values_valid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = {spec.env for section in SCHEMA.values() for spec in section.values()}
    keys |= {
        alias for section in SCHEMA.values() for spec in section.values() for alias in spec.aliases
    }
    named = 0
    for where, _, c in bootseer_containers():
        for name in container_env(c):
            if name.startswith("BOOTSEER_"):
                named += 1
                assert name in keys or known_variable(name), f"{where}: unknown {name}"
        bootseer_config(c, monkeypatch)  # raises ConfigError on a bad value or flag
    assert named


def test_a_bad_variable_in_a_manifest_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    [(_, _, c)] = [x for x in bootseer_containers() if x[2]["name"] == "train"]
    bad = {**c, "env": [*c["env"], {"name": "BOOTSEER_CKPT_CONECTIONS", "value": "4"}]}
    with pytest.raises(ConfigError, match="BOOTSEER_CKPT_CONECTIONS"):
        bootseer_config(bad, monkeypatch)


def host_paths(spec: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
    """Container mount path -> hostPath, for the hostPath volumes the container mounts."""
    vols = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes", []) if "hostPath" in v}
    return {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in vols}


def on_host_path(path: str, mounts: dict[str, str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def test_snapshotter_paths_are_the_configuration_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    [(where, spec, c)] = [x for x in bootseer_containers() if x[2]["command"][1] == "snapshotter"]
    _, cfg = bootseer_config(c, monkeypatch)
    mounts = host_paths(spec, c)
    for key in ("root", "address", "registry_config_path"):
        value = cfg.get(f"snapshotter.{key}")
        if key != "registry_config_path":
            assert value == SCHEMA["snapshotter"][key].default, f"{where}: snapshotter.{key}"
        target = value if key != "address" else str(Path(value).parent)
        assert on_host_path(target, mounts), f"{where}: {target} is not on a hostPath"
        assert mounts.get(target, target) == target  # the same path inside and on the node
    assert c["securityContext"]["privileged"] is True
    assert "/dev/fuse" in mounts
    root_mount = [m for m in c["volumeMounts"] if m["mountPath"] == cfg.get("snapshotter.root")]
    assert root_mount[0]["mountPropagation"] == "Bidirectional"


def test_worker_state_lies_on_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """warmup and run resolve the same state, trace, cache and prefix, all on the hostPath
    that outlives the pod, and the state dir is bootseer's default for root."""
    from bootseer.config import default_state_dir

    monkeypatch.setattr("os.geteuid", lambda: 0)
    seen = {}
    for where, spec, c in bootseer_containers():
        if c["command"][1] not in ("run", "warmup"):
            continue
        _, cfg = bootseer_config(c, monkeypatch)
        assert cfg.get("state.dir") == default_state_dir({})
        mounts = host_paths(spec, c)
        paths = {
            k: cfg.get(k)
            for k in ("state.dir", "run.trace_dir", "ckpt.cache_dir", "env.prefix", "image.cache")
        }
        for key, path in paths.items():
            assert on_host_path(path, mounts), f"{where}: {key} {path} is not on a hostPath"
        seen[c["command"][1]] = paths
        assert cfg.get("ckpt.url") and cfg.get("env.store")
        # the node's ranks: completion index 1 (a placeholder) x LOCAL_WORLD_SIZE
        env = {**container_env(c), "NODE_RANK": "1"}
        local = int(env["LOCAL_WORLD_SIZE"])
        assert parse_ranks(cfg.get("ckpt.ranks"), env) == list(range(local, 2 * local))
    assert seen["run"] == seen["warmup"]


def test_torchrun_meets_the_controller_through_the_headless_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.run import get_args_parser

    jobset, service = one("JobSet"), one("Service")
    [(_, _, train)] = [x for x in bootseer_containers() if x[2]["name"] == "train"]
    args, _ = bootseer_config(train, monkeypatch)
    command = args.command
    assert command[0] == "torchrun"
    tr = get_args_parser().parse_args(command[1:])
    assert tr.rdzv_backend == "c10d" and ":" in tr.nnodes
    host, port = tr.rdzv_endpoint.rsplit(":", 1)
    assert int(port) == DEFAULT_PORT
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert host in (name, f"{name}.{namespace}", f"{name}.{namespace}.svc")
    assert namespace == jobset["metadata"]["namespace"]

    assert service["spec"]["clusterIP"] == "None"  # headless: DNS names the pod itself
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        (DEFAULT_PORT, DEFAULT_PORT)
    ]
    # the selector picks the one replicated job whose container serves that port
    selector = service["spec"]["selector"]
    assert selector[JOBSET_LABEL] == jobset["metadata"]["name"]
    serving = [
        rj
        for rj in jobset["spec"]["replicatedJobs"]
        if any(
            p["containerPort"] == DEFAULT_PORT
            for c in rj["template"]["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        )
    ]
    assert [rj["name"] for rj in serving] == [selector[REPLICATED_JOB_LABEL]]
    [rj] = serving
    assert rj["replicas"] == 1 and rj["template"]["spec"]["parallelism"] == 1
    [store] = rj["template"]["spec"]["template"]["spec"]["containers"]
    code = store["command"][-1]
    assert "TCPStore" in code and "is_master=True" in code
    assert re.search(rf"\b{DEFAULT_PORT}\b", code)
    assert set(selector) <= {JOBSET_LABEL, REPLICATED_JOB_LABEL}


def test_the_jobset_restarts_as_its_notes_say() -> None:
    jobset = one("JobSet")
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    [workers] = [rj for rj in jobset["spec"]["replicatedJobs"] if rj["name"] == "workers"]
    job = workers["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    [warmup] = pod["initContainers"]
    assert warmup["command"][:2] == ["bootseer", "warmup"]
    [train] = pod["containers"]
    after = train["command"][train["command"].index("--") + 1 :]
    assert after[0] == "torchrun"
    assert after[after.index("--max-restarts") + 1] == "0"  # bootseer run restarts
    notes = (DEPLOY / "README.md").read_text()
    for word in (
        "JobSet",
        "/dev/fuse",
        "privileged",
        "Secret",
        "hostPath",
        "bootseer.io/pool",
        "maxRestarts",
    ):
        assert word in notes
    assert shlex.join(after)  # a plain argv, no shell
