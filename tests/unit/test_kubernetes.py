"""deploy/kubernetes: the kustomize base and its overlays, rendered and checked without a cluster.

``render`` applies the part of kustomize the files use (resources, patches by file, images,
labels, namespace; anything else in a kustomization is refused, so a file cannot rely on
something this renderer would skip). Every rendered document is validated against the
Kubernetes schemas ``kubernetes-validate`` ships (strict: an unknown field is an error), and
KEDA's against tests/schemas/keda-v1alpha1.json. Then they are held to what jobtier needs: the
commands its own parser accepts, settings it knows, probes on routes the API serves, a grace
period above the worker's --grace, a disruption budget per Deployment, and a ScaledObject per
worker pool that reads the pool's queue's scaling route with the pool's slots.
``test_each_check_catches_its_breakage`` breaks a rendering one way at a time and makes sure
the right check notices, so no check can pass by looking at nothing.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml

from jobtier.api.app import openapi_document
from jobtier.api.scaling import SCALING_PARAMS
from jobtier.config import Settings
from jobtier.core.errors import ConfigError
from jobtier.core.model import QueueScaling
from jobtier.worker.registry import TaskRegistry
from tests.unit.test_compose import KNOWN_ENV, parse_jobtier

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
BASE = KUBE / "base"
OVERLAYS = sorted(p for p in (KUBE / "overlays").iterdir() if p.is_dir())
KEDA_SCHEMA = json.loads((ROOT / "tests" / "schemas" / "keda-v1alpha1.json").read_text())
# the oldest Kubernetes the manifests are for, and the newest kubernetes-validate knows
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
SECRET = "jobtier-secrets"  # made outside git (docs/kubernetes.md): these are its keys
SECRET_KEYS = {"JOBTIER_DATABASE_URL", "JOBTIER_API_KEYS", "JOBTIER_ADMIN_KEY"}
SECRET_EXAMPLE = {
    "JOBTIER_DATABASE_URL": "postgresql://jobtier:pw@postgres:5432/jobtier",
    "JOBTIER_API_KEYS": "key-1:acme",
    "JOBTIER_ADMIN_KEY": "admin-key",
}
ROLES = {"api", "worker", "scheduler", "persister", "dispatcher"}
# after --grace, the worker releases the jobs still running: a few round trips to Redis
WORKER_MARGIN = 10
DOWN_WINDOW = 60  # the least scale-down stabilization: below it a burst's gaps stop workers
Doc = dict[str, Any]


# --- rendering ------------------------------------------------------------------------------
def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value)


def merge(target: Doc, patch: Doc, by_name: bool) -> None:
    """A strategic merge patch as kustomize applies it: maps merge, lists of named items
    (containers, env, ports, volumes) merge by name for built-in kinds, other lists are
    replaced (a custom resource's lists always are: kustomize has no schema for them)."""
    for key, value in patch.items():
        old = target.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            merge(old, value, by_name)
        elif by_name and isinstance(old, list) and named_list(value) and named_list(old):
            items = {item["name"]: item for item in old}
            for item in value:
                if item["name"] in items:
                    merge(items[item["name"]], item, by_name)
                else:
                    old.append(copy.deepcopy(item))
        else:
            target[key] = copy.deepcopy(value)


def find(docs: list[Doc], kind: str, name: str) -> Doc | None:
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def pod_specs(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            yield d, d["spec"]["template"]["spec"]


def containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for d, spec in pod_specs(docs):
        for c in spec.get("containers", []):
            yield d, c


def render(folder: Path) -> list[Doc]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{folder}: kustomization keys this renderer does not apply: {unknown}")
    docs: list[Doc] = []
    for resource in k.get("resources", []):
        path = folder / resource
        docs += render(path) if path.is_dir() else load_docs(path)
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{folder}: a patch other than by file: {patch}")
        for p in load_docs(folder / patch["path"]):
            target = find(docs, p["kind"], p["metadata"]["name"])
            if target is None:
                raise ValueError(
                    f"{folder}: {patch['path']} patches {p['kind']}/"
                    f"{p['metadata']['name']}, which its resources lack"
                )
            merge(target, p, by_name=not p["apiVersion"].startswith("keda.sh/"))
    for image in k.get("images", []):
        for _, c in containers(docs):
            name, _, tag = c["image"].partition(":")
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
    for pairs in k.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(pairs["pairs"])
    if "namespace" in k:
        for d in docs:
            d["metadata"]["namespace"] = k["namespace"]
    return docs


def namespace_of(folder: Path) -> str:
    return str(yaml.safe_load((folder / "kustomization.yaml").read_text())["namespace"])


RENDERINGS = {"base": BASE, **{f"overlays/{p.name}": p for p in OVERLAYS}}


def rendered(name: str) -> list[Doc]:
    return render(RENDERINGS[name])


# --- what the containers run --------------------------------------------------------------
def jobtier_args(c: Doc) -> Any:
    return parse_jobtier([str(a) for a in c.get("args", [])])


def role_of(c: Doc) -> str:
    try:
        return str(jobtier_args(c).command)
    except ValueError:
        return "?"


@functools.cache
def openapi_paths() -> dict[str, Any]:
    paths: dict[str, Any] = openapi_document(Settings.from_env({}))["paths"]
    return paths


# --- the checks: each returns the problems it finds -----------------------------------------
@functools.lru_cache(maxsize=512)
def _kubernetes_problem(text: str, version: str) -> str | None:
    """What kubernetes-validate says of one document (JSON text: cached, as the checks see
    the same documents again and again)."""
    try:
        kubernetes_validate.validate(json.loads(text), version, strict=True)
    except kubernetes_validate.utils.ValidationError as exc:
        return f"(Kubernetes {version}): {exc.message}"
    except kubernetes_validate.utils.SchemaNotFoundError as exc:
        return str(exc.message)
    return None


def check_schemas(docs: list[Doc]) -> list[str]:
    problems = []
    for d in docs:
        kind = str(d.get("kind"))
        what = f"{kind}/{d.get('metadata', {}).get('name')}"
        if str(d.get("apiVersion", "")).startswith("keda.sh/"):
            if kind not in KEDA_SCHEMA["$defs"]:
                problems.append(f"{what}: no schema for {kind}")
                continue
            schema = {"$ref": f"#/$defs/{kind}", "$defs": KEDA_SCHEMA["$defs"]}
            keda = jsonschema.Draft202012Validator(schema)
            problems += [
                f"{what}: {e.message} at {list(e.absolute_path)}" for e in keda.iter_errors(d)
            ]
            continue
        text = json.dumps(d, sort_keys=True)
        problems += [f"{what} {p}" for v in VERSIONS if (p := _kubernetes_problem(text, v))]
    return problems


def check_roles(docs: list[Doc]) -> list[str]:
    """Every role runs, each container's command is one jobtier's parser accepts (a worker's
    tasks module loads), migrate is a Job, and every container runs the one image."""
    problems = []
    running: dict[str, set[str]] = {"Deployment": set(), "Job": set()}
    images = set()
    for d, c in containers(docs):
        images.add(c.get("image"))
        try:
            args = jobtier_args(c)
        except ValueError as exc:
            problems.append(
                f"{d['metadata']['name']}: `jobtier {' '.join(c.get('args', []))}`: {exc}"
            )
            continue
        running[d["kind"]].add(args.command)
        if args.command == "worker":
            try:
                TaskRegistry.load(args.tasks)
            except ConfigError as exc:
                problems.append(f"{d['metadata']['name']}: {exc}")
    problems += [f"no Deployment runs `jobtier {r}`" for r in sorted(ROLES - running["Deployment"])]
    if running["Job"] != {"migrate"}:
        problems.append(f"the Jobs run {sorted(running['Job'])}, expected migrate alone")
    if len(images) != 1:
        problems.append(f"the containers run several images: {images}")
    return problems


def check_settings(docs: list[Doc]) -> list[str]:
    """envFrom names the ConfigMap and the Secret; the ConfigMap's keys are settings jobtier
    knows, and with the Secret's keys they make valid Settings; the API listens on every
    address of its pod."""
    problems = []
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    for name, data in maps.items():
        problems += [f"ConfigMap {name}: {k} is not a setting" for k in data if k not in KNOWN_ENV]
    for d, c in containers(docs):
        env: dict[str, str] = {}
        secrets = []
        for source in c.get("envFrom", []):
            if "configMapRef" in source:
                ref = source["configMapRef"]["name"]
                if ref not in maps:
                    problems.append(f"{d['metadata']['name']}: no ConfigMap {ref}")
                env.update(maps.get(ref, {}))
            if "secretRef" in source:
                secrets.append(source["secretRef"]["name"])
        if secrets != [SECRET]:
            problems.append(f"{d['metadata']['name']}: takes secrets from {secrets}, not {SECRET}")
        try:
            settings = Settings.from_env({**env, **SECRET_EXAMPLE})
        except ConfigError as exc:
            problems.append(f"{d['metadata']['name']}: {exc}")
            continue
        args = jobtier_args(c) if role_of(c) != "?" else None
        if args is not None and args.command == "api":
            host = args.host or settings.api_host
            if host != "0.0.0.0":
                problems.append(f"{d['metadata']['name']}: the API listens on {host}")
    for d in docs:
        if d["kind"] == "TriggerAuthentication":
            for ref in d["spec"].get("secretTargetRef", []):
                if ref["name"] != SECRET or ref["key"] not in SECRET_KEYS:
                    problems.append(
                        f"{d['metadata']['name']}: {ref['name']}/{ref['key']} is not "
                        f"a key of {SECRET}"
                    )
    return problems


def _http_probes(c: Doc) -> dict[str, Doc]:
    return {
        k: c[k]["httpGet"]
        for k in ("startupProbe", "livenessProbe", "readinessProbe")
        if k in c and "httpGet" in c[k]
    }


def check_probes(docs: list[Doc]) -> list[str]:
    """The API: liveness on /healthz, readiness on /readyz, routes the document has without a
    key, on the port it listens on. The roles without a port: `jobtier check ROLE`, their
    own role. The Job: none (its exit status is its health)."""
    problems = []
    paths = openapi_paths()
    for d, c in containers(docs):
        name, role = d["metadata"]["name"], role_of(c)
        probes = [k for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c]
        if d["kind"] == "Job":
            problems += [f"{name}: a Job with a {k}" for k in probes]
            continue
        if {"livenessProbe", "readinessProbe"} - set(probes):
            problems.append(f"{name}: no liveness or readiness probe")
        if role == "api":
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            listen = jobtier_args(c).port
            for kind, probe in _http_probes(c).items():
                op = paths.get(probe["path"], {}).get("get")
                if op is None or op.get("security") != []:
                    problems.append(f"{name}: {kind} asks {probe['path']}, not an open route")
                if ports.get(probe["port"], probe["port"]) != listen:
                    problems.append(
                        f"{name}: {kind} on port {probe['port']}, it listens on {listen}"
                    )
            http = _http_probes(c)
            if http.get("livenessProbe", {}).get("path") != "/healthz":
                problems.append(f"{name}: liveness is not /healthz")
            if http.get("readinessProbe", {}).get("path") != "/readyz":
                problems.append(f"{name}: readiness is not /readyz")
            continue
        for kind in probes:
            command = c[kind].get("exec", {}).get("command", [])
            try:
                args = parse_jobtier([str(a) for a in command[1:]]) if command else None
            except ValueError as exc:
                problems.append(f"{name}: {kind} `{' '.join(command)}`: {exc}")
                continue
            if command[:1] != ["jobtier"] or args is None or args.command != "check":
                problems.append(f"{name}: {kind} is not `jobtier check`: {command}")
            elif args.role != role:
                problems.append(f"{name}: {kind} checks {args.role}, it runs {role}")
    for d in docs:
        if d["kind"] == "Service":
            pods = [
                c
                for dep, c in containers(docs)
                if dep["kind"] == "Deployment" and selects(d["spec"]["selector"], dep)
            ]
            if not pods:
                problems.append(f"Service {d['metadata']['name']} selects no pod")
            for port in d["spec"]["ports"]:
                names = {p.get("name") for c in pods for p in c.get("ports", [])}
                if port["targetPort"] not in names:
                    problems.append(
                        f"Service {d['metadata']['name']}: no port {port['targetPort']}"
                    )
    return problems


def check_termination(docs: list[Doc]) -> list[str]:
    """A worker is given its --grace and a margin before SIGKILL; the API waits in preStop
    while it leaves the Service's endpoints."""
    problems = []
    for d, spec in pod_specs(docs):
        period = spec.get("terminationGracePeriodSeconds", 30)
        for c in spec["containers"]:
            role = role_of(c)
            if role == "worker":
                grace = jobtier_args(c).grace
                if period < grace + WORKER_MARGIN:
                    problems.append(
                        f"{d['metadata']['name']}: {period} s before SIGKILL, for a "
                        f"--grace of {grace:g} s (+{WORKER_MARGIN})"
                    )
            if role == "api":
                wait = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
                if not wait or wait[0] != "sleep" or float(wait[1]) >= period:
                    problems.append(f"{d['metadata']['name']}: no preStop sleep under {period} s")
    return problems


def check_resources(docs: list[Doc]) -> list[str]:
    problems = []
    for d, c in containers(docs):
        r = c.get("resources", {})
        if {"cpu", "memory"} - set(r.get("requests", {})) or "memory" not in r.get("limits", {}):
            problems.append(f"{d['metadata']['name']}: requests cpu and memory, limits memory?")
    return problems


def selects(selector: Doc, workload: Doc) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    wanted = selector.get("matchLabels", selector)
    return all(labels.get(k) == v for k, v in wanted.items())


def check_disruption(docs: list[Doc]) -> list[str]:
    """Each Deployment's selector selects its pods, one PodDisruptionBudget covers them, and
    no budget covers two Deployments (an eviction then fails for both)."""
    problems = []
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for dep in deployments:
        name = dep["metadata"]["name"]
        if not selects(dep["spec"]["selector"], dep):
            problems.append(f"{name}: its selector does not select its own pods")
        covering = [b["metadata"]["name"] for b in budgets if selects(b["spec"]["selector"], dep)]
        if len(covering) != 1:
            problems.append(f"{name}: covered by {len(covering)} PodDisruptionBudgets {covering}")
    for b in budgets:
        hits = [d["metadata"]["name"] for d in deployments if selects(b["spec"]["selector"], d)]
        if len(hits) > 1:
            problems.append(f"PodDisruptionBudget {b['metadata']['name']} covers {hits}")
    return problems


SCALING_PATH = "/v1/admin/queues/{name}/scaling"
INT_FIELDS = {f.name for f in msgspec.structs.fields(QueueScaling) if f.type is int}


def check_scaling(docs: list[Doc], namespace: str) -> list[str]:
    """One ScaledObject per worker Deployment, none for anything else; its trigger reads the
    scaling route of a queue the pool serves, through the API's Service by its name in the
    namespace (KEDA calls from its own), with the pool's --concurrency as slots, the count as
    an AverageValue of 1 per replica, the admin key as a bearer token; bounds that make sense
    and a scale-down window."""
    problems = []
    workers = {
        d["metadata"]["name"]: c
        for d, c in containers(docs)
        if d["kind"] == "Deployment" and role_of(c) == "worker"
    }
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    targets = [s["spec"]["scaleTargetRef"]["name"] for s in scaled]
    for name in workers:
        if targets.count(name) != 1:
            problems.append(f"{name}: {targets.count(name)} ScaledObjects scale it")
    params = {p.name for p in SCALING_PARAMS}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    auths = {d["metadata"]["name"]: d for d in docs if d["kind"] == "TriggerAuthentication"}
    for s in scaled:
        spec, what = s["spec"], f"ScaledObject {s['metadata']['name']}"
        target = spec["scaleTargetRef"]["name"]
        if target not in workers:
            problems.append(f"{what}: scales {target}, which is no worker Deployment")
            continue
        worker = jobtier_args(workers[target])
        if "replicas" in _get(docs, "Deployment", target)["spec"]:
            problems.append(f"{target}: sets replicas, which every apply would reset under KEDA")
        low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
        if not 0 <= low <= high:
            problems.append(f"{what}: replicas from {low} to {high}")
        down = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
        window = down.get("behavior", {}).get("scaleDown", {}).get("stabilizationWindowSeconds")
        if window is None or window < DOWN_WINDOW:
            problems.append(f"{what}: scale-down window {window}, under {DOWN_WINDOW} s")
        if "fallback" in spec and spec["fallback"]["replicas"] > high:
            problems.append(f"{what}: falls back to more than maxReplicaCount")
        for t in spec["triggers"]:
            meta = t["metadata"]
            if t["type"] != "metrics-api":
                problems.append(f"{what}: a {t['type']} trigger, not metrics-api")
                continue
            if (
                t.get("metricType", "AverageValue") != "AverageValue"
                or meta.get("targetValue") != "1"
            ):
                problems.append(
                    f"{what}: not an AverageValue of 1 per replica: replicas would not be the count"
                )
            if (
                meta.get("valueLocation") != "desired_workers"
                or "desired_workers" not in INT_FIELDS
            ):
                problems.append(f"{what}: reads {meta.get('valueLocation')}, not desired_workers")
            url = urlsplit(meta.get("url", ""))
            host = (url.hostname or "").split(".")
            service = services.get(host[0])
            if service is None or host[1:3] != [namespace, "svc"]:
                problems.append(
                    f"{what}: {url.hostname} is not a Service of namespace "
                    f"{namespace} by its full name"
                )
            elif url.port not in {p["port"] for p in service["spec"]["ports"]}:
                problems.append(f"{what}: Service {host[0]} has no port {url.port}")
            parts = url.path.split("/")
            queue = parts[4] if len(parts) == 6 else ""
            if (
                url.path != SCALING_PATH.replace("{name}", queue)
                or SCALING_PATH not in openapi_paths()
            ):
                problems.append(f"{what}: {url.path} is not the scaling route of a queue")
            elif queue not in (worker.queues or []):
                problems.append(f"{what}: reads queue {queue}; the pool serves {worker.queues}")
            query = parse_qs(url.query)
            problems += [f"{what}: the route takes no {k}" for k in query if k not in params]
            if query.get("slots") != [str(worker.concurrency)]:
                problems.append(
                    f"{what}: slots={query.get('slots')}, the pool's --concurrency "
                    f"is {worker.concurrency}"
                )
            auth = auths.get(t.get("authenticationRef", {}).get("name", ""))
            token = [
                r
                for r in (auth or {}).get("spec", {}).get("secretTargetRef", [])
                if r["parameter"] == "token"
            ]
            if meta.get("authMode") != "bearer" or [r["key"] for r in token] != [
                "JOBTIER_ADMIN_KEY"
            ]:
                problems.append(f"{what}: does not send the admin key as a bearer token")
    return problems


CHECKS: dict[str, Callable[[list[Doc], str], list[str]]] = {
    "schemas": lambda docs, ns: check_schemas(docs),
    "roles": lambda docs, ns: check_roles(docs),
    "settings": lambda docs, ns: check_settings(docs),
    "probes": lambda docs, ns: check_probes(docs),
    "termination": lambda docs, ns: check_termination(docs),
    "resources": lambda docs, ns: check_resources(docs),
    "disruption": lambda docs, ns: check_disruption(docs),
    "scaling": check_scaling,
}


# --- the tests ------------------------------------------------------------------------------
def test_there_is_a_base_and_an_overlay() -> None:
    assert (BASE / "kustomization.yaml").is_file() and OVERLAYS, "deploy/kubernetes is empty"


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_rendered_manifests(rendering: str, check: str) -> None:
    docs = rendered(rendering)
    assert CHECKS[check](docs, namespace_of(RENDERINGS[rendering])) == []


@pytest.mark.parametrize("path", sorted(BASE.glob("*.yaml")), ids=lambda p: p.name)
def test_each_base_file_is_valid_alone(path: Path) -> None:
    docs = load_docs(path)
    if path.name == "kustomization.yaml":
        assert docs[0]["kind"] == "Kustomization"
        return
    assert docs and check_schemas(docs) == []


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_overlays_patches_target_resources_of_the_base(overlay: Path) -> None:
    k = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    below: list[Doc] = []
    for resource in k["resources"]:
        below += render((overlay / resource).resolve())
    patches = [p for patch in k["patches"] for p in load_docs(overlay / patch["path"])]
    assert patches, "an overlay that patches nothing"
    for p in patches:
        assert find(below, p["kind"], p["metadata"]["name"]), (p["kind"], p["metadata"]["name"])
    # and they change something: a patch equal to what it patches is a leftover
    for p in patches:
        before = find(below, p["kind"], p["metadata"]["name"])
        after = copy.deepcopy(before)
        assert after is not None
        merge(after, p, by_name=not p["apiVersion"].startswith("keda.sh/"))
        assert after != before, f"{p['kind']}/{p['metadata']['name']}: the patch changes nothing"


def test_the_renderer_refuses_what_it_does_not_apply(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(ValueError, match="configMapGenerator"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{BASE}]\npatches: [{{path: p.yaml}}]\n"
    )
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\n")
    with pytest.raises(ValueError, match="ConfigMap/nope"):
        render(tmp_path)


def _get(docs: list[Doc], kind: str, name: str) -> Doc:
    doc = find(docs, kind, name)
    assert doc is not None, (kind, name)
    return doc


def _worker(docs: list[Doc], pool: str = "default") -> Doc:
    dep = find(docs, "Deployment", f"jobtier-worker-{pool}")
    assert dep is not None
    return dep


def _scaled(docs: list[Doc], pool: str = "default") -> Doc:
    so = find(docs, "ScaledObject", f"jobtier-worker-{pool}")
    assert so is not None
    return so


def _api(docs: list[Doc]) -> Doc:
    api = find(docs, "Deployment", "jobtier-api")
    assert api is not None
    return api


def _container(d: Doc) -> Doc:
    c: Doc = d["spec"]["template"]["spec"]["containers"][0]
    return c


def _set_url(docs: list[Doc], old: str, new: str) -> None:
    meta = _scaled(docs)["spec"]["triggers"][0]["metadata"]
    meta["url"] = meta["url"].replace(old, new)


def _set_arg(c: Doc, flag: str, value: str) -> None:
    args = c["args"]
    args[args.index(flag) + 1] = value


BREAKAGES: list[tuple[str, str, Callable[[list[Doc]], None]]] = [
    ("schemas", "unexpected", lambda d: _container(_api(d)).update(livenesProbe={})),
    (
        "schemas",
        "1 is not of type 'string'",
        lambda d: _scaled(d)["spec"]["triggers"][0]["metadata"].update(targetValue=1),
    ),
    ("schemas", "Additional properties", lambda d: _scaled(d)["spec"].update(coolDownPeriod=9)),
    ("roles", "invalid choice", lambda d: _container(_api(d)).update(args=["serve"])),
    (
        "roles",
        "no Deployment runs `jobtier scheduler`",
        lambda d: d.remove(_get(d, "Deployment", "jobtier-scheduler")),
    ),
    (
        "roles",
        "jobtier.nothing",
        lambda d: _container(_worker(d))["args"].__setitem__(1, "jobtier.nothing"),
    ),
    (
        "settings",
        "JOBTIER_REDIS_URI is not a setting",
        lambda d: _get(d, "ConfigMap", "jobtier-config")["data"].update(
            JOBTIER_REDIS_URI="redis://x"
        ),
    ),
    ("settings", "takes secrets from []", lambda d: _container(_worker(d))["envFrom"].pop()),
    (
        "settings",
        "listens on 127.0.0.1",
        lambda d: _set_arg(_container(_api(d)), "--host", "127.0.0.1"),
    ),
    (
        "probes",
        "not an open route",
        lambda d: _container(_api(d))["readinessProbe"]["httpGet"].update(path="/ready"),
    ),
    (
        "probes",
        "it listens on 8000",
        lambda d: _container(_api(d))["ports"][0].update(containerPort=8080),
    ),
    (
        "probes",
        "checks scheduler, it runs worker",
        lambda d: _container(_worker(d))["livenessProbe"]["exec"].update(
            command=["jobtier", "check", "scheduler"]
        ),
    ),
    ("probes", "no liveness", lambda d: _container(_worker(d)).pop("livenessProbe")),
    (
        "termination",
        "--grace of 300 s",
        lambda d: _set_arg(_container(_worker(d)), "--grace", "300"),
    ),
    ("termination", "no preStop", lambda d: _container(_api(d)).pop("lifecycle")),
    ("resources", "requests cpu", lambda d: _container(_worker(d))["resources"].pop("requests")),
    (
        "disruption",
        "covered by 0",
        lambda d: d.remove(_get(d, "PodDisruptionBudget", "jobtier-worker-bulk")),
    ),
    (
        "disruption",
        "covers",
        lambda d: _get(d, "PodDisruptionBudget", "jobtier-worker-bulk")["spec"]["selector"][
            "matchLabels"
        ].pop("jobtier.dev/pool"),
    ),
    (
        "scaling",
        "slots=['50'], the pool's --concurrency is 80",
        lambda d: _set_arg(_container(_worker(d)), "--concurrency", "80"),
    ),
    ("scaling", "reads queue bulk", lambda d: _set_url(d, "queues/default/", "queues/bulk/")),
    ("scaling", "not a Service of namespace", lambda d: _set_url(d, ".jobtier.svc", "")),
    ("scaling", "the route takes no workers", lambda d: _set_url(d, "slots=", "workers=1&slots=")),
    (
        "scaling",
        "not an AverageValue",
        lambda d: _scaled(d)["spec"]["triggers"][0].update(metricType="Value"),
    ),
    ("scaling", "which every apply would reset", lambda d: _worker(d)["spec"].update(replicas=2)),
    ("scaling", "0 ScaledObjects", lambda d: d.remove(_scaled(d, "bulk"))),
    ("scaling", "scale-down window", lambda d: _scaled(d)["spec"].pop("advanced")),
    ("scaling", "bearer", lambda d: _scaled(d)["spec"]["triggers"][0]["metadata"].pop("authMode")),
]


@pytest.mark.parametrize(
    ("check", "expected", "breakage"), BREAKAGES, ids=[f"{c}:{e[:30]}" for c, e, _ in BREAKAGES]
)
def test_each_check_catches_its_breakage(
    check: str, expected: str, breakage: Callable[[list[Doc]], None]
) -> None:
    docs = rendered("overlays/production")
    namespace = namespace_of(RENDERINGS["overlays/production"])
    assert CHECKS[check](docs, namespace) == []
    broken = copy.deepcopy(docs)
    breakage(broken)
    problems = CHECKS[check](broken, namespace)
    assert any(expected in p for p in problems), problems
