"""Every OPENRL_* variable, in the format the docs (docs/service/serve.md) and the manifests write it, parses to the setting
it names (the environment is read by pydantic-settings; the formats are the service's own: comma
lists, on/off switches, choices in any case, ``tenant:key`` pairs, not JSON)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrl_service.config import NOT_FROM_ENV, Limits, env_variables, from_env, read_env

# variable -> (as an operator writes it, the Settings/Limits value it gives)
EVERY_VARIABLE = {
    "OPENRL_MODEL": ("/models/Qwen2.5-0.5B", "/models/Qwen2.5-0.5B"),
    "OPENRL_MODEL_NAME": ("qwen", "qwen"),
    "OPENRL_MODELS": ("tiny, wide=tiny-wide@cpu,", ["tiny", "wide=tiny-wide@cpu"]),
    "OPENRL_MEMORY_BUDGET_BYTES": ("8589934592", 8 << 30),
    "OPENRL_FULL_RUN_BUDGET_BYTES": ("1073741824", 1 << 30),
    "OPENRL_FULL_HOST_BUDGET_BYTES": ("0", 0),
    "OPENRL_MAX_STABILITY_RECORDS": ("1000", 1000),
    "OPENRL_MAX_STABILITY_BYTES": ("4096", 4096),
    "OPENRL_SAMPLE_BATCH_BYTES": ("268435456", 256 << 20),
    "OPENRL_HOST": ("0.0.0.0", "0.0.0.0"),
    "OPENRL_PORT": ("9000", 9000),
    "OPENRL_DATA_DIR": ("/data", Path("/data")),
    "OPENRL_API_KEYS": ("alice:tml-a, bob:tml-b", {"tml-a": "alice", "tml-b": "bob"}),
    "OPENRL_ALLOWED_HOSTS": ("openrl.example.org,localhost", ["openrl.example.org", "localhost"]),
    "OPENRL_DEVICE": ("cpu", "cpu"),
    "OPENRL_TORCH_THREADS": ("2", 2),
    "OPENRL_WORLD_SIZE": ("8", 8),
    "OPENRL_NNODES": ("2", 2),
    "OPENRL_NODE_RANK": ("1", 1),
    "OPENRL_MASTER_ADDR": ("openrl-leader.openrl", "openrl-leader.openrl"),
    "OPENRL_MASTER_PORT": ("29500", 29500),
    "OPENRL_DEVICES": ("cuda:0, cuda:1", ["cuda:0", "cuda:1"]),
    "OPENRL_GROUP_TIMEOUT_S": ("60", 60.0),
    "OPENRL_GROUP_MAX_RESTARTS": ("3", 3),
    "OPENRL_GROUP_LOG_COMMANDS": ("on", True),
    "OPENRL_VLLM_TP": ("2", 2),
    "OPENRL_SAMPLER_DEVICES": ("cuda:2,cuda:3", ["cuda:2", "cuda:3"]),
    "OPENRL_LONG_POLL_S": ("0.5", 0.5),
    "OPENRL_FUTURE_TTL_S": ("7200", 7200.0),
    "OPENRL_MAX_RESULT_BYTES": ("536870912", 1 << 29),
    "OPENRL_HEALTH_STALL_S": ("120", 120.0),
    "OPENRL_SEQ_GAP_TIMEOUT_S": ("2", 2.0),
    "OPENRL_MICROBATCH_TOKENS": ("8192", 8192),
    "OPENRL_FUSION": ("Off", False),
    "OPENRL_FUSION_MAX_TOKENS": ("4096", 4096),
    "OPENRL_BACKPRESSURE_RETRY_AFTER_S": ("1.5", 1.5),
    "OPENRL_MAX_SAMPLER_SNAPSHOTS": ("32", 32),
    "OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES": ("1073741824", 1 << 30),
    "OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT": ("8", 8),
    "OPENRL_MIN_TTL_S": ("60", 60.0),
    "OPENRL_SESSION_IDLE_TIMEOUT_S": ("600", 600.0),
    "OPENRL_DRAIN_GRACE_S": ("10", 10.0),
    "OPENRL_DURABILITY": ("NONE", "none"),
    "OPENRL_SNAPSHOT_INTERVAL_S": ("5", 5.0),
    "OPENRL_RECOVERY_SKIP_FAILED": ("yes", True),
    "OPENRL_SAMPLER": ("Torch", "torch"),
    "OPENRL_VLLM_GPU_MEMORY_UTILIZATION": ("0.4", 0.4),
    "OPENRL_VLLM_KV_CACHE_GB": ("2", 2.0),
    "OPENRL_VLLM_MAX_LORAS": ("8", 8),
    "OPENRL_VLLM_MAX_CPU_LORAS": ("32", 32),
    "OPENRL_VLLM_MAX_MODEL_LEN": ("2048", 2048),
    "OPENRL_HUB_API_URL": ("http://hub:8081/hub/api", "http://hub:8081/hub/api"),
    "OPENRL_HUB_SERVICE_NAME": ("rl", "rl"),
    "OPENRL_HUB_CACHE_TTL_S": ("30", 30.0),
    "OPENRL_MAX_KEYS_PER_USER": ("5", 5),
    "OPENRL_HUB_FAILED_LOOKUPS_PER_MIN": ("10", 10),
    "OPENRL_HUB_USER_RECHECK_S": ("15", 15.0),
    "OPENRL_MINTED_KEY_TTL_S": ("86400", 86400.0),
    "OPENRL_JOBS_NAMESPACE": ("openrl", "openrl"),
    "OPENRL_JOB_IMAGES": ("ghcr.io/x/job:1,ghcr.io/x/job:2", ["ghcr.io/x/job:1", "ghcr.io/x/job:2"]),
    "OPENRL_JOB_SERVICE_URL": ("http://svc:8000", "http://svc:8000"),
    "OPENRL_JOB_QUEUE": ("team-a", "team-a"),
    "OPENRL_JOB_VOLUMES_FILE": ("/etc/openrl/volumes.yaml", Path("/etc/openrl/volumes.yaml")),
    "OPENRL_JOB_MAX_CPU": ("500m", "500m"),
    "OPENRL_JOB_MAX_MEMORY": ("2Gi", "2Gi"),
    "OPENRL_JOB_BACKOFF_LIMIT": ("0", 0),
    "OPENRL_JOB_TTL_S": ("60", 60),
    "OPENRL_JOB_ACTIVE_DEADLINE_S": ("3600", 3600),
    "OPENRL_JOB_SERVICE_ACCOUNT": ("runner", "runner"),
    # the limits (openrl_service.config.Limits), whole numbers
    "OPENRL_MAX_BODY_BYTES": ("1048576", 1 << 20),
    "OPENRL_MAX_DATUMS": ("64", 64),
    "OPENRL_MAX_NUM_SAMPLES": ("16", 16),
    "OPENRL_MAX_TOKENS": ("256", 256),
    "OPENRL_MAX_RANK": ("64", 64),
    "OPENRL_MAX_RUNS_PER_TENANT": ("4", 4),
    "OPENRL_MAX_FULL_RUNS_PER_TENANT": ("2", 2),
    "OPENRL_MAX_SESSIONS_PER_TENANT": ("16", 16),
    "OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT": ("1073741824", 1 << 30),
    "OPENRL_MAX_TOPK": ("5", 5),
    "OPENRL_MAX_STOP_SEQUENCES": ("4", 4),
    "OPENRL_MAX_TARGET_K": ("8", 8),
    "OPENRL_MAX_REQUEST_TOKENS": ("65536", 65536),
    "OPENRL_MAX_METADATA_BYTES": ("1024", 1024),
    "OPENRL_MAX_METRIC_ROWS": ("1000", 1000),
    "OPENRL_MAX_JOB_PAYLOAD_BYTES": ("4096", 4096),
    "OPENRL_MAX_JOBS_PER_TENANT": ("3", 3),
    "OPENRL_MAX_JOB_PAYLOAD_TOTAL_BYTES": ("8192", 8192),
    "OPENRL_JOB_LOST_AFTER_S": ("120", 120),
    "OPENRL_MAX_QUEUED_PER_RUN": ("8", 8),
    "OPENRL_MAX_QUEUED_TOTAL": ("128", 128),
    "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT": ("3600", 3600.0),
    "OPENRL_DEVICE_SECONDS_WINDOW_S": ("86400", 86400.0),
}


def value_of(settings, name: str):
    return getattr(settings.limits, name) if hasattr(Limits(), name) else getattr(settings, name)


def test_every_variable_parses_in_its_documented_format():
    s = from_env({var: text for var, (text, _) in EVERY_VARIABLE.items()})
    for var, (text, expected) in EVERY_VARIABLE.items():
        name = var.removeprefix("OPENRL_").lower()
        got = value_of(s, name)
        assert got == expected and type(got) is type(expected), (var, text, got)


def test_the_table_above_names_every_variable_the_service_reads():
    """A setting added later gets a line above (and its format checked), or this fails."""
    assert env_variables() == set(EVERY_VARIABLE)
    read = read_env({var: text for var, (text, _) in EVERY_VARIABLE.items()})
    assert {f"OPENRL_{name.upper()}" for name in read} == set(EVERY_VARIABLE)


def test_unset_and_empty_variables_keep_the_defaults_and_others_are_ignored():
    plain = from_env({})
    s = from_env(
        {"OPENRL_PORT": "", "OPENRL_MODELS": "", "openrl_port": "1", "OPENRL_PORTS": "2", "PORT": "3"}
    )
    assert (s.port, s.models, s.limits) == (plain.port, plain.models, plain.limits) == (8000, [], Limits())


@pytest.mark.parametrize("name", NOT_FROM_ENV)
def test_switches_that_weaken_the_service_are_flags_only(name):
    """``OPENRL_NO_AUTH=1`` left in a shell must not open the service: --no-auth is a flag."""
    assert read_env({f"OPENRL_{name.upper()}": "1"}) == {}
    assert from_env({"OPENRL_NO_AUTH": "1", "OPENRL_INSECURE": "on"}).auth_enabled


def test_the_hub_token_is_read_only_where_a_hub_is_configured():
    env = {"JUPYTERHUB_API_TOKEN": " tok "}
    assert from_env(env).hub_api_token is None  # a kernel's token never becomes the service's
    assert from_env({**env, "OPENRL_HUB_API_URL": "http://hub:8081/hub/api"}).hub_api_token == "tok"


@pytest.mark.parametrize(
    "var, text, says",
    [
        ("OPENRL_PORT", "eighty", "OPENRL_PORT must be a whole number; got 'eighty'"),
        ("OPENRL_MAX_DATUMS", "1e3", "OPENRL_MAX_DATUMS must be a whole number; got '1e3'"),
        ("OPENRL_LONG_POLL_S", "soon", "OPENRL_LONG_POLL_S must be a number; got 'soon'"),
        ("OPENRL_FUSION", "maybe", "OPENRL_FUSION must be on or off; got 'maybe'"),
        ("OPENRL_SAMPLER", "fast", "OPENRL_SAMPLER must be one of auto, torch, vllm; got 'fast'"),
        ("OPENRL_DURABILITY", "disk", "OPENRL_DURABILITY must be one of journal, none; got 'disk'"),
        ("OPENRL_API_KEYS", "alice", "OPENRL_API_KEYS: entry 'alice'... must be 'tenant:key'"),
        ("OPENRL_API_KEYS", "alice:secret", "must start with 'tml-'"),
    ],
)
def test_a_value_in_the_wrong_format_names_the_variable(var, text, says):
    with pytest.raises(ValueError) as e:
        from_env({var: text})
    assert says in str(e.value)


def test_flags_override_the_environment():
    s = from_env({"OPENRL_PORT": "9000", "OPENRL_MAX_RANK": "8"}, port=9100, max_rank=16)
    assert (s.port, s.limits.max_rank) == (9100, 16)
