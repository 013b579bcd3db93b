"""Kubernetes Jobs for detached runs: the one place the service talks to the Kubernetes API.

A notebook asks the service (POST /openrl/v1/jobs, where=k8s) to run its training loop as a Job.
The user picks only from what the admin allowed: an image from --job-image, named volumes from
--job-volumes-file, cpu/memory up to OPENRL_JOB_MAX_CPU / OPENRL_JOB_MAX_MEMORY. Everything else of
the pod is fixed here: the worker command, non-root with a read-only root filesystem, no
capabilities, no Kubernetes API token, the job's own service account (no RBAC).

For one job the launcher creates, in the service's namespace (the only namespace its Role covers):

    Job        <name>         batch/v1; the pod runs `python -m openrl_jupyter.jobs worker`
    ConfigMap  <name>-spec    spec.json (job_id, name, kind, service_url), mounted read-only
    Secret     <name>-token   the job-scoped key (env OPENRL_TOKEN); never returned to the user

The ConfigMap and Secret carry an ownerReference to the Job (its uid from the create reply), so
deleting the Job (propagationPolicy Background) lets the garbage collector remove them and the pods.
With a Kueue queue (--job-queue) the Job is created suspended with the queue-name label; Kueue
admits it by unsuspending it.

``kubernetes`` is imported only when a launcher is built: a service without --jobs-namespace runs
without the package.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from openrl_common.protocol import WORKER_ARGV
from openrl_service.errors import ApiError, UserError

log = logging.getLogger("openrl_service.kube")

JOB_COMMAND = ["python", *WORKER_ARGV]
SPEC_DIR = "/etc/openrl/job"
SPEC_PATH = f"{SPEC_DIR}/spec.json"
# The default job image is the notebook image (k8s/images/notebook.Dockerfile, docker-stacks):
# the same Python and libraries as the kernel that pickled the reward. Its user is jovyan 1000:100.
RUN_AS_USER = 1000
RUN_AS_GROUP = 100
TMP_SIZE = "2Gi"
DEFAULT_CPU = "1"
DEFAULT_MEMORY = "2Gi"
RESERVED_VOLUMES = ("job-spec", "tmp")
REQUEST_FIELDS = ("image", "volumes", "cpu", "memory")
REQUEST_TIMEOUT_S = (5, 30)  # connect, read: one call to the API server
# the worker's exit code after it reported its job failed (openrl_jupyter.jobs): do not retry
WORKER_REPORTED_FAILED = 3

LABEL_NAME = "app.kubernetes.io/name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB_ID = "openrl.dev/job-id"
LABEL_TENANT = "openrl.dev/tenant"  # a digest: tenants (hub:<user>) are not valid label values
LABEL_KIND = "openrl.dev/kind"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
ANNOTATION_TENANT = "openrl.dev/tenant"
ANNOTATION_JOB_NAME = "openrl.dev/job-name"
ANNOTATION_JOB_ID = "openrl.dev/job-id"

# What the launcher does to the API, per resource: k8s/components/jobs/rbac.yaml grants exactly this
# (tests/k8s/test_jobs.py checks both against what the launcher really calls).
API_VERBS = {
    ("batch", "jobs"): ("create", "get", "delete"),
    ("", "configmaps"): ("create", "delete"),
    ("", "secrets"): ("create",),
}

DNS_LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


# What the API server accepts as a quantity: a decimal number, then a decimal-SI suffix, a binary-SI
# one or a decimal exponent (k8s.io/apimachinery resource.Quantity), in ASCII.
QUANTITY_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?")


class KubernetesError(ApiError):
    """The Kubernetes API refused or could not be reached (502); the message names the object and
    what the API server said."""

    status_code = 502
    category = "server"


def parse_quantity(value: Any, name: str) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2", "4Gi") -> its value; ValueError naming ``name``.
    The text must be what the API server accepts (``QUANTITY_RE``: the client's parser is looser,
    it takes "2 Gi", "1_000m", other scripts' digits, NaN); the value is the client's
    ``kubernetes.utils.parse_quantity``."""
    try:
        from kubernetes.utils import parse_quantity as kube_quantity
    except ImportError:
        raise ValueError(
            f"{name}: the kubernetes package is missing: pip install 'openrl-jupyter[k8s]'"
        ) from None

    text = str(value).strip() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    amount = None
    if QUANTITY_RE.fullmatch(text):
        try:
            amount = kube_quantity(text)
        except (ValueError, ArithmeticError):
            amount = None
    if amount is None or not amount.is_finite():
        raise ValueError(f"{name} must be a Kubernetes quantity such as 500m, 2, 512Mi or 4Gi; got {value!r}")
    return amount


def dns_slug(text: str) -> str:
    """Lower-case letters, digits and single '-' (a DNS-1123 label's alphabet), no '-' at the ends."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", text.lower())).strip("-")


def digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def label_value(text: str) -> str:
    """``text`` when it is a valid label value, else a digest of it."""
    return text if LABEL_VALUE_RE.match(text) else "h" + digest(text, 40)


@dataclass
class JobVolume:
    """One volume the admin allows (an entry of --job-volumes-file)."""

    name: str
    volume: dict  # a core/v1 Volume without its name
    mount_path: str
    read_only: bool = True


def parse_volumes(text: str, source: str) -> dict[str, JobVolume]:
    """The volumes file: JSON or YAML ``{name: {volume: <Volume>, mountPath: str, readOnly: bool}}``."""
    try:
        data = json.loads(text)
    except ValueError:
        import yaml  # a dependency of the kubernetes client, which jobs need anyway

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{source}: not JSON or YAML ({e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: must be a mapping of volume name -> {{volume, mountPath, readOnly}}")
    out: dict[str, JobVolume] = {}
    for name, entry in data.items():
        where = f"{source}: volume {name!r}"
        if not isinstance(name, str) or not DNS_LABEL_RE.match(name) or name in RESERVED_VOLUMES:
            raise ValueError(
                f"{where}: the name must be a DNS-1123 label (a-z, 0-9, '-') other than "
                f"{', '.join(RESERVED_VOLUMES)}"
            )
        if not isinstance(entry, dict) or set(entry) - {"volume", "mountPath", "readOnly"}:
            raise ValueError(f"{where}: must be {{volume, mountPath, readOnly}}")
        volume = entry.get("volume")
        if not isinstance(volume, dict) or len(set(volume) - {"name"}) != 1:
            raise ValueError(f"{where}: 'volume' must be a Kubernetes Volume with exactly one source")
        mount = entry.get("mountPath")
        if (
            not isinstance(mount, str)
            or not mount.startswith("/")
            or mount.rstrip("/") in ("", "/tmp", SPEC_DIR)
        ):
            raise ValueError(f"{where}: mountPath must be an absolute path other than /, /tmp and {SPEC_DIR}")
        read_only = entry.get("readOnly", True)
        if not isinstance(read_only, bool):
            raise ValueError(f"{where}: readOnly must be true or false")
        out[name] = JobVolume(name, {k: v for k, v in volume.items() if k != "name"}, mount, read_only)
    mounts = [v.mount_path.rstrip("/") for v in out.values()]
    if len(set(mounts)) != len(mounts):
        raise ValueError(f"{source}: two volumes share a mountPath")
    return out


@dataclass
class KubeSettings:
    """What --jobs-namespace and the job settings configure (see openrl_service/config.py)."""

    namespace: str
    images: list[str]
    service_url: str
    queue: str | None = None
    volumes: dict[str, JobVolume] = field(default_factory=dict)
    max_cpu: str = "4"
    max_memory: str = "16Gi"
    backoff_limit: int = 2
    ttl_s: int = 3600
    service_account: str = "openrl-job"
    active_deadline_s: int | None = None

    def __post_init__(self) -> None:
        if not DNS_LABEL_RE.match(self.namespace or ""):
            raise ValueError(
                f"--jobs-namespace (OPENRL_JOBS_NAMESPACE) must be a namespace name; got {self.namespace!r}"
            )
        if not self.images or not all(isinstance(i, str) and i.strip() and " " not in i for i in self.images):
            raise ValueError(
                "--job-image (OPENRL_JOB_IMAGES) must name at least one image the jobs may run "
                f"(e.g. ghcr.io/openrl-jupyter/openrl-notebook:0.1.0); got {self.images!r}"
            )
        if not self.service_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--job-service-url (OPENRL_JOB_SERVICE_URL) must be an http(s) URL; got {self.service_url!r}"
            )
        if self.queue is not None and not LABEL_VALUE_RE.match(self.queue):
            raise ValueError(f"--job-queue (OPENRL_JOB_QUEUE) must be a LocalQueue name; got {self.queue!r}")
        for value, name in ((self.max_cpu, "OPENRL_JOB_MAX_CPU"), (self.max_memory, "OPENRL_JOB_MAX_MEMORY")):
            if parse_quantity(value, name) <= 0:
                raise ValueError(f"{name} must be above 0; got {value!r}")
        for value, name, low in (
            (self.backoff_limit, "OPENRL_JOB_BACKOFF_LIMIT", 0),
            (self.ttl_s, "OPENRL_JOB_TTL_S", 0),
            (self.active_deadline_s, "OPENRL_JOB_ACTIVE_DEADLINE_S", 1),
        ):
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be a whole number >= {low}; got {value!r}")
        if not DNS_LABEL_RE.match(self.service_account or ""):
            raise ValueError(
                f"OPENRL_JOB_SERVICE_ACCOUNT must be a service account name; got {self.service_account!r}"
            )

    @classmethod
    def from_settings(cls, settings) -> KubeSettings | None:
        """From the service's Settings; None when --jobs-namespace is unset. ValueError naming the
        flag or variable when a value is wrong."""
        if not getattr(settings, "jobs_namespace", None):
            return None
        volumes = {}
        if settings.job_volumes_file:
            path = Path(settings.job_volumes_file)
            try:
                text = path.read_text()
            except OSError as e:
                raise ValueError(
                    f"--job-volumes-file (OPENRL_JOB_VOLUMES_FILE): cannot read {path}: {e}"
                ) from None
            volumes = parse_volumes(text, f"--job-volumes-file {path}")
        return cls(
            namespace=settings.jobs_namespace,
            images=list(settings.job_images),
            service_url=settings.job_service_url
            or f"http://openrl-service.{settings.jobs_namespace}.svc.cluster.local:8000",
            queue=settings.job_queue or None,
            volumes=volumes,
            max_cpu=settings.job_max_cpu,
            max_memory=settings.job_max_memory,
            backoff_limit=settings.job_backoff_limit,
            ttl_s=settings.job_ttl_s,
            service_account=settings.job_service_account,
            active_deadline_s=settings.job_active_deadline_s,
        )


def load_api_client():
    """An ApiClient for the pod's service account (in the cluster), else the local kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ValueError(
            "--jobs-namespace needs the kubernetes package: pip install 'openrl-jupyter[k8s]'"
        ) from None
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as in_cluster:
        try:  # KUBECONFIG as it is now (the client reads it once, at its import)
            path = os.environ.get("KUBECONFIG") or "~/.kube/config"
            config.load_kube_config(config_file=path, client_configuration=configuration)
        except Exception as e:
            raise ValueError(
                f"--jobs-namespace: no Kubernetes credentials (in the cluster: {in_cluster}; kubeconfig: {e})"
            ) from None
    return client.ApiClient(configuration)


def launcher_from_settings(settings) -> KubeLauncher | None:
    """The service's launcher (``Container.kube``), or None when --jobs-namespace is unset."""
    kube = KubeSettings.from_settings(settings)
    return None if kube is None else KubeLauncher(kube)


class KubeLauncher:
    """Creates, reads and deletes the Kubernetes Jobs of detached runs (see the module docstring)."""

    def __init__(self, settings: KubeSettings, api_client=None):
        from kubernetes import client

        self.settings = settings
        self.namespace = settings.namespace
        self.api_client = api_client if api_client is not None else load_api_client()
        self._batch = client.BatchV1Api(self.api_client)
        self._core = client.CoreV1Api(self.api_client)

    # -- the request ---------------------------------------------------------------------------
    def validate(self, request: dict | None) -> dict:
        """The user's ``k8s`` object -> {image, volumes, cpu, memory} with defaults filled in; a
        UserError naming the field and what is allowed for anything else."""
        s = self.settings
        request = {} if request is None else request
        if not isinstance(request, dict):
            raise UserError(f"k8s must be an object with {', '.join(REQUEST_FIELDS)}", field="k8s")
        for key in request:
            if key not in REQUEST_FIELDS:
                key = str(key)[:64]
                raise UserError(
                    f"k8s.{key} is not accepted: a job chooses only {', '.join(REQUEST_FIELDS)} "
                    "(the pod template is fixed by the service)",
                    field=f"k8s.{key}",
                )
        image = request.get("image") or s.images[0]
        if image not in s.images:
            raise UserError(
                f"k8s.image must be one of the allowed images ({', '.join(s.images)}; OPENRL_JOB_IMAGES); "
                f"got {image!r}",
                field="k8s.image",
            )
        allowed = ", ".join(sorted(s.volumes)) or "none configured"
        volumes = request.get("volumes") or []
        if not isinstance(volumes, list):
            raise UserError(f"k8s.volumes must be a list of volume names ({allowed})", field="k8s.volumes")
        for i, v in enumerate(volumes):
            if not isinstance(v, str):
                raise UserError(
                    f"k8s.volumes[{i}] must be the name of an allowed volume ({allowed}; "
                    "OPENRL_JOB_VOLUMES_FILE); volume definitions come only from the admin",
                    field=f"k8s.volumes[{i}]",
                )
            if v not in s.volumes:
                raise UserError(
                    f"k8s.volumes[{i}] must be one of the allowed volumes ({allowed}; OPENRL_JOB_VOLUMES_FILE); "
                    f"got {v!r}",
                    field=f"k8s.volumes[{i}]",
                )
        out = {"image": image, "volumes": list(dict.fromkeys(volumes))}
        for key, default, limit, setting in (
            ("cpu", DEFAULT_CPU, s.max_cpu, "OPENRL_JOB_MAX_CPU"),
            ("memory", DEFAULT_MEMORY, s.max_memory, "OPENRL_JOB_MAX_MEMORY"),
        ):
            value = request.get(key)
            if value is None:
                over = parse_quantity(default, key) > parse_quantity(limit, setting)
                out[key] = limit if over else default
                continue
            try:
                amount = parse_quantity(value, f"k8s.{key}")
            except ValueError as e:
                raise UserError(str(e), field=f"k8s.{key}") from None
            if amount <= 0 or amount > parse_quantity(limit, setting):
                raise UserError(
                    f"k8s.{key} must be above 0 and <= {limit} ({setting}); got {value!r}", field=f"k8s.{key}"
                )
            out[key] = str(value).strip()
        return out

    # -- names and objects ----------------------------------------------------------------------
    @staticmethod
    def object_names(name: str, job_id: str) -> dict[str, str]:
        """DNS-1123 names (<= 63 characters) from the job's name and a digest of its id."""
        base = ("openrl-" + dns_slug(name))[:45].rstrip("-") + "-" + digest(job_id, 8)
        return {"job": base, "configmap": base + "-spec", "secret": base + "-token"}

    def labels(self, *, tenant: str, job_id: str, kind: str) -> dict[str, str]:
        return {
            LABEL_NAME: "openrl-job",
            LABEL_MANAGED_BY: "openrl-service",
            "app.kubernetes.io/part-of": "openrl-jupyter",
            LABEL_JOB_ID: label_value(job_id),
            LABEL_TENANT: digest(tenant, 16),
            LABEL_KIND: label_value(kind),
        }

    @staticmethod
    def annotations(*, tenant: str, job_id: str, name: str) -> dict[str, str]:
        return {ANNOTATION_TENANT: tenant, ANNOTATION_JOB_ID: job_id, ANNOTATION_JOB_NAME: name}

    def job_body(self, *, tenant: str, job_id: str, name: str, kind: str, request: dict) -> dict:
        """The batch/v1 Job (``request`` already validated), built with the client's typed models
        (a misspelt field is a TypeError here, not a field the API server drops) and returned as the
        JSON the API server receives."""
        from kubernetes import client as k

        s = self.settings
        names = self.object_names(name, job_id)
        labels = self.labels(tenant=tenant, job_id=job_id, kind=kind)
        annotations = self.annotations(tenant=tenant, job_id=job_id, name=name)
        chosen = [s.volumes[v] for v in request["volumes"]]
        resources = {"cpu": request["cpu"], "memory": request["memory"]}
        plain = {
            "OPENRL_URL": s.service_url,
            "OPENRL_JOB_ID": job_id,
            "OPENRL_JOB_SPEC": SPEC_PATH,
        }
        # The root filesystem is read-only: home and caches go to the /tmp volume.
        home = {
            "HOME": "/tmp/home",
            "XDG_CACHE_HOME": "/tmp/cache",
            "MPLCONFIGDIR": "/tmp/cache/matplotlib",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        token = k.V1EnvVar(
            name="OPENRL_TOKEN",
            value_from=k.V1EnvVarSource(
                secret_key_ref=k.V1SecretKeySelector(name=names["secret"], key="token")
            ),
        )
        env = [
            *(k.V1EnvVar(name=n, value=v) for n, v in plain.items()),
            token,
            *(k.V1EnvVar(name=n, value=v) for n, v in home.items()),
        ]
        worker = k.V1Container(
            name="worker",
            image=request["image"],
            image_pull_policy="IfNotPresent",
            command=list(JOB_COMMAND),
            env=env,
            resources=k.V1ResourceRequirements(requests=dict(resources), limits=dict(resources)),
            security_context=k.V1SecurityContext(
                allow_privilege_escalation=False,
                read_only_root_filesystem=True,
                run_as_non_root=True,
                capabilities=k.V1Capabilities(drop=["ALL"]),
            ),
            volume_mounts=[
                k.V1VolumeMount(name="job-spec", mount_path=SPEC_DIR, read_only=True),
                k.V1VolumeMount(name="tmp", mount_path="/tmp"),
                *(
                    k.V1VolumeMount(name=v.name, mount_path=v.mount_path, read_only=v.read_only)
                    for v in chosen
                ),
            ],
        )
        pod = k.V1PodSpec(
            restart_policy="Never",
            service_account_name=s.service_account,
            automount_service_account_token=False,
            enable_service_links=False,
            security_context=k.V1PodSecurityContext(
                run_as_non_root=True,
                run_as_user=RUN_AS_USER,
                run_as_group=RUN_AS_GROUP,
                fs_group=RUN_AS_GROUP,
                seccomp_profile=k.V1SeccompProfile(type="RuntimeDefault"),
            ),
            containers=[worker],
            volumes=[
                k.V1Volume(
                    name="job-spec",
                    config_map=k.V1ConfigMapVolumeSource(name=names["configmap"], default_mode=0o444),
                ),
                k.V1Volume(name="tmp", empty_dir=k.V1EmptyDirVolumeSource(size_limit=TMP_SIZE)),
                # the operator's volume sources (the volumes file), as the API server takes them
                *({"name": v.name, **v.volume} for v in chosen),
            ],
        )
        # The worker exits WORKER_REPORTED_FAILED after it reported the job failed (its key is
        # revoked): a retry could not authenticate, so that fails the Job at once. A pod evicted or
        # preempted (node drain, Kueue, spot) is retried without counting against backoffLimit.
        failure_policy = k.V1PodFailurePolicy(
            rules=[
                k.V1PodFailurePolicyRule(
                    action="FailJob",
                    on_exit_codes=k.V1PodFailurePolicyOnExitCodesRequirement(
                        container_name="worker", operator="In", values=[WORKER_REPORTED_FAILED]
                    ),
                ),
                k.V1PodFailurePolicyRule(
                    action="Ignore",
                    on_pod_conditions=[
                        k.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")
                    ],
                ),
            ]
        )
        job_labels = dict(labels)
        if s.queue:  # Kueue admits the Job by unsuspending it once its LocalQueue has quota
            job_labels[LABEL_QUEUE] = s.queue
        job = k.V1Job(
            api_version="batch/v1",
            kind="Job",
            metadata=k.V1ObjectMeta(
                name=names["job"], namespace=self.namespace, labels=job_labels, annotations=annotations
            ),
            spec=k.V1JobSpec(
                backoff_limit=s.backoff_limit,
                pod_failure_policy=failure_policy,
                ttl_seconds_after_finished=s.ttl_s,
                active_deadline_seconds=s.active_deadline_s,
                suspend=True if s.queue else None,
                template=k.V1PodTemplateSpec(
                    metadata=k.V1ObjectMeta(labels=dict(labels), annotations=dict(annotations)), spec=pod
                ),
            ),
        )
        return k.ApiClient().sanitize_for_serialization(job)

    def _owned(self, kind: str, name: str, owner: dict, labels: dict, annotations: dict) -> dict:
        """A ConfigMap or Secret the Job owns (the garbage collector deletes it with the Job)."""
        from kubernetes import client as k

        meta = k.V1ObjectMeta(
            name=name,
            namespace=self.namespace,
            labels=labels,
            annotations=annotations,
            owner_references=[k.V1OwnerReference(**owner)],
        )
        model = k.V1ConfigMap if kind == "ConfigMap" else k.V1Secret
        return k.ApiClient().sanitize_for_serialization(
            model(api_version="v1", kind=kind, metadata=meta, immutable=True)
        )

    # -- the API --------------------------------------------------------------------------------
    def submit(
        self, *, tenant: str, job_id: str, name: str, kind: str, key: str, request: dict | None
    ) -> dict:
        """Create the Job, then its ConfigMap and Secret (owned by the Job); on any failure delete
        what was created and raise KubernetesError. -> {namespace, job, configmap, secret}"""
        request = self.validate(request)
        names = self.object_names(name, job_id)
        labels = self.labels(tenant=tenant, job_id=job_id, kind=kind)
        annotations = self.annotations(tenant=tenant, job_id=job_id, name=name)
        job = self.job_body(tenant=tenant, job_id=job_id, name=name, kind=kind, request=request)
        created: list[tuple[str, str]] = []
        step = ("Job", names["job"])
        try:
            reply = self._batch.create_namespaced_job(self.namespace, job, _request_timeout=REQUEST_TIMEOUT_S)
            created.append(step)
            uid = getattr(getattr(reply, "metadata", None), "uid", None)
            if not uid:
                raise RuntimeError("the create reply carries no metadata.uid")
            owner = {"api_version": "batch/v1", "kind": "Job", "name": names["job"], "uid": uid}
            spec = {"job_id": job_id, "name": name, "kind": kind, "service_url": self.settings.service_url}
            configmap = self._owned("ConfigMap", names["configmap"], owner, labels, annotations)
            configmap["data"] = {"spec.json": json.dumps(spec, indent=1, sort_keys=True)}
            step = ("ConfigMap", names["configmap"])
            self._core.create_namespaced_config_map(
                self.namespace, configmap, _request_timeout=REQUEST_TIMEOUT_S
            )
            created.append(step)
            secret = self._owned("Secret", names["secret"], owner, labels, annotations)
            secret["type"] = "Opaque"
            secret["data"] = {"token": base64.b64encode(key.encode()).decode()}
            step = ("Secret", names["secret"])
            self._core.create_namespaced_secret(self.namespace, secret, _request_timeout=REQUEST_TIMEOUT_S)
        except Exception as e:
            self._cleanup(created)
            raise KubernetesError(
                f"Kubernetes: creating {step[0]} {step[1]} in namespace {self.namespace} failed: {describe(e)}"
                + (f" (removed {', '.join(f'{k} {n}' for k, n in created)})" if created else "")
            ) from None
        return {"namespace": self.namespace, **names}

    def _cleanup(self, created: list[tuple[str, str]]) -> None:
        """Delete what a failed submit created, newest first; failures are logged, not raised."""
        delete = {
            "Job": lambda n: self._batch.delete_namespaced_job(
                n, self.namespace, propagation_policy="Background", _request_timeout=REQUEST_TIMEOUT_S
            ),
            "ConfigMap": lambda n: self._core.delete_namespaced_config_map(
                n, self.namespace, _request_timeout=REQUEST_TIMEOUT_S
            ),
        }
        for kind, name in reversed(created):
            try:
                delete[kind](name)
            except Exception as e:
                if getattr(e, "status", None) != 404:
                    log.warning("could not remove %s %s after a failed submit: %s", kind, name, describe(e))

    def status(self, job_name: str) -> dict:
        """{phase: pending|running|succeeded|failed|missing, active, succeeded, failed, reason}."""
        from kubernetes.client.exceptions import ApiException

        try:
            job = self._batch.read_namespaced_job(
                job_name, self.namespace, _request_timeout=REQUEST_TIMEOUT_S
            )
        except ApiException as e:
            if e.status == 404:
                return {"phase": "missing", "active": 0, "succeeded": 0, "failed": 0, "reason": None}
            raise KubernetesError(f"Kubernetes: reading Job {job_name} failed: {describe(e)}") from None
        except Exception as e:
            raise KubernetesError(f"Kubernetes: reading Job {job_name} failed: {describe(e)}") from None
        return job_phase(job.to_dict() if hasattr(job, "to_dict") else job)

    def delete(self, job_name: str) -> None:
        """Delete the Job; the garbage collector removes its pods, ConfigMap and Secret
        (propagationPolicy Background). An already deleted Job is not an error."""
        from kubernetes.client.exceptions import ApiException

        try:
            self._batch.delete_namespaced_job(
                job_name, self.namespace, propagation_policy="Background", _request_timeout=REQUEST_TIMEOUT_S
            )
        except ApiException as e:
            if e.status != 404:
                raise KubernetesError(f"Kubernetes: deleting Job {job_name} failed: {describe(e)}") from None
        except Exception as e:
            raise KubernetesError(f"Kubernetes: deleting Job {job_name} failed: {describe(e)}") from None


def job_phase(job: dict) -> dict:
    """A Job (as a dict, snake_case or camelCase) -> the phase the jobs API shows."""
    spec = job.get("spec") or {}
    status = job.get("status") or {}
    conditions = [c for c in status.get("conditions") or [] if str(c.get("status")) == "True"]
    types = {c.get("type"): c for c in conditions}
    counts = {k: int(status.get(k) or 0) for k in ("active", "succeeded", "failed")}
    ready = status.get("ready")
    if "Complete" in types or "SuccessCriteriaMet" in types:
        phase, cond = "succeeded", types.get("Complete") or types.get("SuccessCriteriaMet")
    elif "Failed" in types or "FailureTarget" in types:
        phase, cond = "failed", types.get("Failed") or types.get("FailureTarget")
    elif spec.get("suspend") or "Suspended" in types:
        phase, cond = "pending", types.get("Suspended")
    elif (ready if ready is not None else counts["active"]) > 0:
        phase, cond = "running", None
    else:
        phase, cond = "pending", None
    return {"phase": phase, **counts, "reason": (cond or {}).get("reason")}


def describe(e: BaseException) -> str:
    """What the API server (or the connection) said, in one line."""
    status = getattr(e, "status", None)
    if status is not None and hasattr(e, "body"):
        message = None
        try:
            message = json.loads(e.body or "{}").get("message")
        except (ValueError, AttributeError):
            pass
        return f"{status} {getattr(e, 'reason', '') or ''}".strip() + (f": {message}" if message else "")
    return f"{type(e).__name__}: {e}"
