"""A thin raw-HTTP Tinker client for tests that need control the SDK hides (seq_ids, retries)."""

from __future__ import annotations

import httpx
import numpy as np

from openrl_service.api import proto

DTYPES = {np.dtype(np.int64): proto.DTYPE_INT64, np.dtype(np.float32): proto.DTYPE_FLOAT32}


def fb_body(
    model_id: str,
    seq_id: int,
    datums: list[tuple[list[int], dict[str, np.ndarray]]],
    loss_fn: str = "cross_entropy",
    **fields,
) -> bytes:
    """A protobuf ForwardBackwardRequest; ``fields`` sets other request fields (e.g. forward_only)."""
    msg = proto.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, **fields)
    for tokens, inputs in datums:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        for name, arr in inputs.items():
            t = d.loss_fn_inputs[name]
            t.dtype = DTYPES[arr.dtype]
            t.dense = arr.tobytes()
            t.shape.extend(arr.shape)
    return msg.SerializeToString()


def sft_datum(prompt: list[int], completion: list[int]) -> tuple[list[int], dict[str, np.ndarray]]:
    seq = prompt + completion
    w = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return seq[:-1], {
        "target_tokens": np.array(seq[1:], dtype=np.int64),
        "weights": np.array(w, dtype=np.float32),
    }


def result(client: httpx.Client, request_id: str) -> dict:
    """Long-poll ``retrieve_future`` (JSON) until the future is done."""
    while True:
        r = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("type") != "try_again":
            return body


class RawTinker:
    def __init__(self, http: httpx.Client):
        self.http = http
        self.sessions: list[str] = []  # created here; finish_sessions() ends them

    def post(self, route: str, /, **body) -> httpx.Response:
        return self.http.post(f"/api/v1/{route}", json=body)

    def session(self) -> str:
        r = self.post("create_session")
        r.raise_for_status()
        self.sessions.append(r.json()["session_id"])
        return self.sessions[-1]

    def finish_sessions(self) -> None:
        """Finish every session this client created: their runs leave the tenant's live-run quota."""
        for sid in self.sessions:
            self.post(f"sessions/{sid}/finish", reason={"type": "success"})
        self.sessions.clear()

    def create_model(self, session_id: str, model_seq_id: int = 0, rank: int = 8, seed: int = 1) -> str:
        r = self.post(
            "create_model",
            session_id=session_id,
            model_seq_id=model_seq_id,
            base_model="openrl/tiny",
            lora_config={"rank": rank, "seed": seed},
        )
        r.raise_for_status()
        self.result(r.json()["request_id"])
        return r.json()["model_id"]

    def snapshot(self, model_id: str, seq: int) -> str:
        """save_weights_for_sampler without a name at seq_id ``seq``: a new sampler's id."""
        r = self.post(
            "save_weights_for_sampler",
            model_id=model_id,
            seq_id=seq,
            sampling_session_seq_id=seq,
            kind="snapshot",
        )
        assert r.status_code == 200, r.text
        return self.result(r.json()["request_id"])["sampling_session_id"]

    def submit_fb(self, model_id: str, seq_id: int, datums, loss_fn: str = "cross_entropy", **headers) -> str:
        r = self.http.post(
            "/api/v1/forward_backward",
            content=fb_body(model_id, seq_id, datums, loss_fn),
            headers={"Content-Type": "application/x-protobuf", **headers},
        )
        r.raise_for_status()
        return r.json()["request_id"]

    def submit_optim(self, model_id: str, seq_id: int, lr: float = 1e-3, **adam) -> str:
        r = self.post(
            "optim_step", model_id=model_id, seq_id=seq_id, adam_params={"learning_rate": lr, **adam}
        )
        r.raise_for_status()
        return r.json()["request_id"]

    def result(self, request_id: str) -> dict:
        return result(self.http, request_id)
