"""An in-process Kubernetes API for tests: kmock's emulator on loopback, served from its own thread
(the `kubernetes` client is synchronous), plus what the API server does that the service relies on.

    api = KubeAPI()                      # api.url, api.client (a kubernetes ApiClient)
    KubeLauncher(settings, api_client=api.client).submit(...)
    api.objects("jobs")                  # what was created, by name
    api.calls()                          # (apiGroup, plural, verb, query) of every request
    command, env = pod_command_and_env(api, job_name, tmp_path)   # run the Job's container here
    api.close()

kmock stores what it is sent and runs no controllers (no scheduler, no garbage collector, no
admission); the emulator gives every created object a uid, as the API server does (owner
references point at it), and refuses the creates named in ``api.emu.refuse`` with a 403.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import uuid
from pathlib import Path

import kmock
import kubernetes

VERBS = {
    "CREATE": "create",
    "FETCH": "get",
    "LIST": "list",
    "WATCH": "watch",
    "UPDATE": "patch",
    "DELETE": "delete",
}


class Emulator(kmock.KubernetesEmulator):
    """kmock plus what the API server does that the launcher relies on: a uid on create, and a
    refusal (403) of the creates named in ``refuse`` (plural resource names)."""

    refuse: set[str] = set()

    async def _handle(self, request):
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            plural = request.resource.plural
            if plural in self.refuse:
                raise kmock.KubernetesError(
                    status=403,
                    reason="Forbidden",
                    message=f'{plural} is forbidden: User "system:serviceaccount:openrl:openrl-service" cannot create',
                )
            request.data.setdefault("metadata", {})["uid"] = str(uuid.uuid4())
        return await super()._handle(request)


class KubeAPI:
    """The emulator served on loopback from a thread of its own (the kubernetes client is sync)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(started),))
        self.thread.daemon = True
        self.thread.start()
        assert started.wait(30), "kmock did not start"
        config = kubernetes.client.Configuration()
        config.host = self.url
        self.client = kubernetes.client.ApiClient(config)

    async def _serve(self, started: threading.Event) -> None:
        self.stop = asyncio.Event()
        async with Emulator() as emu, kmock.Server(emu) as server:
            emu.resources.load_bundled()
            emu.refuse = set()
            self.emu, self.url = emu, str(server.url).rstrip("/")
            started.set()
            await self.stop.wait()

    def close(self) -> None:
        self.client.close()
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)

    def objects(self, plural: str | None = None) -> dict[str, dict]:
        """Live objects by name (of one resource, or all as "plural/name")."""
        out = {}
        for (res, _, name), obj in self.emu.objects.items():
            if not obj.deleted and (plural is None or res.plural == plural):
                out[name if plural else f"{res.plural}/{name}"] = obj.raw
        return out

    def calls(self) -> list[tuple[str, str, str, dict]]:
        """(apiGroup, plural, verb, query) of every resource request the launcher made."""
        return [
            (r.resource.group, r.resource.plural, VERBS[r.action.name], dict(r.params))
            for r in self.emu._requests
            if r.resource is not None and r.action is not None
        ]


def pod_command_and_env(api: KubeAPI, job_name: str, folder: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment the Job's container would get, resolved here: plain values,
    secretKeyRef values read from the stored Secret, and configMap volumes written under ``folder``
    (paths in the environment that point into a configMap mount are rewritten to the copy)."""
    job = api.objects("jobs")[job_name]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        source = volumes[m["name"]].get("configMap")
        if source is None:
            continue
        local = folder / m["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, text in api.objects("configmaps")[source["name"]].get("data", {}).items():
            (local / key).write_text(text)
        mounts[m["mountPath"].rstrip("/") + "/"] = str(local) + "/"
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            value = e["value"]
            for mount, local in mounts.items():
                if value.startswith(mount):
                    value = local + value[len(mount) :]
            env[e["name"]] = value
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            data = api.objects("secrets")[ref["name"]]["data"][ref["key"]]
            env[e["name"]] = base64.b64decode(data).decode()
    return list(container.get("command", [])) + list(container.get("args", [])), env
