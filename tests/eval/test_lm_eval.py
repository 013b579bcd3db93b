"""lm-evaluation-harness (0.4.13, in .venv-eval: its own venv, offline) scores a checkpoint through the
OpenAI-compatible endpoint, and its score equals the project's own scorer on the same greedy outputs.

The task is generated here (eight questions in a local JSON file); the checkpoint memorised half of
the answers, so a harness that saw other outputs than the service's (another model, the base, a
different prompt) would score differently and the comparison can fail."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, TINY

ROOT = Path(__file__).parents[2]
LM_EVAL = Path(os.environ.get("OPENRL_LM_EVAL", ROOT / ".venv-eval" / "bin" / "lm_eval"))
QA = [
    ("sky=", "blue"), ("grass=", "green"), ("snow=", "white"), ("coal=", "black"),
    ("blood=", "red"), ("sun=", "yellow"), ("rose=", "pink"), ("sea=", "teal"),
]  # fmt: skip
LEARNT = QA[:4]

pytestmark = pytest.mark.skipif(
    not LM_EVAL.exists(),
    reason=f"no lm-eval at {LM_EVAL} (make venv builds .venv-eval with lm-eval[api]==0.4.13)",
)


@pytest.fixture(scope="module")
def half_memorised(server):
    """A sampler checkpoint that answers the first four questions and not the last four."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=4).result()
    data = []
    for q, a in LEARNT:
        seq = list(f"{q}{a}\n".encode())
        weights = [0.0] * (len(q) - 1) + [1.0] * (len(seq) - len(q))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
            )
        )
    for _ in range(80):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    path = tc.save_weights_for_sampler("half").result().path
    yield path, sc.create_sampling_client(model_path=path)
    sc.close("success").result()


def own_score(sampler) -> tuple[float, list[str]]:
    """The project's scorer: greedy Tinker sampling, the text up to the first newline, exact match."""
    outputs = []
    for q, _ in QA:
        out = sampler.sample(
            types.ModelInput.from_ints(list(q.encode())),
            1,
            types.SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]),
        ).result()
        text = bytes(t for t in out.sequences[0].tokens if t < 256).decode("utf-8", "replace")
        outputs.append(text.split("\n")[0])
    return sum(o == a for o, (_, a) in zip(outputs, QA, strict=True)) / len(QA), outputs


def test_lm_eval_scores_a_checkpoint_through_the_openai_endpoint_as_the_project_does(
    server, half_memorised, tmp_path
):
    path, sampler = half_memorised
    mine, outputs = own_score(sampler)
    assert 0 < mine < 1, outputs  # some right, some wrong: the comparison below can fail
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QA))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "openrl_toy_qa.yaml").write_text(
        "task: openrl_toy_qa\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    out = tmp_path / "out"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "TINKER_"))},
        "OPENAI_API_KEY": ALICE_KEY,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
    }
    argv = [
        str(LM_EVAL), "--model", "local-completions",
        "--model_args", f"model={path},base_url={server.url}/v1/completions,tokenizer_backend=none,max_retries=1",
        "--tasks", "openrl_toy_qa", "--include_path", str(tasks),
        "--output_path", str(out), "--log_samples", "--batch_size", "1",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    score = json.loads(results.read_text())["results"]["openrl_toy_qa"]["exact_match,none"]
    (samples,) = out.rglob("samples_openrl_toy_qa_*.jsonl")
    harness_outputs = {
        json.loads(line)["doc"]["question"]: json.loads(line)["filtered_resps"][0]
        for line in samples.read_text().splitlines()
    }
    assert harness_outputs == {q: o for (q, _), o in zip(QA, outputs, strict=True)}
    assert score == pytest.approx(mine)
