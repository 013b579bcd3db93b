"""A sample for a sampler whose save_weights_for_sampler is accepted but not run yet waits for it
(after a kill -9 the replayed save can still be queued when the client's next sample arrives)."""

from tests._support.raw import RawTinker, sft_datum
from tests.conftest import ALICE_KEY, BOB_KEY

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]}


def test_a_sample_sent_before_its_snapshot_has_run_waits_for_it(server):
    with server.client(ALICE_KEY) as http:
        raw = RawTinker(http)
        sid = raw.session()
        model = raw.create_model(sid)
        data = [sft_datum(list(range(10, 70)), list(range(70, 130)))] * 8
        for seq in range(1, 13):  # training queued in the run's lane ahead of the save
            raw.submit_fb(model, seq, data)
        save = raw.post(
            "save_weights_for_sampler", model_id=model, seq_id=13, sampling_session_seq_id=13, kind="snapshot"
        )
        assert save.status_code == 200, save.text
        sampler_id = f"{sid}:sample:13"
        assert sampler_id not in server.service.samplers  # accepted, not run: it is still queued
        with server.client(BOB_KEY) as other:  # another tenant's sample of that id is not held up
            assert (
                other.post(
                    "/api/v1/asample",
                    json={"sampling_session_id": sampler_id, "num_samples": 1, "prompt": PROMPT},
                ).status_code
                == 404
            )
        got = raw.post("asample", sampling_session_id=sampler_id, num_samples=1, prompt=PROMPT)
        assert got.status_code == 200, got.text  # before: 404 unknown sampling_session_id
        assert raw.result(got.json()["request_id"])["sequences"]
        assert raw.result(save.json()["request_id"])["sampling_session_id"] == sampler_id
        raw.finish_sessions()


def test_a_sample_of_a_sampler_nobody_saves_is_still_a_404_at_once(server):
    with server.client(ALICE_KEY) as http:
        r = http.post(
            "/api/v1/asample",
            json={"sampling_session_id": "nope:sample:1", "num_samples": 1, "prompt": PROMPT},
        )
    assert r.status_code == 404 and "unknown sampling_session_id" in r.text
