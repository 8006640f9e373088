"""deploy/kubernetes: every manifest parses, validates against the Kubernetes schema (bundled,
offline), and runs real ringwatch and Ray commands with real settings. No cluster is needed.

The kustomizations are rendered here for the features they use (resources, namespace,
labels, images, JSON 6902 patches); where kubectl is on PATH its own rendering must agree.
`python -m tests.test_deploy` prints the objects each kustomization renders.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from ringwatch.services.version import ringwatch_version

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
EXCLUSIVE = DEPLOY / "overlays" / "exclusive-gpus"
INFINIBAND = DEPLOY / "overlays" / "rdma-infiniband"
EFA = DEPLOY / "overlays" / "efa"
KUSTOMIZATIONS = (BASE, EXCLUSIVE, INFINIBAND, EFA)
# The migration Job: a name per ringwatch version, so applying the next version's makes a
# new Job instead of changing a finished one's pod template (which Kubernetes refuses).
MIGRATE_JOB = "ringwatch-migrate-" + ringwatch_version().replace(".", "-")
# The node label (and taint key) that sets a node aside for workers that hold its devices.
SET_ASIDE = "ringwatch.io/set-aside"
EXAMPLE = ROOT / "examples" / "k8s-init-container.yaml"
DOCS = ROOT / "docs" / "kubernetes.md"
# The oldest Kubernetes the manifests are meant for; strict: an unknown field is an error.
K8S_VERSION = "1.29.0"
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")
# Words that start a shell command without being one; what follows them is the command.
SHELL_WORDS = {"exec", "if", "then", "else", "elif", "until", "while", "do", "!"}
SECRET_SETTINGS = {"RINGWATCH_DATABASE_URL", "RINGWATCH_TOKEN", "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN",
                   "RINGWATCH_SECRET_KEY"}
# Kinds that live outside any namespace: kustomize's `namespace:` leaves them as they are.
CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding"})


# -- rendering ---------------------------------------------------------------------------


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _apply_json6902(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: object = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]  # type: ignore[index]
        index: int | str = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "test":
            assert node[index] == op["value"], op  # type: ignore[index]
        elif op["op"] == "remove":
            del node[index]  # type: ignore[arg-type,union-attr]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if index == "-" else int(index), op["value"])
        elif op["op"] in ("add", "replace"):
            node[index] = op["value"]  # type: ignore[index]
        else:
            raise AssertionError(f"the test renderer does not know {op}")


def _pod_specs(doc: dict) -> Iterator[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "Pod":
        yield spec
    elif doc["kind"] == "RayCluster":
        yield spec["headGroupSpec"]["template"]["spec"]
        for group in spec.get("workerGroupSpecs", []):
            yield group["template"]["spec"]
    elif "template" in spec:
        yield spec["template"]["spec"]


def _containers(doc: dict) -> Iterator[dict]:
    for pod in _pod_specs(doc):
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def render(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else _documents(path)
    docs = copy.deepcopy(docs)
    for doc in docs:
        if k.get("namespace") and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = k["namespace"]
        for label in k.get("labels", []):
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
        for image in k.get("images", []):
            for c in _containers(doc):
                name, _, _ = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    for patch in k.get("patches", []):
        target = patch["target"]
        matched = [d for d in docs if d["kind"] == target["kind"]
                   and d["metadata"]["name"] == target["name"]
                   and d["apiVersion"] == f"{target['group']}/{target['version']}"]
        assert len(matched) == 1, f"patch target {target} matches {len(matched)} resources"
        _apply_json6902(matched[0], yaml.safe_load(patch["patch"]))
    return docs


def manifests(directory: Path = BASE) -> list[dict]:
    return render(directory)


def find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def every_doc() -> Iterator[tuple[str, dict]]:
    for directory in KUSTOMIZATIONS:
        for doc in render(directory):
            yield f"{directory.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']}", doc
    for doc in _documents(EXAMPLE):
        yield f"{EXAMPLE.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']}", doc


def every_container() -> Iterator[tuple[str, dict]]:
    for where, doc in every_doc():
        for c in _containers(doc):
            yield f"{where} {c['name']}", c


# -- the files and the schema ------------------------------------------------------------


def test_every_kustomization_resource_exists_and_every_manifest_is_listed() -> None:
    for directory in KUSTOMIZATIONS:
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert k["kind"] == "Kustomization" and k["resources"], directory
        for entry in k["resources"]:
            path = (directory / entry).resolve()
            assert path.exists(), f"{directory}: {entry} does not exist"
            assert path.is_dir() == (path / "kustomization.yaml").exists(), entry
        listed = {(directory / e).resolve() for e in k["resources"]}
        orphans = {p.resolve() for p in directory.glob("*.yaml")} - listed - {
            (directory / "kustomization.yaml").resolve()}
        assert not orphans, f"{directory}: not in kustomization.yaml: {sorted(orphans)}"


def test_manifests_validate_against_the_kubernetes_schema() -> None:
    import kubernetes_validate

    def validate(where: str, doc: dict) -> None:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{where}: {path}: {exc.message}") from None

    checked = set()
    for where, doc in every_doc():
        if doc["apiVersion"] == "ray.io/v1":
            # A custom resource: no schema is bundled for it, but its pod templates are
            # Kubernetes' own and validate as such (its outer shape: another test).
            for name, template in _ray_templates(doc):
                validate(f"{where} {name}", {"apiVersion": "v1", "kind": "PodTemplate",
                                             "metadata": {"name": name}, "template": template})
        else:
            validate(where, doc)
        checked.add(doc["kind"])
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PersistentVolumeClaim",
            "RayCluster", "Pod", "DaemonSet", "Job", "PodDisruptionBudget",
            "NetworkPolicy"} <= checked


def test_the_schema_validation_refuses_what_a_cluster_would() -> None:
    """The validation above is strict: an unknown field or a wrong type is an error."""
    import kubernetes_validate

    api = find(manifests(), "Deployment", "ringwatch-api")
    bad = copy.deepcopy(api)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(api)
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _ray_templates(doc: dict) -> Iterator[tuple[str, dict]]:
    yield "head", doc["spec"]["headGroupSpec"]["template"]
    for group in doc["spec"].get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


# The RayCluster fields (ray.io/v1) these manifests may use, as KubeRay's API reference
# documents them; anything else is a typo KubeRay's CRD would prune or refuse.
RAY_SPEC = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec",
            "workerGroupSpecs", "suspend", "headServiceAnnotations", "managedBy",
            "gcsFaultToleranceOptions"}
RAY_HEAD = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
RAY_WORKER = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams",
              "template", "scaleStrategy", "numOfHosts", "suspend", "idleTimeoutSeconds"}


def test_the_raycluster_has_the_shape_kuberay_reads() -> None:
    for directory in KUSTOMIZATIONS:
        ray = find(render(directory), "RayCluster", "ringwatch")
        assert ray["apiVersion"] == "ray.io/v1"
        spec = ray["spec"]
        assert set(spec) <= RAY_SPEC, set(spec) - RAY_SPEC
        assert set(spec["headGroupSpec"]) <= RAY_HEAD
        assert "rayStartParams" in spec["headGroupSpec"]
        # Which Ray: the agent image's locked one (tests/test_images.py).
        assert re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"])
        # The GPU workers are the DaemonSet's: a worker group beside it would put a second
        # raylet on GPU nodes, and a fixed count of them would leave new nodes unwatched.
        assert not spec.get("workerGroupSpecs") and not spec.get("enableInTreeAutoscaling")
        for group in [spec["headGroupSpec"]]:
            # KubeRay turns each pair into --key=value: values are strings.
            assert all(isinstance(v, str) for v in group["rayStartParams"].values())
            assert group["template"]["spec"]["containers"], "KubeRay runs Ray in the first container"
        # Our own commands run only with this annotation; without it KubeRay would run its
        # generated `ray start` and the head would never start the scheduler.
        assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
        for _, template in _ray_templates(ray):
            ray_container = template["spec"]["containers"][0]
            script = " ".join(ray_container.get("command", []) + ray_container.get("args", []))
            assert "$KUBERAY_GEN_RAY_START_CMD" in script
            # KubeRay's default probes call wget, which the image lacks.
            assert "readinessProbe" in ray_container and "livenessProbe" in ray_container


def _gpu_agents(directory: Path = BASE) -> dict:
    return find(render(directory), "DaemonSet", "ringwatch-gpu-agent")


def _worker(directory: Path = BASE) -> dict:
    return _gpu_agents(directory)["spec"]["template"]["spec"]["containers"][0]


def test_the_head_runs_the_scheduler() -> None:
    ray = find(manifests(), "RayCluster", "ringwatch")
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    runs = [argv for argv in _ringwatch_argvs(head["template"]["spec"]["containers"][0])]
    assert [a[:1] for a in runs] == [["scheduler"]]
    args = _parse(runs[0])
    assert args.address == "auto" and args.backend == "nccl"
    # The scheduler's spool and rotation are on a volume that outlives the pod.
    mounts = {m["mountPath"]: m["name"] for m in head["template"]["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    state = volumes[mounts["/app/.ringwatch"]]
    claim = state["persistentVolumeClaim"]["claimName"]
    find(manifests(), "PersistentVolumeClaim", claim)
    assert _dockerfile_env()["RINGWATCH_STATE_DIR"] == "/app/.ringwatch"


def test_a_worker_runs_on_every_gpu_node_and_joins_the_head() -> None:
    docs = manifests()
    ray = find(docs, "RayCluster", "ringwatch")
    agents = _gpu_agents()
    pod = agents["spec"]["template"]["spec"]
    labels = agents["spec"]["template"]["metadata"]["labels"]
    assert agents["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Every GPU node, whatever its taint: GPU feature discovery's label, the GPU taint.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert gpu_taint in pod["tolerations"]
    # Host networking: the Ray worker's hostname, which names the node in ringwatch, is the
    # node's own, as a preflight's --nodes $(NODE_NAME) asks; so never two on one node.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert agents["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    worker = pod["containers"][0]
    assert "/dev/shm" in {m["mountPath"] for m in worker["volumeMounts"]}

    # It joins the head through the Service KubeRay makes for it, on the head's GCS port, as
    # the container's main process; Ray counts the GPUs the container sees (no --num-gpus),
    # and the scheduler places an agent on each.
    (start,) = [a for a in _ray_argvs(worker) if a[0] == "start"]
    options = _parse_ray(start)
    head_ports = {p["name"]: p["containerPort"] for p in
                  ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert options["address"] == f"{ray['metadata']['name']}-head-svc:{head_ports['gcs-server']}"
    assert options["block"] and options["num_gpus"] is None
    assert _commands(worker)[-1] == ["ray", *start] and "exec ray start" in _script(worker)
    env = {e["name"]: e for e in worker["env"]}
    assert options["node_ip_address"] == "$HOST_IP"
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    # A stop is graceful: Ray's processes stop in turn, within the grace period.
    stop = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:2] == ["ray", "stop"] and _parse_ray(stop[1:])
    assert pod["terminationGracePeriodSeconds"] > 16  # `ray stop`'s own grace period


def test_base_workers_share_the_gpus_and_exclusive_ones_hold_them_on_set_aside_nodes() -> None:
    shared = _worker(BASE)
    assert "nvidia.com/gpu" not in shared["resources"].get("limits", {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in shared["env"]
    exclusive = _worker(EXCLUSIVE)
    assert int(exclusive["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in exclusive["env"]}
    # Holding a node's GPUs, the worker runs only where a node is set aside for it.
    pod = _gpu_agents(EXCLUSIVE)["spec"]["template"]["spec"]
    assert pod["nodeSelector"][SET_ASIDE] == "true"
    assert {"key": SET_ASIDE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def _without(worker_pod: dict, *, limits: tuple[str, ...] = (), env: tuple[str, ...] = (),
             capabilities: bool = False, set_aside: bool = False) -> dict:
    """The DaemonSet ``worker_pod`` with what an overlay claims to add taken out again."""
    doc = copy.deepcopy(worker_pod)
    pod = doc["spec"]["template"]["spec"]
    c = pod["containers"][0]
    for name in limits:
        c["resources"]["limits"].pop(name)
        c["resources"].get("requests", {}).pop(name, None)
    c["env"] = [e for e in c["env"] if e["name"] not in env]
    if capabilities:
        c["securityContext"]["capabilities"].pop("add")
    if set_aside:
        pod["nodeSelector"].pop(SET_ASIDE)
        pod["tolerations"] = [t for t in pod["tolerations"] if t["key"] != SET_ASIDE]
    return doc


def test_each_overlay_adds_what_it_says_and_nothing_else() -> None:
    base = {(d["kind"], d["metadata"]["name"]): d for d in render(BASE)}
    claims = {
        EXCLUSIVE: {"limits": ("nvidia.com/gpu",), "set_aside": True},
        INFINIBAND: {"limits": ("rdma/rdma_shared_device_a",), "capabilities": True,
                     "env": ("NCCL_NET", "NCCL_IB_HCA")},
        EFA: {"limits": ("vpc.amazonaws.com/efa",), "capabilities": True, "set_aside": True,
              "env": ("NCCL_NET_PLUGIN", "NCCL_NET", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
                      "FI_EFA_USE_HUGE_PAGE")},
    }
    for directory, claim in claims.items():
        rendered = {(d["kind"], d["metadata"]["name"]): d for d in render(directory)}
        assert rendered.keys() == base.keys(), directory
        key = ("DaemonSet", "ringwatch-gpu-agent")
        assert {k for k in base if rendered[k] != base[k]} == {key}, directory
        stripped = _without(rendered[key], **claim)  # type: ignore[arg-type]
        if directory == EXCLUSIVE:  # it also takes the device plugin's word on the GPUs
            stripped["spec"]["template"]["spec"]["containers"][0]["env"].insert(
                0, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
        assert stripped == base[key], directory


def test_the_rdma_overlays_give_nccl_the_fabric_or_an_error_never_sockets() -> None:
    for directory, resource in ((INFINIBAND, "rdma/rdma_shared_device_a"),
                                (EFA, "vpc.amazonaws.com/efa")):
        worker = _worker(directory)
        env = {e["name"]: e["value"] for e in worker["env"] if "value" in e}
        # The devices, as a device plugin's resource (requests equal limits, as an extended
        # resource must have them), and pinned memory.
        limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
        assert int(limits[resource]) >= 1 and requests[resource] == limits[resource]
        assert worker["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert worker["securityContext"]["capabilities"]["drop"] == ["ALL"]
        # NCCL is told which network: it uses it or fails, and the worker refuses to start
        # where the memlock limit cannot be lifted.
        assert env["NCCL_NET"]
        script = _script(worker)
        assert 'if [ -n "${NCCL_NET:-}" ] && ! ulimit -l unlimited' in script
        assert script.index("ulimit -l unlimited") < script.index("exec ray start")
    ib = {e["name"]: e["value"] for e in _worker(INFINIBAND)["env"] if "value" in e}
    assert ib["NCCL_NET"] == "IB" and ib["NCCL_IB_HCA"]
    efa = {e["name"]: e["value"] for e in _worker(EFA)["env"] if "value" in e}
    # The OFI plugin the agent image builds, which NCCL loads only by name (the image drops
    # the default-named link, so InfiniBand nodes keep NCCL's own transport); libfabric's EFA.
    assert efa["NCCL_NET_PLUGIN"] == "ofi" and efa["NCCL_NET"] == "OFI"
    assert efa["FI_PROVIDER"] == "efa" and efa["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert re.search(r"rm -f \S*/libnccl-net\.so\b", (ROOT / "Dockerfile").read_text())
    # EFA interfaces go to one pod each: held only on a node set aside for it.
    assert _gpu_agents(EFA)["spec"]["template"]["spec"]["nodeSelector"][SET_ASIDE] == "true"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_renders_what_these_tests_check() -> None:
    for directory in KUSTOMIZATIONS:
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                             text=True, timeout=120, check=True).stdout
        theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
        ours = {(d["kind"], d["metadata"]["name"]): d for d in render(directory)}
        assert theirs == ours, directory


# -- commands, settings, secrets ---------------------------------------------------------


def _parse(argv: list[str]):
    from ringwatch.services.cli.main import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"ringwatch {' '.join(argv)}: the CLI refuses it") from exc


def _script(container: dict) -> str:
    """The shell script a container runs (its whole argv joined where it runs none)."""
    argv = container.get("command", []) + container.get("args", [])
    if argv[:1] and argv[0] in SHELLS:
        return next(a for a in argv[1:] if not a.startswith("-"))
    return shlex.join(argv)


def _commands(container: dict) -> list[list[str]]:
    """Every simple command the container runs, directly or in a shell script (leading shell
    keywords and redirections left out); Kubernetes' $(VAR) references stand as the
    variable's name."""
    argv = [re.sub(r"\$\((\w+)\)", r"\1", a)
            for a in container.get("command", []) + container.get("args", [])]
    if not argv or argv[0] not in SHELLS:
        return [argv] if argv else []
    script = next(a for a in argv[1:] if not a.startswith("-"))
    runs = []
    for piece in re.split(r"&&|\|\||[;&|\n]", script):
        words = [w for w in shlex.split(piece) if not re.match(r"\d*>", w)]
        while words and words[0] in SHELL_WORDS:
            words = words[1:]
        if words:
            runs.append(words)
    return runs


def _ringwatch_argvs(container: dict) -> list[list[str]]:
    """The argv of every `ringwatch` the container runs, directly or in a shell script."""
    return [words[1:] for words in _commands(container) if words[:1] == ["ringwatch"]]


def _ray_argvs(container: dict) -> list[list[str]]:
    """The argv of every `ray` the container runs: in its script, its probes, its hooks."""
    runs = [words[1:] for words in _commands(container) if words[:1] == ["ray"]]
    execs = [container.get(p, {}).get("exec") for p in ("readinessProbe", "livenessProbe",
                                                         "startupProbe")]
    execs += [container.get("lifecycle", {}).get(h, {}).get("exec") for h in ("preStop",
                                                                              "postStart")]
    runs += [e["command"][1:] for e in execs if e and e["command"][:1] == ["ray"]]
    return runs


def _parse_ray(argv: list[str]) -> dict:
    """The options of ``ray ARGV`` as Ray's own command line reads them; an option it does
    not have, or a value of the wrong kind, fails."""
    scripts = pytest.importorskip("ray.scripts.scripts")
    import click  # Ray's command line is click's
    command = scripts.cli.commands.get(argv[0])
    assert command is not None, f"ray {argv[0]}: Ray has no such command"
    try:
        return command.make_context(f"ray {argv[0]}", list(argv[1:])).params
    except click.ClickException as exc:
        raise AssertionError(f"ray {' '.join(argv)}: {exc.format_message()}") from None


def test_every_ringwatch_command_is_one_the_cli_accepts() -> None:
    commands = set()
    for where, c in every_container():
        for argv in _ringwatch_argvs(c):
            args = _parse(argv)
            commands.add(" ".join(w for w in (args.command, getattr(args, "db_command", None)) if w))
        if c["image"].startswith("ringwatch") and c["name"] != "ray-worker":
            assert _ringwatch_argvs(c), f"{where} runs no ringwatch command"
    assert {"db upgrade", "db wait", "serve", "notifier", "scheduler", "kubernetes"} <= commands


def test_every_ray_command_is_one_ray_accepts() -> None:
    seen = set()
    for _, c in every_container():
        for argv in _ray_argvs(c):
            _parse_ray(argv)
            seen.add(argv[0])
    assert {"start", "stop", "health-check"} <= seen


def test_container_variable_references_are_defined() -> None:
    """Kubernetes leaves an undefined $(VAR) as it is: ringwatch would get the text."""
    for where, c in every_container():
        defined = {e["name"] for e in c.get("env", [])}
        for text in c.get("command", []) + c.get("args", []):
            for name in re.findall(r"\$\((\w+)\)", text):
                assert name in defined, f"{where}: $({name}) is not in env"


def test_every_ringwatch_variable_is_a_setting() -> None:
    from ringwatch.services.settings import Settings

    fields = {f"RINGWATCH_{name.upper()}" for name in Settings.model_fields}
    seen = set()
    for where, doc in every_doc():
        if doc["kind"] == "ConfigMap":
            # Read whole with envFrom: every key must be a setting, not only RINGWATCH_ ones.
            for key in doc["data"]:
                assert key in fields, f"{where}: {key}"
                seen.add(key)
        for c in _containers(doc):
            for e in c.get("env", []):
                if e["name"].startswith("RINGWATCH_"):
                    assert e["name"] in fields, f"{where} {c['name']}: {e['name']}"
                    seen.add(e["name"])
    assert SECRET_SETTINGS | {"RINGWATCH_API_URL"} <= seen


def _documented_secrets() -> dict[str, dict[str, str]]:
    """Secret name -> {key: value} of each `kubectl create secret generic` in the docs."""
    text = DOCS.read_text().replace("\\\n", " ")
    secrets: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if "create secret generic" not in line:
            continue
        words = shlex.split(line)
        name = words[words.index("generic") + 1]
        secrets[name] = dict(w.removeprefix("--from-literal=").split("=", 1)
                             for w in words if w.startswith("--from-literal="))
    return secrets


def test_secrets_come_from_documented_secrets_and_none_are_in_the_repository() -> None:
    from ringwatch.api.schemas import PLACEHOLDER_SECRETS

    documented = _documented_secrets()
    assert {"ringwatch-secrets", "ringwatch-agent-token", "ringwatch-reader-token"} <= set(documented)
    for keys in documented.values():
        for key, value in keys.items():
            assert not any(p in value.lower() for p in PLACEHOLDER_SECRETS), f"{key}={value}"
    for where, doc in every_doc():
        # The operator creates the secrets (docs/kubernetes.md): none ship with a value.
        assert doc["kind"] != "Secret", where
        for c in _containers(doc):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if e["name"] in SECRET_SETTINGS:
                    assert ref, f"{where} {c['name']}: {e['name']} must come from a Secret"
                if ref:
                    assert ref["key"] in documented.get(ref["name"], {}), \
                        f"{where} {c['name']}: {ref['name']}/{ref['key']} is not in {DOCS.name}"


# -- the API and who reaches it ----------------------------------------------------------


def _service_url(docs: list[dict], namespace: str, url: str) -> tuple[dict, int]:
    """The Service a cluster URL names (name, name.namespace or name.namespace.svc[...])."""
    parts = urlsplit(url)
    labels = (parts.hostname or "").split(".")
    name = labels[0]
    if len(labels) > 1:
        assert labels[1] == namespace, f"{url}: namespace {labels[1]}, not {namespace}"
        assert labels[2:] in ([], ["svc"], ["svc", "cluster", "local"]), url
    service = find(docs, "Service", name)
    assert parts.port in [p["port"] for p in service["spec"]["ports"]], url
    return service, parts.port


def test_the_api_service_reaches_the_serving_port_and_its_probes_a_real_route() -> None:
    from ringwatch.api.routers.meta import router

    docs = manifests()
    api = find(docs, "Deployment", "ringwatch-api")
    pod = api["spec"]["template"]
    container = pod["spec"]["containers"][0]
    service = find(docs, "Service", "ringwatch-api")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert api["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (serve,) = _ringwatch_argvs(container)
    args = _parse(serve)
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert ports[service["spec"]["ports"][0]["targetPort"]] == args.port
    # Webhooks go out from the notifier Deployment, not from each API replica too.
    assert args.no_notifier
    find(docs, "Deployment", "ringwatch-notifier")
    routes = {r.path for r in router.routes}  # type: ignore[attr-defined]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] in routes and ports[probe["port"]] == args.port
    # It starts once the database is at its schema, which the migration Job brings it to.
    (schema,) = pod["spec"]["initContainers"]
    assert [_parse(a).db_command for a in _ringwatch_argvs(schema)] == ["wait"]


def test_the_migration_job_alone_runs_migrations() -> None:
    for directory in KUSTOMIZATIONS:
        docs = render(directory)
        migrating = {(d["kind"], d["metadata"]["name"], c["name"]) for d in docs
                     for c in _containers(d) for argv in _ringwatch_argvs(c)
                     if _parse(argv).command == "db" and _parse(argv).db_command == "upgrade"}
        assert migrating == {("Job", MIGRATE_JOB, "migrate")}, directory
    job = find(manifests(), "Job", MIGRATE_JOB)
    # Retried until the database answers, and gone a while after it is done (a Job's pod
    # template cannot change, so the next image's Job is a new one).
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    assert job["spec"]["backoffLimit"] >= 3 and job["spec"]["ttlSecondsAfterFinished"] > 0
    (c,) = job["spec"]["template"]["spec"]["containers"]
    api = find(manifests(), "Deployment", "ringwatch-api")["spec"]["template"]["spec"]
    # The same database as the API waits on.
    assert c["env"] == api["initContainers"][0]["env"]
    assert c["image"] == api["containers"][0]["image"]


def _http_routes(container: dict) -> dict[int, set[str]]:
    """Port -> paths the ringwatch process of ``container`` serves over HTTP."""
    from ringwatch.api.routers.meta import router
    from ringwatch.services.notifier.health import PATHS

    (argv,) = _ringwatch_argvs(container)
    args = _parse(argv)
    if args.command == "serve":
        return {args.port: {r.path for r in router.routes}}  # type: ignore[attr-defined]
    # A kubelet probes the pod's address: a port bound to loopback serves it nothing.
    if (args.command == "notifier" and args.health_port is not None
            and not args.health_host.startswith("127.")):
        return {args.health_port: set(PATHS)}
    return {}


def test_every_probe_asks_what_its_process_really_serves() -> None:
    probed = set()
    for directory in KUSTOMIZATIONS:
        for doc in render(directory):
            for c in _containers(doc):
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                    probe = c.get(kind)
                    if probe is None:
                        continue
                    where = f"{directory.name} {doc['kind']}/{doc['metadata']['name']} {kind}"
                    if "httpGet" in probe:
                        port = probe["httpGet"]["port"]
                        port = ports[port] if isinstance(port, str) else port
                        assert probe["httpGet"]["path"] in _http_routes(c).get(port, ()), where
                    elif "tcpSocket" in probe:
                        port = probe["tcpSocket"]["port"]
                        assert (ports[port] if isinstance(port, str) else port) in _http_routes(c)
                    else:  # exec: a real command (ray's are parsed with the others)
                        assert probe["exec"]["command"][0] in ("ray", "ringwatch"), where
                    probed.add((doc["kind"], c["name"], kind))
    notifier = find(manifests(), "Deployment", "ringwatch-notifier")
    (c,) = notifier["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {("Deployment", "api", "readinessProbe"), ("Deployment", "notifier", "livenessProbe"),
            ("Deployment", "notifier", "readinessProbe"),
            ("DaemonSet", "ray-worker", "livenessProbe")} <= probed


def _pods_by_labels(docs: list[dict]) -> list[tuple[str, dict]]:
    """(kind/name, pod labels) of every workload, the KubeRay head's pod template included."""
    pods = []
    for doc in docs:
        if doc["kind"] == "RayCluster":
            for name, template in _ray_templates(doc):
                pods.append((f"RayCluster/{name}", template["metadata"]["labels"]))
        elif "template" in doc.get("spec", {}):
            pods.append((f"{doc['kind']}/{doc['metadata']['name']}",
                         doc["spec"]["template"]["metadata"]["labels"]))
    return pods


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the only form used here
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_the_api_and_the_notifier_lose_one_replica_at_a_time() -> None:
    docs = manifests()
    for name in ("ringwatch-api", "ringwatch-notifier"):
        deployment = find(docs, "Deployment", name)
        budget = find(docs, "PodDisruptionBudget", name)["spec"]
        assert _selects(budget["selector"], deployment["spec"]["template"]["metadata"]["labels"])
        # One at a time, never none: a budget that allows nothing blocks every node drain.
        assert budget["maxUnavailable"] == 1 and deployment["spec"]["replicas"] >= 2
        assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        others = [w for w, labels in _pods_by_labels(docs) if _selects(budget["selector"], labels)]
        assert others == [f"Deployment/{name}"], others


def _rule_ports(rule: dict) -> set[tuple[str, int]]:
    return {(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])}


def _peers_admit(peers: list[dict] | None, labels: dict) -> bool:
    """Whether ``peers`` (a rule's from/to) admit a pod of this namespace with ``labels``."""
    return peers is None or any("podSelector" in p and "namespaceSelector" not in p
                                and _selects(p["podSelector"], labels) for p in peers)


def test_network_policies_hold_every_pod_to_the_traffic_it_needs() -> None:
    docs = manifests()
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    pods = dict(_pods_by_labels(docs))
    # Every pod is selected by exactly one policy, which governs both directions.
    for workload, labels in pods.items():
        chosen = [n for n, p in policies.items() if _selects(p["podSelector"], labels)]
        assert len(chosen) == 1, (workload, chosen)
        assert set(policies[chosen[0]]["policyTypes"]) == {"Ingress", "Egress"}

    def policy(workload: str) -> dict:
        (spec,) = [p for p in policies.values() if _selects(p["podSelector"], pods[workload])]
        return spec

    def egress(workload: str, port: tuple[str, int]) -> list[dict]:
        return [r for r in policy(workload).get("egress", [])
                if port in _rule_ports(r) or not r.get("ports")]

    head, api = pods["RayCluster/head"], pods["Deployment/ringwatch-api"]
    api_port = find(docs, "Service", "ringwatch-api")["spec"]["ports"][0]["port"]
    # Everyone resolves names.
    for workload in pods:
        assert egress(workload, ("UDP", 53)), workload
    # The database: the API, the notifier, the migration; nobody else.
    for workload in pods:
        reaches = any(not r.get("to") for r in egress(workload, ("TCP", 5432)))
        assert reaches == (workload in ("Deployment/ringwatch-api",
                                        "Deployment/ringwatch-notifier",
                                        f"Job/{MIGRATE_JOB}")), workload
    # The API takes the scheduler's calls, and those of client namespaces you label.
    (rule,) = policy("Deployment/ringwatch-api")["ingress"]
    assert _rule_ports(rule) == {("TCP", api_port)} and _peers_admit(rule["from"], head)
    assert {"ringwatch.io/api-client": "true"} in [
        p["namespaceSelector"].get("matchLabels") for p in rule["from"] if "namespaceSelector" in p]
    assert any(_peers_admit(r.get("to"), api) for r in egress("RayCluster/head", ("TCP", api_port)))
    # The remediation loop reads the API, and reaches the Kubernetes API server on its
    # ports; nobody calls it.
    remediation = pods["Deployment/ringwatch-remediation"]
    assert _peers_admit(rule["from"], remediation)
    assert any(_peers_admit(r.get("to"), api)
               for r in egress("Deployment/ringwatch-remediation", ("TCP", api_port)))
    for port in (443, 6443):
        assert egress("Deployment/ringwatch-remediation", ("TCP", port)), port
    assert not policy("Deployment/ringwatch-remediation").get("ingress")
    # Webhooks leave the notifier on HTTPS; nothing but the kubelet calls it.
    assert any({p["ipBlock"]["cidr"] for p in r.get("to", [])} >= {"0.0.0.0/0", "::/0"}
               for r in egress("Deployment/ringwatch-notifier", ("TCP", 443)))
    assert not policy("Deployment/ringwatch-notifier").get("ingress")
    # The Ray head and the GPU workers reach each other on every port, the workers by their
    # nodes' addresses (host network) as well as by their pods.
    agents = pods["DaemonSet/ringwatch-gpu-agent"]
    for a, b in (("RayCluster/head", agents), ("DaemonSet/ringwatch-gpu-agent", head)):
        (inbound,) = [r for r in policy(a)["ingress"] if _peers_admit(r["from"], b)]
        (outbound,) = [r for r in policy(a)["egress"] if r.get("to") and _peers_admit(r["to"], b)]
        for rule in (inbound, outbound):
            assert not rule.get("ports")
            peers = rule.get("from") or rule.get("to")
            assert {p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p}, a


def test_the_scheduler_the_remediation_and_the_gate_example_reach_the_api_service() -> None:
    docs = manifests()
    namespace = yaml.safe_load((BASE / "kustomization.yaml").read_text())["namespace"]
    ray = find(docs, "RayCluster", "ringwatch")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    service, _ = _service_url(docs, namespace, env["RINGWATCH_API_URL"])
    assert service["metadata"]["name"] == "ringwatch-api"
    remediation = find(docs, "Deployment", "ringwatch-remediation")
    (c,) = remediation["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    service, _ = _service_url(docs, namespace, env["RINGWATCH_API_URL"])
    assert service["metadata"]["name"] == "ringwatch-api"

    (pod,) = _documents(EXAMPLE)
    (init,) = pod["spec"]["initContainers"]
    env = {e["name"]: e for e in init["env"]}
    # The trainer runs in its own namespace: the URL must name ringwatch's.
    assert "." in urlsplit(env["RINGWATCH_API_URL"]["value"]).hostname
    _service_url(docs, namespace, env["RINGWATCH_API_URL"]["value"])
    args = _parse(_ringwatch_argvs(init)[0])
    assert (args.command, args.kubernetes_command, args.node) == ("kubernetes", "check",
                                                                  "NODE_NAME")
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_scheduler_alone_may_list_pods_and_nodes_and_nothing_else() -> None:
    from ringwatch.services.scheduler import occupancy
    from ringwatch.services.settings import Settings

    namespace = yaml.safe_load((BASE / "kustomization.yaml").read_text())["namespace"]
    for directory in KUSTOMIZATIONS:
        docs = render(directory)
        role = find(docs, "ClusterRole", "ringwatch-occupancy")
        # Read only, the two resources the occupancy source lists, in the core group.
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods", "nodes"],
                                  "verbs": ["list", "watch"]}], directory
        # The remediation's role is the one other (the next test).
        assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")
                    or (d["kind"] == "ClusterRole" and d is not role
                        and d["metadata"]["name"] != "ringwatch-remediation")]
        (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"
                      and d["roleRef"]["name"] == "ringwatch-occupancy"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": "ClusterRole", "name": "ringwatch-occupancy"}
        account = find(docs, "ServiceAccount", "ringwatch-scheduler")
        assert account["metadata"]["namespace"] == namespace
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ringwatch-scheduler",
                                        "namespace": namespace}]
        # The head's pod runs as that account; its token is in the ray-head container alone,
        # read-only where the occupancy source reads it, and no other pod has one.
        head = find(docs, "RayCluster", "ringwatch")["spec"]["headGroupSpec"]["template"]["spec"]
        assert head["serviceAccountName"] == "ringwatch-scheduler"
        tokens = {v["name"] for v in head["volumes"] if any(
            "serviceAccountToken" in src for src in v.get("projected", {}).get("sources", []))}
        assert len(tokens) == 1
        (mount,) = [m for c in head["containers"] + head.get("initContainers", [])
                    for m in c.get("volumeMounts", []) if m["name"] in tokens]
        assert mount["readOnly"] is True
        assert Path(mount["mountPath"]) == occupancy.SERVICE_ACCOUNT_TOKEN.parent
        assert {m["name"] for m in head["containers"][0]["volumeMounts"]} >= tokens
        env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
        assert Settings(occupancy=env["RINGWATCH_OCCUPANCY"]).occupancy == "kubernetes"
        for doc in docs:
            for pod in _pod_specs(doc):
                if pod is head or doc["metadata"]["name"] == "ringwatch-remediation":
                    continue
                where = f"{directory.name} {doc['kind']}/{doc['metadata']['name']}"
                assert pod.get("serviceAccountName", "default") == "default", where
                assert not any("serviceAccountToken" in src for v in pod.get("volumes", [])
                               for src in v.get("projected", {}).get("sources", [])), where


def test_the_remediation_may_patch_nodes_and_nothing_else_and_ships_as_a_dry_run() -> None:
    from ringwatch.services.kubernetes import client, remediation

    namespace = yaml.safe_load((BASE / "kustomization.yaml").read_text())["namespace"]
    for directory in KUSTOMIZATIONS:
        docs = render(directory)
        role = find(docs, "ClusterRole", "ringwatch-remediation")
        # Nodes only: read them and patch the label and taint it owns; no pods, no evictions.
        assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"],
                                  "verbs": ["get", "list", "patch"]}], directory
        binding = find(docs, "ClusterRoleBinding", "ringwatch-remediation")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": "ClusterRole", "name": "ringwatch-remediation"}
        assert binding["subjects"] == [{"kind": "ServiceAccount",
                                        "name": "ringwatch-remediation",
                                        "namespace": namespace}]
        account = find(docs, "ServiceAccount", "ringwatch-remediation")
        assert account["automountServiceAccountToken"] is False
        deployment = find(docs, "Deployment", "ringwatch-remediation")
        # One loop at a time: two would each count the cap without the other's taints.
        assert deployment["spec"]["replicas"] == 1
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}
        pod = deployment["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "ringwatch-remediation"
        (c,) = pod["containers"]
        (argv,) = _ringwatch_argvs(c)
        args = _parse(argv)
        # As shipped it changes nothing (docs/kubernetes.md says how to add --apply), with
        # the default cap and effect.
        assert (args.command, args.kubernetes_command) == ("kubernetes", "sync")
        assert not args.apply and not args.once
        assert args.max_tainted_share == remediation.DEFAULT_MAX_TAINTED_SHARE
        assert args.taint_effect == "NoSchedule"
        (mount,) = c["volumeMounts"]
        assert mount["readOnly"] is True
        assert Path(mount["mountPath"]) == client.SERVICE_ACCOUNT_TOKEN.parent
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert any("serviceAccountToken" in src for src in volume["projected"]["sources"])
        # A tainted node is still probed, whatever the effect: it can be found healthy again.
        workers = _gpu_agents(directory)["spec"]["template"]["spec"]["tolerations"]
        assert {"key": remediation.TAINT_KEY, "operator": "Exists"} in workers, directory


def _dockerfile_env() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ENV\s+(\w+)=(\S+)", text, re.MULTILINE))


def test_containers_run_unprivileged_as_the_image_user_with_resources() -> None:
    user = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)[-1]
    for directory in KUSTOMIZATIONS:
        for doc in render(directory):
            for pod in _pod_specs(doc):
                where = f"{directory.name} {doc['kind']}/{doc['metadata']['name']}"
                ctx = pod["securityContext"]
                assert ctx["runAsNonRoot"] is True and str(ctx["runAsUser"]) == user, where
                assert pod.get("automountServiceAccountToken") is False, where
                for c in pod.get("initContainers", []) + pod["containers"]:
                    sc = c["securityContext"]
                    assert sc["allowPrivilegeEscalation"] is False, f"{where} {c['name']}"
                    assert sc["capabilities"]["drop"] == ["ALL"], f"{where} {c['name']}"
                    assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
                    assert "memory" in c["resources"]["limits"], f"{where} {c['name']}"


if __name__ == "__main__":
    # The objects each kustomization renders, as `kubectl apply -k` would create them.
    for directory in KUSTOMIZATIONS:
        print(f"{directory.relative_to(ROOT)}:")
        for doc in render(directory):
            print(f"  {doc['kind']}/{doc['metadata']['name']}")
