"""The service's parts, built once by ``create_app`` and handed to the routers that use them.

    TrainingService   the engine: sessions, runs, samplers, the device worker, the journal
    Jobs              detached jobs, their payloads and keys (engine/jobs.py)
    NativeRuns        the notebook API's runs, samples, control and events (engine/native.py)
    KubeLauncher      Kubernetes Jobs for detached runs (kube.py); None without --jobs-namespace

Each part gets what it needs from here, explicitly: no router sets attributes on the service for
another one to read, so the order routers are built in does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from openrl_service.config import Settings
from openrl_service.engine.jobs import Jobs
from openrl_service.engine.native import NativeRuns
from openrl_service.engine.service import TrainingService
from openrl_service.kube import KubeLauncher, launcher_from_settings


@dataclass
class Container:
    service: TrainingService
    jobs: Jobs
    native: NativeRuns
    kube: KubeLauncher | None

    @classmethod
    def build(cls, settings: Settings, service: TrainingService | None = None) -> Container:
        svc = service or TrainingService(settings)
        jobs = Jobs(settings.data_dir, settings.limits, svc.runs)
        c = cls(svc, jobs, NativeRuns(svc, jobs), launcher_from_settings(settings))
        jobs.kube_status = c.kube_status  # the housekeeping round reconciles Kubernetes Jobs too
        svc.sweepers.append(jobs.sweep)
        return c

    def kube_status(self, job_name: str) -> dict:
        """The Kubernetes Job's status ({} without a launcher)."""
        return self.kube.status(job_name) if self.kube is not None else {}
