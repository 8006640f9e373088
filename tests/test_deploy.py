"""deploy/kubernetes: every manifest parses, validates against the Kubernetes schema (bundled,
offline), and runs real ringwatch commands with real settings. No cluster is needed.

The kustomizations are rendered here for the features they use (resources, namespace,
labels, images, JSON 6902 patches); where kubectl is on PATH its own rendering must agree.
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

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
EXCLUSIVE = DEPLOY / "overlays" / "exclusive-gpus"
KUSTOMIZATIONS = (BASE, EXCLUSIVE)
EXAMPLE = ROOT / "examples" / "k8s-init-container.yaml"
DOCS = ROOT / "docs" / "kubernetes.md"
# The oldest Kubernetes the manifests are meant for; strict: an unknown field is an error.
K8S_VERSION = "1.29.0"
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")
SECRET_SETTINGS = {"RINGWATCH_DATABASE_URL", "RINGWATCH_TOKEN", "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN",
                   "RINGWATCH_SECRET_KEY"}


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
        if k.get("namespace") and doc["kind"] != "Namespace":
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
            "RayCluster", "Pod"} <= checked


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
    for group in doc["spec"]["workerGroupSpecs"]:
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
        names = [g["groupName"] for g in spec["workerGroupSpecs"]]
        assert names and len(set(names)) == len(names)
        for group in spec["workerGroupSpecs"]:
            assert set(group) <= RAY_WORKER, set(group) - RAY_WORKER
            assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
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


def test_the_head_runs_the_scheduler_and_the_workers_take_every_gpu_node() -> None:
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

    for group in ray["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        # Host networking: the Ray worker's hostname, which names the node in ringwatch,
        # is the node's own, as a preflight's --nodes $(NODE_NAME) asks.
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        # One worker per node.
        labels = group["template"]["metadata"]["labels"]
        (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= labels.items()
        shm = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/dev/shm" in shm


def test_base_workers_share_the_gpus_and_the_overlay_requests_them_all() -> None:
    def worker(directory: Path) -> dict:
        ray = find(render(directory), "RayCluster", "ringwatch")
        return ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]

    shared = worker(BASE)
    assert "nvidia.com/gpu" not in shared["resources"].get("limits", {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in shared["env"]
    exclusive = worker(EXCLUSIVE)
    assert int(exclusive["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in exclusive["env"]}
    # The overlay changes the GPU request and nothing else.
    assert {e["name"] for e in shared["env"]} - {e["name"] for e in exclusive["env"]} == {
        "NVIDIA_VISIBLE_DEVICES"}


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
    from services.cli.main import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"ringwatch {' '.join(argv)}: the CLI refuses it") from exc


def _ringwatch_argvs(container: dict) -> list[list[str]]:
    """The argv of every `ringwatch` the container runs, directly or in a shell script;
    Kubernetes' $(VAR) references stand as the variable's name."""
    argv = [re.sub(r"\$\((\w+)\)", r"\1", a) for a in container.get("command", []) + container.get("args", [])]
    if argv[:1] == ["ringwatch"]:
        return [argv[1:]]
    if argv[:1] and argv[0] in SHELLS:
        script = next(a for a in argv[1:] if not a.startswith("-"))
        runs = []
        for piece in re.split(r"&&|\|\||[;&|\n]", script):
            words = shlex.split(piece)
            if words[:1] == ["exec"]:
                words = words[1:]
            if words[:1] == ["ringwatch"]:
                runs.append(words[1:])
        return runs
    return []


def test_every_ringwatch_command_is_one_the_cli_accepts() -> None:
    commands = set()
    for where, c in every_container():
        for argv in _ringwatch_argvs(c):
            args = _parse(argv)
            commands.add(" ".join(w for w in (args.command, getattr(args, "db_command", None)) if w))
        if c["image"].startswith("ringwatch") and c["name"] != "ray-worker":
            assert _ringwatch_argvs(c), f"{where} runs no ringwatch command"
    assert {"db upgrade", "serve", "notifier", "scheduler", "preflight"} <= commands


def test_container_variable_references_are_defined() -> None:
    """Kubernetes leaves an undefined $(VAR) as it is: ringwatch would get the text."""
    for where, c in every_container():
        defined = {e["name"] for e in c.get("env", [])}
        for text in c.get("command", []) + c.get("args", []):
            for name in re.findall(r"\$\((\w+)\)", text):
                assert name in defined, f"{where}: $({name}) is not in env"


def test_every_ringwatch_variable_is_a_setting() -> None:
    from services.settings import Settings

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
    from api.schemas import PLACEHOLDER_SECRETS

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
    from api.routers.meta import router

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
    # Migrations run before the API starts.
    (migrate,) = pod["spec"]["initContainers"]
    assert [_parse(a).db_command for a in _ringwatch_argvs(migrate)] == ["upgrade"]


def test_the_scheduler_and_the_preflight_example_reach_the_api_service() -> None:
    docs = manifests()
    namespace = yaml.safe_load((BASE / "kustomization.yaml").read_text())["namespace"]
    ray = find(docs, "RayCluster", "ringwatch")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    service, _ = _service_url(docs, namespace, env["RINGWATCH_API_URL"])
    assert service["metadata"]["name"] == "ringwatch-api"

    (pod,) = _documents(EXAMPLE)
    (init,) = pod["spec"]["initContainers"]
    env = {e["name"]: e for e in init["env"]}
    # The trainer runs in its own namespace: the URL must name ringwatch's.
    assert "." in urlsplit(env["RINGWATCH_API_URL"]["value"]).hostname
    _service_url(docs, namespace, env["RINGWATCH_API_URL"]["value"])
    args = _parse(_ringwatch_argvs(init)[0])
    assert args.command == "preflight" and args.nodes == "NODE_NAME"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


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
