"""OpenAPI links: how one reply feeds the next request (``create_session`` → ``session_id`` →
``create_model``; ``create_model`` → ``model_id`` → ``optim_step``; a submit → ``request_id`` →
``retrieve_future``; ``POST /openrl/v1/runs`` → ``run_id`` → ``/runs/{run_id}/...``; a job's id →
its routes), so a stateful client (schemathesis, ``make fuzz``) walks real sessions, runs,
samplers, checkpoints and jobs. Each route names its links with ``responses=`` (operation ids are
``<router>_<handler name>``, see :func:`openrl_service.api.schemas.operation_ids`).
"""

from __future__ import annotations

from openrl_service.api.schemas import HELLO_B64, HELLO_SHA256


def links(status: int, **targets: dict) -> dict:
    """``responses`` of a route whose ``status`` reply feeds the ``targets`` (name → link object)."""
    return {status: {"description": "Successful Response", "links": targets}}


def to(
    operation_id: str,
    *,
    parameters: dict | None = None,
    request_body: dict | None = None,
    exact: bool = False,
) -> dict:
    """A link; ``exact``: the request body is ``request_body`` itself (schemathesis would otherwise
    merge it into a generated one, appending generated items to its lists)."""
    link: dict = {"operationId": operation_id}
    if parameters:
        link["parameters"] = parameters
    if request_body:
        link["requestBody"] = request_body
    if exact:
        link["x-schemathesis"] = {"merge_body": False}
    return link


def _result() -> dict:
    """A submit's future → retrieve_future."""
    return to("tinker_retrieve_future", request_body={"request_id": "$response.body#/request_id"})


def _checkpoint_ops(run_id: str, kind: str, name: str) -> dict:
    """A saved checkpoint → the REST routes on it (delete last: links are tried in any order)."""
    at = {"path.run_id": run_id, "path.kind": kind, "path.name": name}
    return {
        f"{op}_{kind}": to(f"rest_{op}", parameters=at)
        for op in ("publish", "unpublish", "set_ttl", "external_urls", "delete_checkpoint")
    }


def _on_model(model_id: str) -> dict:
    """A run's id → the Tinker ops on it and the REST views of it."""
    body = {"model_id": model_id}
    ops = (
        "optim_step",
        "save_weights",
        "save_weights_external",
        "save_for_sampler",
        "get_info",
        "load_weights",
    )
    return {
        **{op: to(f"tinker_{op}", request_body=body) for op in ops},
        "training_run": to("rest_get_training_run", parameters={"path.run_id": model_id}),
        "run_checkpoints": to("rest_list_checkpoints", parameters={"path.run_id": model_id}),
    }


def _on_session(session_id: str) -> dict:
    body = {"session_id": session_id}
    path = {"path.session_id": session_id}
    return {
        "create_model": to("tinker_create_model", request_body=body),
        "create_sampling_session": to("tinker_create_sampling_session", request_body=body),
        "heartbeat": to("tinker_heartbeat", request_body=body),
        "session": to("rest_get_session", parameters=path),
        "assign_project": to("rest_assign_project", parameters=path),
        "trace_export": to("rest_trace_export", parameters=path),
        "finish": to("tinker_finish", parameters=path),
    }


CREATE_SESSION_LINKS = links(200, **_on_session("$response.body#/session_id"))
CREATE_MODEL_LINKS = links(200, result=_result(), **_on_model("$response.body#/model_id"))
SUBMIT_LINKS = links(200, result=_result())
SAVE_WEIGHTS_LINKS = links(
    200,
    result=_result(),
    weights_info=to(
        "rest_weights_info",
        request_body={"tinker_path": "tinker://{$request.body#/model_id}/weights/{$request.body#/path}"},
    ),
    load_weights=to(
        "tinker_load_weights",
        request_body={
            "model_id": "$request.body#/model_id",
            "path": "tinker://{$request.body#/model_id}/weights/{$request.body#/path}",
        },
    ),
    **_checkpoint_ops("$request.body#/model_id", "weights", "$request.body#/path"),
)
SAVE_FOR_SAMPLER_LINKS = links(
    200,
    result=_result(),
    sampler=to("tinker_get_sampler", parameters={"path.sampler_id": "$response.body#/sampling_session_id"}),
    asample=to("tinker_asample", request_body={"sampling_session_id": "$response.body#/sampling_session_id"}),
)
SAMPLING_SESSION_LINKS = links(
    200,
    sampler=to("tinker_get_sampler", parameters={"path.sampler_id": "$response.body#/sampling_session_id"}),
    asample=to("tinker_asample", request_body={"sampling_session_id": "$response.body#/sampling_session_id"}),
)
RESULT_LINKS = links(
    200,
    # a finished save_weights / save_weights_for_sampler / load_weights answers its checkpoint's path
    weights_info=to("rest_weights_info", request_body={"tinker_path": "$response.body#/path"}),
    optim_step=to("tinker_optim_step", request_body={"model_id": "$response.body#/model_id"}),
)


def _on_run(run_id: str) -> dict:
    at = {"path.run_id": run_id}
    ops = (
        "get_run",
        "heartbeat",
        "sample",
        "save",
        "checkpoints",
        "add_metrics",
        "get_metrics",
        "delete_run",
    )
    return {op: to(f"native_{op}", parameters=at) for op in ops} | {
        "training_run": to("rest_get_training_run", parameters=at)
    }


CREATE_RUN_LINKS = links(201, **_on_run("$response.body#/run_id"))
NATIVE_SAMPLE_LINKS = links(
    200,
    train_step=to(
        "native_train_step",
        parameters={"path.run_id": "$request.path.run_id"},
        request_body={"samples": [{"sample_id": "$response.body#/samples/0/sample_id", "advantage": 1.0}]},
        exact=True,
    ),
    sample_again=to("native_sample", parameters={"path.run_id": "$request.path.run_id"}),
)
NATIVE_SAVE_LINKS = links(
    201,
    weights_info=to("rest_weights_info", request_body={"tinker_path": "$response.body#/path"}),
    **_checkpoint_ops("$request.path.run_id", "weights", "$request.body#/name"),
)


def _on_job(job_id: str) -> dict:
    at = {"path.job_id": job_id}
    ops = ("get_job", "job_state", "job_control", "payloads", "delete_job")
    return {op: to(f"jobs_{op}", parameters=at) for op in ops} | {
        "add_payload": to(
            "jobs_add_payload",
            parameters=at,
            request_body={"payload": HELLO_B64, "payload_sha256": HELLO_SHA256},
            exact=True,
        )
    }


SUBMIT_JOB_LINKS = links(201, **_on_job("$response.body#/job_id"))
