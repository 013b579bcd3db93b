"""A user's client process for the tokenizer mirror (run by test_tokenizer_mirror.py, in either venv).

    HF_ENDPOINT=http://127.0.0.1:PORT HF_TOKEN=tml-... HF_HOME=<empty> python hub_client.py URL MODEL

Standalone on purpose (the cookbook venv has no openrl_service). Prints one JSON line of findings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def failure(fn) -> str | None:
    """None if ``fn`` succeeded, else the exception chain: each type and message, outermost first."""
    try:
        fn()
    except Exception as e:  # report whatever the client raises
        parts, seen = [], set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            parts.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        return " <- ".join(parts)
    return None


def summary(tok) -> dict:
    return {
        "class": type(tok).__name__,
        "len": len(tok),
        "encode": tok.encode("Hi!", add_special_tokens=False),
        "decode": tok.decode([72, 105, 33, 258]),
        "eos": tok.eos_token,
        "pad": tok.pad_token,
        "chat": tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        ),
    }


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    import huggingface_hub
    import tinker
    import transformers
    from transformers import AutoTokenizer

    out: dict = {"hub": huggingface_hub.__version__, "transformers": transformers.__version__}
    endpoint = huggingface_hub.constants.ENDPOINT  # read at import: HF_ENDPOINT took effect
    assert endpoint == url, endpoint
    out["wrong_key"] = failure(lambda: AutoTokenizer.from_pretrained(model, token="tml-wrong-key-0000"))
    out["no_key"] = failure(lambda: AutoTokenizer.from_pretrained(model, token=False))
    out["unknown_repo"] = failure(lambda: AutoTokenizer.from_pretrained("openrl/no-such-model"))
    out["weights"] = failure(lambda: huggingface_hub.hf_hub_download(model, "model.safetensors"))
    out["auto"] = summary(AutoTokenizer.from_pretrained(model))

    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model=model, rank=8).result()
    out["training_client"] = summary(tc.get_tokenizer())
    sampler = tc.save_weights_and_get_sampling_client().result()
    out["sampling_client"] = summary(sampler.get_tokenizer())
    out["base_sampling_client"] = summary(
        sc.create_sampling_client(base_model=model).result().get_tokenizer()
    )
    sc.close("success").result()

    hub_cache = Path(os.environ["HF_HOME"]) / "hub"
    out["cached"] = sorted(p.name for p in hub_cache.rglob("*") if p.is_file() and "snapshots" in p.parts)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
