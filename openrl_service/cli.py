"""`openrl-service serve | export | make-tiny-model | stop | admin`: the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import uvicorn

from openrl_common.datadirs import SECRET_ENV, SECRET_NAME, lock_holder
from openrl_common.files import write_atomic
from openrl_service import cli_ping
from openrl_service import config as cfg
from openrl_service.checks import number
from openrl_service.group.comm import env_rank
from openrl_service.group.launch import add_arguments as add_group_arguments
from openrl_service.kube import KubeSettings, load_api_client
from openrl_service.server import DrainingServer, exit_when_stdin_closes
from openrl_service.storage.layout import LayoutError
from openrl_service.storage.lock import DataDirInUse, DataDirLock

EXIT_DATA_DIR_IN_USE = 3  # another process holds --data-dir


def _temporary_files_under(data_dir: Path) -> None:
    """Every temporary file of this process (ours and the libraries': tempfile, TMPDIR) goes to
    ``<data>/tmp``, never /tmp: in a pod /tmp is often a memory-backed volume that counts against the
    container's memory limit. What a killed predecessor left there is removed first (the data dir's
    lock is held: no other service uses it)."""
    tmp = data_dir / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)


def _serve(args: argparse.Namespace) -> int:

    try:
        settings = cfg.from_env(
            models=args.model,
            model_name=args.model_name,
            memory_budget_bytes=args.memory_budget_bytes,
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            api_keys_file=args.api_keys_file,
            no_auth=args.no_auth or None,
            insecure=args.insecure or None,
            device=args.device,
            fusion=None if args.fusion is None else args.fusion == "on",
            drain_grace_s=args.drain_grace_s,
            durability=args.durability,
            snapshot_interval_s=args.snapshot_interval_s,
            recovery_skip_failed=args.recovery_skip_failed or None,
            hub_api_url=args.hub_api_url,
            hub_service_name=args.hub_service_name,
            hub_cache_ttl_s=args.hub_cache_ttl_s,
            hub_failed_lookups_per_min=args.hub_failed_lookups_per_min,
            hub_user_recheck_s=args.hub_user_recheck_s,
            minted_key_ttl_s=args.minted_key_ttl_s,
            jobs_namespace=args.jobs_namespace,
            job_images=args.job_image,
            job_service_url=args.job_service_url,
            job_queue=args.job_queue,
            job_volumes_file=args.job_volumes_file,
            world_size=args.world_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            devices=cfg.comma_list(args.devices),
            sampler_devices=cfg.comma_list(args.sampler_devices),
            **{k: v for k, v in vars(args).items() if k == "sampler" or k.startswith("vllm_")},
        )
        if settings.sampler == "vllm":
            from openrl_service.sampling.factory import resolve_sampler

            resolve_sampler("vllm")  # vLLM missing: say so now, not after the model loads
        if settings.vllm_tp != 1 or settings.sampler_devices:
            from openrl_service.sampling.factory import resolve_sampler
            from openrl_service.sampling.parallel import check_layout

            check_layout(settings, resolve_sampler(settings.sampler))
        for name, flag_name, lo, hi in (  # each named by its flag and its variable (OPENRL_<NAME>)
            ("drain_grace_s", "--drain-grace-s", 0, 86400),
            ("snapshot_interval_s", "--snapshot-interval-s", 0, 86400),
            ("hub_cache_ttl_s", "--hub-cache-ttl-s", 0, 3600),
            ("hub_failed_lookups_per_min", "--hub-failed-lookups-per-min", 1, 1_000_000),
            ("hub_user_recheck_s", "--hub-user-recheck-s", 0, 3600),
            ("minted_key_ttl_s", "--minted-key-ttl-s", 1, 10 * 365 * 86400),
        ):
            number(
                getattr(settings, name), flag_name, lo, hi, setting=f"OPENRL_{name.upper()}", error=ValueError
            )
        if settings.hub_api_url and not settings.hub_api_url.startswith(("http://", "https://")):
            raise ValueError(
                f"--hub-api-url (OPENRL_HUB_API_URL) must be an http(s) URL such as "
                f"http://hub:8081/hub/api; got {settings.hub_api_url!r}"
            )
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", settings.hub_service_name or ""):
            raise ValueError(
                f"--hub-service-name (OPENRL_HUB_SERVICE_NAME) must be a hub service name; "
                f"got {settings.hub_service_name!r}"
            )
        if KubeSettings.from_settings(settings) is not None:  # bad job settings fail here, not at a submit
            load_api_client()
        models = settings.model_entries()  # a bad --model/OPENRL_MODELS entry fails here, not later
    except (ValueError, OSError) as e:
        print(f"openrl-service: {e}", file=sys.stderr)
        return 2
    if args.allowed_host:
        settings.allowed_hosts.extend(args.allowed_host)
    rank = env_rank()
    if rank is not None and rank > 0:  # one of a group's ranks, started by `serve --world-size N`
        from openrl_service.group.rank import follower_main

        return follower_main(settings)
    supervising = settings.world_size > 1 and rank is None
    if rank is None and (settings.world_size != 1 or settings.nnodes != 1 or settings.devices):
        from openrl_service.group.launch import layout

        try:
            layout(settings)
        except ValueError as e:
            print(f"openrl-service: {e}", file=sys.stderr)
            return 2
        if settings.world_size == 1 and settings.devices:  # one rank: its device is the model's
            settings.device = settings.devices[0]
    if supervising:
        from openrl_service.group.launch import supervise

        if settings.node_rank > 0:  # a node that serves no HTTP: its ranks follow node 0's rank 0
            return supervise(settings, _rank_argv(args), sock=None, url=None)
    if settings.no_auth and not settings.loopback:
        print(
            f"openrl-service: --no-auth only works on a loopback host (got --host {settings.host}); "
            "use --insecure to serve without keys on any interface",
            file=sys.stderr,
        )
        return 2
    host = settings.host
    if rank == 0:  # rank 0 of a group: the supervisor bound the port and holds the data dir
        settings.instance_secret = os.environ.pop(SECRET_ENV, None) or settings.instance_secret
        return _serve_app(
            args,
            settings,
            models,
            socket.socket(fileno=int(os.environ["OPENRL_GROUP_LISTEN_FD"])),
            os.environ["OPENRL_GROUP_URL"],
            None,
        )
    try:  # the port first: the lock never names a port this process does not hold (--port 0: any free)
        sock = listening_socket(host, settings.port)
    except OSError as e:
        holder = lock_holder(settings.data_dir)
        if holder is not None:  # most likely that service holds the port too: say who
            print(f"openrl-service: {DataDirInUse(settings.data_dir, holder)}", file=sys.stderr)
            return EXIT_DATA_DIR_IN_USE
        print(f"openrl-service: cannot listen on {host}:{settings.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    settings.port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{settings.port}"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:  # before anything is written there: one process owns a data dir
        lock = DataDirLock.acquire(settings.data_dir)
    except DataDirInUse as e:
        sock.close()
        print(f"openrl-service: {e}", file=sys.stderr)
        return EXIT_DATA_DIR_IN_USE
    # the start secret /readyz proves: the starting kernel's (not passed on to this process's children),
    # written before the lock names the URL, so a kernel that joins by the lock reads this one
    settings.instance_secret = os.environ.pop(SECRET_ENV, None) or settings.instance_secret
    write_atomic(settings.data_dir / SECRET_NAME, settings.instance_secret + "\n")  # 0600
    lock.announce(url)
    if args.report_fd is not None:
        _report(args.report_fd, url)
    if supervising:
        from openrl_service.group.launch import supervise

        os.environ[SECRET_ENV] = settings.instance_secret  # rank 0 proves the same secret
        try:
            return supervise(settings, _rank_argv(args), sock=sock, url=url)
        finally:
            lock.release()
    return _serve_app(args, settings, models, sock, url, lock)


def _rank_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "openrl_service.cli", *args.argv]


def _serve_app(args, settings, models, sock: socket.socket, url: str, lock) -> int:
    """Serve HTTP on ``sock`` until SIGTERM's drain ends (one device, or rank 0 of a group)."""
    from openrl_service.api.auth import ensure_generated_key
    from openrl_service.app import create_app

    host = settings.host
    _temporary_files_under(settings.data_dir)
    if settings.auth_enabled and settings.hub_api_url:
        print(
            f"openrl-service: JupyterHub users sign in with their hub token through {settings.hub_api_url} "
            f"(scope access:services!service={settings.hub_service_name}); API keys: {len(settings.api_keys)}",
            flush=True,
        )
        if settings.hub_api_token:
            print(
                "openrl-service: the service's own hub token ($JUPYTERHUB_API_TOKEN, scope read:users) "
                f"re-checks hub users' keys every {settings.hub_user_recheck_s:g} s "
                "(OPENRL_HUB_USER_RECHECK_S): a deleted user's keys stop working within that",
                flush=True,
            )
        else:
            print(
                "openrl-service: WARNING: the service has no hub token of its own ($JUPYTERHUB_API_TOKEN "
                "with scope read:users): keys minted by hub users are not re-checked against the hub, so "
                "a deleted user's keys work until they expire "
                f"(OPENRL_MINTED_KEY_TTL_S={settings.minted_key_ttl_s:g} s) and the keys of their jobs "
                "until the jobs end",
                flush=True,
            )
    elif settings.auth_enabled and not settings.api_keys:
        key, path, created = ensure_generated_key(settings.data_dir)
        settings.api_keys[key] = "default"
        # The Tinker SDK and a notebook's %openrl connect both read these two variables.
        here = re.sub(r"^http://(0\.0\.0\.0|\[::\])(:\d+)$", r"http://127.0.0.1\2", url)  # all interfaces
        if created:
            print(
                f"openrl-service: no API keys configured; created {path} (tenant 'default'). For the "
                "Tinker SDK and for a notebook (%openrl connect), in the shell that starts them:",
                flush=True,
            )
            print(f"export TINKER_BASE_URL={here}", flush=True)
            print(f"export TINKER_API_KEY={key}", flush=True)
        else:  # printed once, when created: logs of a long-running service reach more people
            print(
                f"openrl-service: no API keys configured; using the key in {path} (tenant 'default'); "
                "for the Tinker SDK and a notebook (%openrl connect): "
                f'export TINKER_BASE_URL={here} TINKER_API_KEY="$(cat {path})"',
                flush=True,
            )
    if not settings.auth_enabled:
        print(
            "openrl-service: authentication is OFF (--no-auth/--insecure): every caller is tenant 'default'",
            flush=True,
        )
    served = ", ".join(m.spec if m.name is None else f"{m.name}={m.spec}" for m in models)
    print(f"openrl-service: serving {served} on {url} (data in {settings.data_dir})", flush=True)
    try:
        app = create_app(settings)
    except LayoutError as e:  # an older release's data dir that cannot be moved without merging tenants
        if lock is not None:
            lock.release()
        print(f"openrl-service: {e}", file=sys.stderr)
        return 2
    if args.exit_with_parent:
        exit_when_stdin_closes()
    config = uvicorn.Config(
        app,
        host=host,
        port=settings.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=2,  # after the drain only SSE streams (ending) and stragglers are left
    )
    server = DrainingServer(config, app.state.lifecycle)
    try:
        server.run(sockets=[sock])
    finally:
        if lock is not None:
            lock.release()
    if app.state.service.engine.alive:
        # The drain gave up on an op still running on the device: exit now rather than let the
        # interpreter's teardown race the worker thread inside torch.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (port 0: one the kernel picks), as uvicorn
    binds its own (SO_REUSEADDR: a restart reuses its predecessor's port at once)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def _report(fd: int, url: str) -> None:
    """Tell the parent (``openrl_jupyter.local.start_service``) the bound URL, through the pipe it passed."""
    try:
        os.write(fd, json.dumps({"url": url, "pid": os.getpid()}).encode() + b"\n")
    except OSError as e:  # the parent is gone: it will not connect; serve on
        print(f"openrl-service: --report-fd {fd}: {e.strerror}", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _make_tiny(args: argparse.Namespace) -> int:
    from openrl_service.models.tiny import build_tiny_model, tree_digest

    out = build_tiny_model(args.dir)
    print(f"openrl/tiny written to {out} (sha256 {tree_digest(out)[:16]})")
    return 0


def _admin_target(data_dir: Path) -> tuple[str, str]:
    """The URL and admin key of the service running on ``data_dir``; SystemExit with a message if none."""
    try:
        lock = DataDirLock.acquire(data_dir)
    except DataDirInUse as e:
        url = e.holder.get("url")
    except OSError as e:
        raise SystemExit(
            f"openrl-service admin: no openrl-service data dir at {data_dir} ({e.strerror})"
        ) from None
    else:
        lock.release()
        raise SystemExit(
            f"openrl-service admin: no openrl-service is running on {data_dir}; start it (the admin command "
            "talks to the running service) or pass the --data-dir it uses"
        )
    if not url:
        raise SystemExit(
            f"openrl-service admin: the service on {data_dir} has not said its URL yet; try again"
        )
    url = re.sub(r"^http://(0\.0\.0\.0|\[::\]|)(:\d+)$", r"http://127.0.0.1\2", url)
    try:
        key = (data_dir / "admin-key").read_text().strip()
    except OSError as e:
        raise SystemExit(
            f"openrl-service admin: cannot read {data_dir / 'admin-key'} ({e.strerror}): run this as the "
            "user the service runs as"
        ) from None
    return url, key


def _stop(args: argparse.Namespace) -> int:
    from openrl_common.datadirs import local_data_dirs, stop_on

    if args.local and args.data_dir is not None:
        print("openrl-service stop: give --local or --data-dir, not both", file=sys.stderr)
        return 2
    folders = local_data_dirs() if args.local else [args.data_dir or cfg.from_env().data_dir]
    stopped = 0
    for folder in folders:
        pid = stop_on(folder, timeout_s=args.timeout)
        if pid is not None:
            stopped += 1
            print(f"openrl-service stop: stopped the service on {folder} (pid {pid}); its data stay there")
    if not stopped:
        where = (
            "any embedded service's folder (" + ", ".join(map(str, folders)) + ")"
            if args.local
            else folders[0]
        )
        print(f"openrl-service stop: no openrl-service is running on {where}", file=sys.stderr)
        return 1
    return 0


def _admin(args: argparse.Namespace) -> int:
    import json

    import httpx

    from openrl_service.api.admin import valid_tenant_argument

    if args.admin_cmd == "remove" and not valid_tenant_argument(args.tenant):
        print(
            f"openrl-service admin: {args.tenant!r} is not a tenant name (an API-key tenant, or hub:<user>)",
            file=sys.stderr,
        )
        return 2
    data_dir = Path(args.data_dir) if args.data_dir else cfg.from_env().data_dir
    url, key = _admin_target(data_dir)
    headers = {"X-API-Key": key}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=600, trust_env=False) as http:
            if args.admin_cmd == "tenants":
                r = http.get("/openrl/v1/admin/tenants")
            else:
                if not args.yes:
                    if not sys.stdin.isatty():
                        print(
                            "openrl-service admin: pass --yes to remove a tenant non-interactively",
                            file=sys.stderr,
                        )
                        return 2
                    answer = input(f"remove tenant {args.tenant!r} and all its data from {url}? [y/N] ")
                    if answer.strip().lower() not in ("y", "yes"):
                        print("nothing removed")
                        return 1
                r = http.delete(f"/openrl/v1/admin/tenants/{args.tenant}")
    except httpx.HTTPError as e:
        print(f"openrl-service admin: {url} did not answer ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    if r.status_code != 200:
        try:
            why = r.json().get("error", r.text)
        except ValueError:
            why = r.text
        print(f"openrl-service admin: {r.status_code}: {why}", file=sys.stderr)
        return 1
    body = r.json()
    if args.admin_cmd == "tenants":
        rows = body["tenants"]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        cols = ("tenant", "checkpoint_bytes", "live_sessions", "live_runs", "jobs", "minted_keys")
        cols += ("device_seconds",)  # in the device-time quota's window (the JSON has the rest)
        widths = [max([len(c)] + [len(str(row[c])) for row in rows]) for c in cols]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
        for row in rows:
            print("  ".join(str(row[c]).ljust(w) for c, w in zip(cols, widths, strict=True)))
        return 0
    print(
        f"removed tenant {body['tenant']}: {body['sessions_ended']} sessions ended, {body['checkpoint_bytes']} "
        f"checkpoint bytes deleted, {body['jobs_deleted']} jobs deleted, {body['keys_revoked']} minted keys revoked"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="openrl-service", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve a model over the Tinker API")
    s.add_argument(
        "--model",
        action="append",
        default=None,
        help="tiny (default), tiny-wide, a Hugging Face model folder, or a .gguf file; repeat to serve several "
        "(each SPEC or NAME=SPEC, optionally @DEVICE; the first is the default; OPENRL_MODELS)",
    )
    s.add_argument(
        "--memory-budget-bytes",
        type=int,
        default=None,
        help="bytes the models may take on each device (default: its free memory; OPENRL_MEMORY_BUDGET_BYTES)",
    )
    s.add_argument("--model-name", default=None, help="the name clients use for the model (default: derived)")
    s.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    s.add_argument(
        "--port", type=int, default=None, help="port (default 8000; 0: a free one, see --report-fd)"
    )
    s.add_argument(
        "--data-dir", type=Path, default=None, help="checkpoints, keys, models (~/.local/share/openrl/MODEL)"
    )
    s.add_argument("--api-keys-file", type=Path, default=None, help="lines of 'tenant key'")
    s.add_argument(
        "--hub-api-url",
        default=None,
        help="JupyterHub's API (e.g. http://hub:8081/hub/api): accept hub users' own tokens (OPENRL_HUB_API_URL)",
    )
    s.add_argument(
        "--hub-service-name",
        default=None,
        help="the hub service whose access scope a hub token needs (default openrl; OPENRL_HUB_SERVICE_NAME)",
    )
    s.add_argument(
        "--hub-cache-ttl-s",
        type=float,
        default=None,
        help="seconds a hub token's answer is reused (default 60; OPENRL_HUB_CACHE_TTL_S)",
    )
    s.add_argument(
        "--hub-user-recheck-s",
        type=float,
        default=None,
        help="with the service's own hub token ($JUPYTERHUB_API_TOKEN): seconds a hub user's existence "
        "is trusted before minted and job keys are checked again (default 60; OPENRL_HUB_USER_RECHECK_S)",
    )
    s.add_argument(
        "--minted-key-ttl-s",
        type=float,
        default=None,
        help="seconds a key minted by a hub user works (default 2592000, 30 days; OPENRL_MINTED_KEY_TTL_S)",
    )
    s.add_argument(
        "--hub-failed-lookups-per-min",
        type=int,
        default=None,
        help="hub tokens refused by the hub one client address may show a minute before it gets 429 "
        "(default 30; OPENRL_HUB_FAILED_LOOKUPS_PER_MIN)",
    )
    j = s.add_argument_group("Kubernetes jobs for detached runs (OPENRL_JOB*; see k8s/README.md)")
    j.add_argument(
        "--jobs-namespace",
        default=None,
        help="run detached runs as Jobs in this namespace, the service's own (OPENRL_JOBS_NAMESPACE)",
    )
    j.add_argument(
        "--job-image",
        action="append",
        default=None,
        help="an image jobs may run; repeat for several, the first is the default (OPENRL_JOB_IMAGES)",
    )
    j.add_argument(
        "--job-service-url",
        default=None,
        help="how job pods reach this service (default http://openrl-service.NAMESPACE.svc.cluster.local:8000)",
    )
    j.add_argument("--job-queue", default=None, help="a Kueue LocalQueue for the jobs (OPENRL_JOB_QUEUE)")
    j.add_argument(
        "--job-volumes-file",
        type=Path,
        default=None,
        help="YAML/JSON {name: {volume, mountPath, readOnly}}: the volumes a job may mount (OPENRL_JOB_VOLUMES_FILE)",
    )
    s.add_argument("--no-auth", action="store_true", help="no API keys (loopback hosts only)")
    s.add_argument(
        "--insecure", action="store_true", help="no API keys on any interface (trusted networks only)"
    )
    s.add_argument(
        "--allowed-host", action="append", default=[], help="extra Host header name to accept ('*': any)"
    )
    s.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    s.add_argument(
        "--fusion",
        choices=("on", "off"),
        default=None,
        help="run ready ops of several runs as one fused pass (default on; off: each run bit-identical to alone)",
    )
    s.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="on SIGTERM: seconds to finish accepted work before exiting (default 25; OPENRL_DRAIN_GRACE_S)",
    )
    s.add_argument(
        "--durability",
        choices=("journal", "none"),
        default=None,
        help="journal: what was acknowledged survives kill -9 (default); none: in memory only, a restart "
        "loses every run and result (OPENRL_DURABILITY)",
    )
    s.add_argument(
        "--snapshot-interval-s",
        type=float,
        default=None,
        help="snapshot the state and compact the journal this often when anything changed (default 30; "
        "0: only at shutdown; OPENRL_SNAPSHOT_INTERVAL_S)",
    )
    s.add_argument(
        "--recovery-skip-failed",
        action="store_true",
        help="start even if recovery meets journal records this release cannot replay, dropping them "
        "(listed in <data>/journal/unreplayed-*.json; their requests are lost). Without it such a "
        "start is refused and names them (OPENRL_RECOVERY_SKIP_FAILED)",
    )
    s.add_argument(
        "--sampler",
        choices=cfg.SAMPLERS,
        default=None,
        help="auto (default): vLLM where CUDA and vllm are installed, else torch (OPENRL_SAMPLER)",
    )
    add_group_arguments(s)
    v = s.add_argument_group("vLLM sampler (--sampler vllm/auto; OPENRL_VLLM_*)")
    v.add_argument("--vllm-gpu-memory-utilization", type=float, help="GPU memory fraction for vLLM (0.5)")
    v.add_argument("--vllm-kv-cache-gb", type=float, help="CPU: vLLM's KV cache in GiB (1)")
    v.add_argument("--vllm-max-loras", type=int, help="LoRA adapters in one vLLM batch (4)")
    v.add_argument("--vllm-max-cpu-loras", type=int, help="LoRA adapters kept loaded (16)")
    v.add_argument("--vllm-max-model-len", type=int, help="longest prompt + decode (model context)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.add_argument(
        "--report-fd",
        type=int,
        default=None,
        help="write the bound URL as a JSON line to this file descriptor once the port is bound and the "
        "data dir locked, then close it (a parent that started this process with --port 0)",
    )
    s.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when stdin closes (an embedded service whose parent process exited)",
    )
    s.set_defaults(func=_serve)
    e = sub.add_parser(
        "export",
        help="download a checkpoint as a PEFT adapter folder (or --merged, a Hugging Face model folder) "
        "from a running service (TINKER_BASE_URL, TINKER_API_KEY)",
    )
    from openrl_common import export as export_cmd

    export_cmd.add_arguments(e)
    e.set_defaults(func=export_cmd.run)
    cli_ping.register(sub)
    t = sub.add_parser("make-tiny-model", help="write the deterministic tiny model openrl/tiny to DIR")
    t.add_argument("dir", type=Path)
    t.set_defaults(func=_make_tiny)
    st = sub.add_parser(
        "stop",
        help="stop the service running on a data dir: it drains (finishes what it is doing) and exits",
    )
    st.add_argument(
        "--data-dir", type=Path, default=None, help="the data dir of the service to stop (default: serve's)"
    )
    st.add_argument(
        "--local",
        action="store_true",
        help="the notebook's embedded services (%%openrl connect --local), on their data dirs",
    )
    st.add_argument("--timeout", type=float, default=30.0, help="seconds to wait before killing it")
    st.set_defaults(func=_stop)
    a = sub.add_parser(
        "admin",
        help="the operator's view of a running service: list tenants, remove one (see docs/security.md)",
        description="Talks to the openrl-service running on --data-dir, with the admin key it wrote there "
        "(<data-dir>/admin-key): run it where the data dir is (e.g. kubectl exec into the service pod).",
    )
    a.add_argument(
        "--data-dir", type=Path, default=None, help="the running service's data dir (default: per-user)"
    )
    admin_sub = a.add_subparsers(dest="admin_cmd", required=True)
    at = admin_sub.add_parser(
        "tenants", help="every tenant and what it holds (checkpoint bytes, runs, jobs, keys)"
    )
    at.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ar = admin_sub.add_parser(
        "remove",
        help="end a tenant's sessions and delete its checkpoints, records, traces, jobs and minted keys",
    )
    ar.add_argument("tenant", help="an API-key tenant's name, or hub:<user> for a JupyterHub user")
    ar.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    a.set_defaults(func=_admin)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a group's ranks run the same command
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
