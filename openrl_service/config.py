"""One typed settings object for the service: flags > environment (OPENRL_*) > defaults.

The defaults are the dataclasses below; the environment is read by pydantic-settings
(:func:`read_env`), one ``OPENRL_<FIELD>`` variable per field in the formats operators write
(comma-separated lists, on/off switches, ``tenant:key`` pairs; tests/service/test_settings_env.py
parses each); the CLI's flags (``cli.py``) go on top.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import os
import re
import secrets
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pydantic
from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from openrl_common.datadirs import model_data_dir

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def default_data_dir(models: list[str] | None = None) -> Path:
    """The served models' folder under the one data home the notebook's embedded service and the CLI
    share (openrl_common.datadirs.model_data_dir): ``~/.local/share/openrl/tiny`` for the tiny model."""
    return Path(model_data_dir(models))


@dataclass
class Limits:
    """Per-request limits; each error names the setting that raises it."""

    max_body_bytes: int = 64 * 1024 * 1024  # OPENRL_MAX_BODY_BYTES
    max_datums: int = 4096  # OPENRL_MAX_DATUMS
    max_num_samples: int = 128  # OPENRL_MAX_NUM_SAMPLES
    max_tokens: int = 4096  # OPENRL_MAX_TOKENS (sampling)
    max_rank: int = 128  # OPENRL_MAX_RANK
    max_runs_per_tenant: int = 64  # OPENRL_MAX_RUNS_PER_TENANT
    # OPENRL_MAX_FULL_RUNS_PER_TENANT: live full fine-tunes (rank 0) among them; each holds a whole copy
    # of the model's training state, which takes the device in turns with everyone's and waits on disk
    max_full_runs_per_tenant: int = 4
    max_sessions_per_tenant: int = 256  # OPENRL_MAX_SESSIONS_PER_TENANT: live (not finished) sessions
    # OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT: a tenant's checkpoints on disk, all kinds together
    max_checkpoint_bytes_per_tenant: int = 50 << 30
    max_topk: int = 20  # OPENRL_MAX_TOPK
    max_stop_sequences: int = 16  # OPENRL_MAX_STOP_SEQUENCES
    max_target_k: int = 64  # OPENRL_MAX_TARGET_K: K of [N, K] targets
    max_request_tokens: int = 4 * 1024 * 1024  # OPENRL_MAX_REQUEST_TOKENS: Σ N·K over a call's datums
    # OPENRL_SAMPLE_BATCH_BYTES: the most one batched generate of the torch sampler may take (its
    # estimate, sampling/budget.py); a call is split into batches within it, a single sample over it is
    # refused (413). None: a quarter of a GPU's free memory, an eighth of the host's (at most 8 GiB)
    sample_batch_bytes: int | None = None
    max_metadata_bytes: int = 64 * 1024  # OPENRL_MAX_METADATA_BYTES: user_metadata / tags, as JSON
    max_metric_rows: int = 100_000  # OPENRL_MAX_METRIC_ROWS: a native run keeps its newest rows, drops older
    max_job_payload_bytes: int = 8 * 1024 * 1024  # OPENRL_MAX_JOB_PAYLOAD_BYTES: a detached job's payload
    max_jobs_per_tenant: int = 100  # OPENRL_MAX_JOBS_PER_TENANT: jobs kept (any state) until deleted
    # OPENRL_MAX_JOB_PAYLOAD_TOTAL_BYTES: every payload version of a tenant's kept jobs, together
    max_job_payload_total_bytes: int = 256 * 1024 * 1024
    # OPENRL_JOB_LOST_AFTER_S: a running job with no request from its key for this long (and a local
    # job still submitted after it) is failed and its key revoked (its worker died without reporting)
    job_lost_after_s: int = 300
    # Queue limits (backpressure). Per lane: one training run, or one sampler. Sampling over a limit is
    # refused with 429 + Retry-After; training is queued and reported as try_again/paused_capacity.
    max_queued_per_run: int = 64  # OPENRL_MAX_QUEUED_PER_RUN: queued requests per run or sampler
    max_queued_total: int = 1024  # OPENRL_MAX_QUEUED_TOTAL: queued requests in the whole service
    # Device time (engine/usage.py): OPENRL_MAX_DEVICE_SECONDS_PER_TENANT is the seconds the engine's
    # ops may hold the devices for one tenant (summed over a group's ranks) in any
    # OPENRL_DEVICE_SECONDS_WINDOW_S; past it the tenant's new work is refused with 429 + Retry-After
    # until the window frees room. None: no quota (usage is still measured and shown).
    max_device_seconds_per_tenant: float | None = None
    device_seconds_window_s: float = 3600.0


@dataclass
class Settings:
    model: str = "tiny"  # "tiny" | HF folder | .gguf file
    model_name: str | None = None  # the name clients use; derived from the model when None
    # OPENRL_MODELS (comma-separated) / --model repeated: several base models in one service, each
    # SPEC or NAME=SPEC, optionally @DEVICE (see model_entries); empty: the one ``model`` above
    models: list[str] = field(default_factory=list)
    # OPENRL_MEMORY_BUDGET_BYTES / --memory-budget-bytes: what the models may take on each device
    # (weights + allowance, see models/loading.py); None: the device's free memory at startup
    memory_budget_bytes: int | None = None
    # Full fine-tunes (rank 0, training/full.py): OPENRL_FULL_RUN_BUDGET_BYTES is what full runs'
    # weights, gradients and optimizer state may hold on a model's device (None: 80 % of what is free
    # once the models are loaded); runs beyond it take turns. OPENRL_FULL_HOST_BUDGET_BYTES: host
    # memory for the runs moved off a GPU (None: half the available RAM; a CPU device spills to disk).
    full_run_budget_bytes: int | None = None
    full_host_budget_bytes: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(default_factory=default_data_dir)
    api_keys_file: Path | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    # what /readyz?challenge= proves it holds (openrl_common.datadirs): the starting kernel's
    # OPENRL_INSTANCE_SECRET (read by `serve`, written to <data>/instance-secret), else a fresh one
    instance_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    no_auth: bool = False
    insecure: bool = False
    allowed_hosts: list[str] = field(default_factory=list)
    device: str | None = None  # cuda | mps | cpu; auto when None
    # OPENRL_TORCH_THREADS: the device worker's intra-op threads; unset, torch's default (one per core,
    # or OMP_NUM_THREADS): on a quiet 2-core machine 2 threads trained 1.5x faster than 1
    torch_threads: int | None = None
    # Several devices per base model (openrl_service/group/): OPENRL_WORLD_SIZE / --world-size: ranks
    # in the torch.distributed group (one process per device; gloo on CPU, NCCL on CUDA), across
    # OPENRL_NNODES / --nnodes nodes, this one OPENRL_NODE_RANK / --node-rank; with several nodes the
    # group meets at OPENRL_MASTER_ADDR:OPENRL_MASTER_PORT (node 0 binds it). OPENRL_DEVICES /
    # --devices: this node's devices, one per rank (cuda:0,cuda:1,…; default: every visible GPU, or the
    # CPU). OPENRL_GROUP_TIMEOUT_S: a collective waiting longer on a rank tears the group down (it is
    # restarted and the journal replayed); OPENRL_GROUP_MAX_RESTARTS: restarts in a row, each within a
    # minute of the last, before `serve` gives up.
    world_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    devices: list[str] = field(default_factory=list)
    group_timeout_s: float = 120.0
    group_max_restarts: int = 5
    group_log_commands: bool = False  # OPENRL_GROUP_LOG_COMMANDS: each rank logs every command it runs
    # OPENRL_VLLM_TP / --vllm-tp: vLLM's tensor_parallel_size; OPENRL_SAMPLER_DEVICES /
    # --sampler-devices: GPUs for vLLM apart from the training group's (default: colocated on them)
    vllm_tp: int = 1
    sampler_devices: list[str] = field(default_factory=list)
    # Engine timing.
    long_poll_s: float = 25.0  # OPENRL_LONG_POLL_S: how long retrieve_future holds before try_again
    future_ttl_s: float = 3600.0  # OPENRL_FUTURE_TTL_S: completed results stay fetchable this long
    # OPENRL_MAX_RESULT_BYTES: ...and hold this much memory at most, all together (the oldest, those
    # already fetched first, go first; a client asking for one gets 410 naming both limits)
    max_result_bytes: int = 1 << 30
    seq_gap_timeout_s: float = 120.0  # OPENRL_SEQ_GAP_TIMEOUT_S: a missing seq_id fails waiters after this
    # OPENRL_MICROBATCH_TOKENS: padded tokens per forward/backward micro-batch; also the slice of a
    # big call between which other runs' ops are served
    microbatch_tokens: int = 16384
    # OPENRL_FUSION (on|off): the worker runs ready ops of several runs (forward/backward of one
    # micro-batch, or sampling) as ONE fused pass with per-row adapters. Results equal unfused execution
    # to float rounding; off keeps every run bit-identical to running alone.
    fusion: bool = True
    # OPENRL_FUSION_MAX_TOKENS: padded tokens one fused op may cover (default: microbatch_tokens)
    fusion_max_tokens: int | None = None
    backpressure_retry_after_s: float = 1.0  # OPENRL_BACKPRESSURE_RETRY_AFTER_S: Retry-After of a 429
    max_sampler_snapshots: int = 256  # OPENRL_MAX_SAMPLER_SNAPSHOTS: in-memory snapshots kept, newest first
    max_sampler_snapshot_bytes: int = 4 << 30  # OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES: and their total size
    # OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT: of those, one tenant's (its least recently used go first)
    max_sampler_snapshots_per_tenant: int = 64
    # sequences a tenant's record_stability_info samplers keep for stable_reinforce (engine/stability.py)
    max_stability_records: int = 65536
    # OPENRL_MAX_STABILITY_BYTES: all tenants' records together; over it the heaviest tenant gives way
    max_stability_bytes: int = 1 << 30
    min_ttl_s: float = 3600.0  # OPENRL_MIN_TTL_S: shortest checkpoint TTL accepted (Tinker: 1 hour)
    session_idle_timeout_s: float = 3600.0  # OPENRL_SESSION_IDLE_TIMEOUT_S: no heartbeat/request → finished
    # OPENRL_DRAIN_GRACE_S / --drain-grace-s: on SIGTERM, how long accepted work may take to finish
    # before it is failed and the process exits (see openrl_service/lifecycle.py)
    drain_grace_s: float = 25.0
    # OPENRL_DURABILITY / --durability (journal|none): journal every accepted request (fsync before the
    # reply) and snapshot the state, so a kill -9 loses nothing acknowledged (engine/durability.py);
    # none keeps everything in memory only: a crash or restart loses every run, result and sample
    durability: str = "journal"
    # OPENRL_SNAPSHOT_INTERVAL_S / --snapshot-interval-s: how often (when anything changed) the state
    # is snapshotted and the journal compacted; it bounds the replay a restart does
    snapshot_interval_s: float = 30.0
    # OPENRL_HEALTH_STALL_S: /healthz fails (503) when work is waiting and the device worker has made
    # no progress for this long (openrl_service/progress.py: ops, layers, spill and snapshot tensors
    # tick); 0 turns the check off. The k8s liveness probe restarts a pod it fails for.
    health_stall_s: float = 300.0
    # OPENRL_RECOVERY_SKIP_FAILED / --recovery-skip-failed: start even when recovery meets journal
    # records this release cannot replay, dropping them (listed in journal/unreplayed-*.json); off,
    # such a start is refused with the records named and the choices
    recovery_skip_failed: bool = False
    # OPENRL_SAMPLER / --sampler (auto|torch|vllm): auto = vLLM where CUDA and vllm are installed.
    # vLLM settings (OPENRL_VLLM_*): GPU memory fraction vLLM may take (the trainer's share is checked
    # at startup), CPU KV cache size, LoRA slots per batch / kept loaded, longest prompt + decode.
    sampler: str = "auto"
    vllm_gpu_memory_utilization: float = 0.5
    vllm_kv_cache_gb: float = 1.0
    vllm_max_loras: int = 4
    vllm_max_cpu_loras: int = 16
    vllm_max_model_len: int | None = None  # None: the model's context length
    # JupyterHub identity (api/hubauth.py). OPENRL_HUB_API_URL / --hub-api-url: the hub's REST API
    # root (e.g. http://hub:8081/hub/api); when set, a hub user's own API token is accepted and
    # resolved through GET <url>/user to the tenant hub:<username>, if it carries the scope
    # access:services!service=<hub_service_name>. OPENRL_HUB_CACHE_TTL_S: how long a resolution is
    # reused (a token revoked at the hub stops working within it). OPENRL_MAX_KEYS_PER_USER: Tinker
    # keys (tml-…) a hub user may mint. OPENRL_HUB_FAILED_LOOKUPS_PER_MIN /
    # --hub-failed-lookups-per-min: hub lookups that fail (tokens the hub refuses) one client
    # address may cause a minute; past it that address gets 429 + Retry-After for tokens not already
    # known valid, and the hub is not asked.
    hub_api_url: str | None = None
    hub_service_name: str = "openrl"
    hub_cache_ttl_s: float = 60.0
    max_keys_per_user: int = 20
    hub_failed_lookups_per_min: int = 30
    # The service's own hub token: $JUPYTERHUB_API_TOKEN, read only when hub_api_url is set (an
    # embedded service in a kernel never takes the kernel's token); scope read:users. With it, minted
    # keys and job keys of a hub user are re-checked against the hub at most every
    # OPENRL_HUB_USER_RECHECK_S / --hub-user-recheck-s (a deleted user's keys stop within it).
    # OPENRL_MINTED_KEY_TTL_S / --minted-key-ttl-s: a minted key expires this long after minting.
    hub_api_token: str | None = field(default=None, repr=False)
    hub_user_recheck_s: float = 60.0
    minted_key_ttl_s: float = 30 * 86400.0
    # Detached runs as Kubernetes Jobs (openrl_service/kube.py). OPENRL_JOBS_NAMESPACE /
    # --jobs-namespace: the namespace the service runs in, where it creates the Jobs (unset: no k8s
    # jobs); OPENRL_JOB_IMAGES / --job-image: the images a job may run, the first the default;
    # OPENRL_JOB_SERVICE_URL / --job-service-url: how job pods reach this service (default
    # http://openrl-service.<namespace>.svc.cluster.local:8000); OPENRL_JOB_QUEUE / --job-queue: a Kueue
    # LocalQueue; OPENRL_JOB_VOLUMES_FILE / --job-volumes-file: the volumes a job may mount by name;
    # OPENRL_JOB_MAX_CPU / OPENRL_JOB_MAX_MEMORY: the most a job may ask for; OPENRL_JOB_BACKOFF_LIMIT,
    # OPENRL_JOB_TTL_S (ttlSecondsAfterFinished), OPENRL_JOB_ACTIVE_DEADLINE_S, and
    # OPENRL_JOB_SERVICE_ACCOUNT (the pods' account: no RBAC, no token).
    jobs_namespace: str | None = None
    job_images: list[str] = field(default_factory=list)
    job_service_url: str | None = None
    job_queue: str | None = None
    job_volumes_file: Path | None = None
    job_max_cpu: str = "4"
    job_max_memory: str = "16Gi"
    job_backoff_limit: int = 2
    job_ttl_s: int = 3600
    job_active_deadline_s: int | None = None
    job_service_account: str = "openrl-job"
    limits: Limits = field(default_factory=Limits)

    def model_entries(self) -> list[ModelEntry]:
        """The served models, the first one the default: ``models`` or else ``model``, each parsed
        as ``[NAME=]SPEC[@DEVICE]`` (``--model-name`` names the model when there is one)."""
        specs = self.models or [self.model]
        entries = [parse_model_entry(text) for text in specs]
        if self.model_name:
            if len(entries) > 1:
                raise ValueError(
                    "--model-name (OPENRL_MODEL_NAME) names the one served model; with several models "
                    "write each as NAME=SPEC"
                )
            entries[0] = dataclasses.replace(entries[0], name=self.model_name)
        return [dataclasses.replace(e, device=e.device or self.device) for e in entries]

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    @property
    def auth_enabled(self) -> bool:
        return not (self.no_auth or self.insecure)


@dataclass(frozen=True)
class ModelEntry:
    """One served model as configured: its spec (tiny | tiny-wide | HF folder | .gguf), the name
    clients use (None: derived from the model) and its device (None: the best available)."""

    spec: str
    name: str | None = None
    device: str | None = None


DEVICE_RE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")


def parse_model_entry(text: str) -> ModelEntry:
    """``[NAME=]SPEC[@DEVICE]`` -> ModelEntry: ``tiny``, ``wide=tiny-wide@cpu``,
    ``qwen=/models/Qwen2.5-0.5B@cuda:1``. The device suffix counts only when it names a device."""
    text = text.strip()
    name, sep, spec = text.partition("=")
    if not sep:
        name, spec = None, text
    head, at, tail = spec.rpartition("@")
    device = None
    if at and DEVICE_RE.match(tail):
        spec, device = head, tail
    if not spec or (name is not None and (not name.strip() or len(name) > 256)):
        raise ValueError(f"--model/OPENRL_MODELS: {text!r} must be SPEC or NAME=SPEC, optionally @DEVICE")
    return ModelEntry(spec, name.strip() if name else None, device)


DURABILITY = ("journal", "none")
SAMPLERS = ("auto", "torch", "vllm")


def parse_choice(value: str, name: str, choices: tuple[str, ...]) -> str:
    v = value.strip().lower()
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return v


def parse_switch(value: str, name: str) -> bool:
    """on/off, true/false, 1/0, yes/no (any case) -> bool; anything else is an error naming ``name``."""
    v = value.strip().lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"{name} must be on or off; got {value!r}")


TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z: "$" would let a final newline in
HUB_TENANT_PREFIX = "hub:"  # JupyterHub users' tenants: hub:<username>; API-key tenants have no ':'
HUB_FOLDER_PREFIX = "hub~"  # a hub user's folder: hub~<encoded name>, or hub~~<digest> for a long name
_FOLDER_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_MAX_ENCODED = 200  # longer encoded hub names are stored under their digest (file names stop at 255)


def hub_tenant(username: str) -> str:
    return HUB_TENANT_PREFIX + username


def _encode(text: str) -> str:
    """Lower-case letters, digits and ``._-`` as they are; every other character (upper case letters
    included) as ``%xx`` per UTF-8 byte, lower-case hex. Prefix-free per character, so 1:1, and the
    result has no upper-case letter, so it stays 1:1 where the file system ignores case."""
    return "".join(
        c if c in _FOLDER_SAFE else "".join(f"%{b:02x}" for b in c.encode("utf-8", "surrogatepass"))
        for c in text
    )


def tenant_folder(tenant: str) -> str:
    """The folder name of a tenant's data, 1:1 over every tenant name, also on a file system that
    ignores case (macOS, Windows): an API-key tenant's name, a hub user's ``hub~`` and the encoded
    user name (:func:`_encode`, so never a ``~``), or ``hub~~`` and a digest when that would be too
    long for a file name — a form no encoded name can take. The usual lower-case names keep their
    plain folder (``alice``, ``hub~alice``). Data dirs of releases that mapped names differently are
    moved at start (:func:`openrl_service.storage.layout.migrate_tenant_folders`)."""
    if TENANT_RE.match(tenant):
        return _encode(tenant)
    if tenant.startswith(HUB_TENANT_PREFIX) and len(tenant) > len(HUB_TENANT_PREFIX):
        name = _encode(tenant[len(HUB_TENANT_PREFIX) :])
        if len(name) <= _MAX_ENCODED:
            return HUB_FOLDER_PREFIX + name
        return HUB_FOLDER_PREFIX + "~" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()
    raise ValueError(f"invalid tenant name {tenant!r}")


def folder_tenant(folder: str) -> str | None:
    """The tenant whose folder is ``folder`` (the inverse of :func:`tenant_folder`), or None when
    ``folder`` is not a name :func:`tenant_folder` gives or is a long name's digest form."""
    if folder.startswith(HUB_FOLDER_PREFIX + "~"):
        return None
    hub = folder.startswith(HUB_FOLDER_PREFIX)
    encoded = folder[len(HUB_FOLDER_PREFIX) :] if hub else folder
    try:
        raw = bytearray()
        i = 0
        while i < len(encoded):
            c = encoded[i]
            if c == "%" and re.fullmatch(r"[0-9a-f]{2}", encoded[i + 1 : i + 3]):
                raw.append(int(encoded[i + 1 : i + 3], 16))
                i += 3
            elif c in _FOLDER_SAFE:
                raw += c.encode()
                i += 1
            else:
                return None
        name = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    tenant = hub_tenant(name) if hub else name
    try:
        return tenant if tenant_folder(tenant) == folder else None
    except ValueError:
        return None


def _api_key_entry(tenant: str, key: str, source: str) -> tuple[str, str]:
    tenant, key = tenant.strip(), key.strip()
    if not tenant or not key:
        raise ValueError(f"{source}: every entry needs a tenant and a key")
    if not TENANT_RE.match(tenant):
        raise ValueError(
            f"{source}: tenant name {tenant!r} must be 1-64 letters, digits, '.', '_' or '-' starting with a letter or digit"
        )
    if not key.startswith("tml-"):
        raise ValueError(
            f"{source}: the key for tenant {tenant!r} must start with 'tml-' (the Tinker SDK requires it)"
        )
    return key, tenant


def parse_api_keys_env(text: str, source: str = "OPENRL_API_KEYS") -> dict[str, str]:
    """``tenant:key,tenant:key`` -> {key: tenant}."""
    keys = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        tenant, sep, key = item.partition(":")
        if not sep:
            raise ValueError(f"{source}: entry {item.split(':')[0]!r}... must be 'tenant:key'")
        k, t = _api_key_entry(tenant, key, source)
        keys[k] = t
    return keys


def parse_api_keys_file(text: str, source: str) -> dict[str, str]:
    """Lines ``tenant key`` (blank lines and # comments skipped) -> {key: tenant}."""
    keys = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise ValueError(f"{source}: line {n} must be 'tenant key'")
        k, t = _api_key_entry(parts[0], parts[1], f"{source} line {n}")
        keys[k] = t
    return keys


# -- the environment: pydantic-settings reads each OPENRL_* variable in its documented format --------
# Every Settings and Limits field is read from OPENRL_<FIELD> except these (flags or files only: a
# variable left in a shell must not turn authentication off); api_keys is OPENRL_API_KEYS
# (tenant:key,tenant:key) and hub_api_token is JUPYTERHUB_API_TOKEN, read where a hub is set.
NOT_FROM_ENV = ("api_keys_file", "no_auth", "insecure", "hub_api_token", "limits", "instance_secret")
_CHOICES = {"durability": DURABILITY, "sampler": SAMPLERS}


def _var(name: str) -> str:
    return f"OPENRL_{name.upper()}"


def comma_list(value: Any) -> Any:
    """``a,b , c`` -> [a, b, c] (empty items dropped): OPENRL_MODELS, OPENRL_JOB_IMAGES,
    OPENRL_ALLOWED_HOSTS are comma-separated, not JSON."""
    return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value


def _env_type(name: str, hint: Any) -> Any:
    """The type pydantic-settings reads ``name``'s variable as: the field's own, with the formats the
    variables have always had (comma lists, on/off switches, choices, ``tenant:key`` pairs)."""
    var = _var(name)
    if name == "api_keys":
        return Annotated[dict, NoDecode, BeforeValidator(lambda v: parse_api_keys_env(v, var))]
    if name in _CHOICES:
        return Annotated[str, BeforeValidator(lambda v: parse_choice(v, var, _CHOICES[name]))]
    if hint is bool:
        return Annotated[bool, BeforeValidator(lambda v: parse_switch(v, var))]
    if typing.get_origin(hint) is list or list[str] in typing.get_args(hint):
        return Annotated[list[str], NoDecode, BeforeValidator(comma_list)]
    return hint


def _env_model() -> type[BaseSettings]:
    fields: dict[str, Any] = {}
    for cls in (Settings, Limits):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in NOT_FROM_ENV:
                fields[f.name] = (_env_type(f.name, hints[f.name]) | None, Field(None, alias=_var(f.name)))
    return pydantic.create_model(  # type: ignore[call-overload]
        "EnvSettings",
        __base__=_EnvBase,
        __doc__="What the OPENRL_* variables set (None: not set, the Settings default applies).",
        **fields,
    )


_ENV: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("openrl_env", default=None)


class _EnvBase(BaseSettings):
    model_config = SettingsConfigDict(
        case_sensitive=True, env_ignore_empty=True, extra="ignore", populate_by_name=False
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_others):
        env = _ENV.get()
        return (env_settings,) if env is None else (_MappingSource(settings_cls, env),)


class _MappingSource(EnvSettingsSource):
    """The environment as given (``from_env(env)``), not ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]):
        self._given = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:  # (DotEnvSettingsSource overrides it too)
        return {k: v for k, v in self._given.items() if v != ""}


_EnvSettings: type[BaseSettings] | None = None


def _why(error: dict) -> str:
    kind = error["type"]
    if kind == "int_parsing":
        return "must be a whole number"
    if kind == "float_parsing":
        return "must be a number"
    return str(error.get("ctx", {}).get("error") or error["msg"])


def _env_settings() -> type[BaseSettings]:
    global _EnvSettings
    if _EnvSettings is None:
        _EnvSettings = _env_model()
    return _EnvSettings


def env_variables() -> set[str]:
    """The OPENRL_* variables the service reads."""
    return {f.alias for f in _env_settings().model_fields.values() if f.alias}


def read_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the environment gives (``os.environ`` unless ``env``), by field name; a value in
    the wrong format is a ValueError naming its variable."""
    token = _ENV.set(env)
    try:
        read = _env_settings()()
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False)[0]
        var = str(err["loc"][0])  # the variable's name (each field's alias)
        why = _why(err)
        raise ValueError(why if why.startswith(var) else f"{var} {why}; got {err.get('input')!r}") from None
    finally:
        _ENV.reset(token)
    return {k: v for k, v in read.model_dump().items() if v is not None}


def from_env(env: Mapping[str, str] | None = None, **overrides) -> Settings:
    """Settings from OPENRL_* variables, then explicit overrides (the CLI flags) on top."""
    s = Settings()
    limit_names = {f.name for f in dataclasses.fields(Limits)}
    given = read_env(env)
    for name, value in given.items():
        setattr(s.limits if name in limit_names else s, name, value)
    for name, value in overrides.items():
        if value is None:
            continue
        if hasattr(s.limits, name):
            setattr(s.limits, name, value)
        else:
            setattr(s, name, value)
    if s.api_keys_file is not None:
        s.api_keys.update(parse_api_keys_file(Path(s.api_keys_file).read_text(), str(s.api_keys_file)))
    if "data_dir" not in given and overrides.get("data_dir") is None:  # the served models' own folder
        s.data_dir = default_data_dir(s.models or [s.model])
    s.data_dir = Path(s.data_dir)
    # The service's own hub token only where it talks to a hub (never a kernel's token otherwise)
    token = ((os.environ if env is None else env).get("JUPYTERHUB_API_TOKEN") or "").strip()
    s.hub_api_token = (token or None) if s.hub_api_url else None
    check_device_quota(s.limits)
    return s


MAX_DEVICE_WINDOW_S = 30 * 86400.0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_device_quota(limits: Limits) -> None:
    """ValueError naming the variable when the device-time quota's settings are out of range."""
    quota, window = limits.max_device_seconds_per_tenant, limits.device_seconds_window_s
    if quota is not None and not (_number(quota) and 0 < quota < float("inf")):
        raise ValueError(
            "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT must be a number of device-seconds > 0 (unset: no "
            f"quota); got {quota!r}"
        )
    if not (_number(window) and 1 <= window <= MAX_DEVICE_WINDOW_S):
        raise ValueError(
            f"OPENRL_DEVICE_SECONDS_WINDOW_S must be a number of seconds in [1, {MAX_DEVICE_WINDOW_S:.0f}] "
            f"(30 days); got {window!r}"
        )
