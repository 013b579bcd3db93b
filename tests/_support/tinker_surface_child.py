"""The part of the Tinker surface suite that needs a fresh process (run by tinker_surface.py).

    HF_ENDPOINT=<service> HF_TOKEN=<key> HF_HOME=<empty> TINKER_API_KEY=<key> \
        python tests/_support/tinker_surface_child.py '{"url": ..., "handle": ..., ...}'

``SamplingClient.from_sampler_handle`` is meant for another process; ``get_tokenizer`` reads
HF_ENDPOINT when huggingface_hub is first imported, so the caller sets it (and an empty HF_HOME)
before this process starts. Prints one JSON line: ``{check: {"ok", "value", "error"}}``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
import warnings
from pathlib import Path

warnings.simplefilter("ignore")


def observe_tokenizer(tok) -> dict:
    return {
        "len": len(tok),
        "encode_hi": tok.encode("Hi", add_special_tokens=False),
        "decode": tok.decode(list(b"Hello, world")),
        "specials": tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]),
        "chat": tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False),
    }


def forget_hub_cache() -> None:
    """Each get_tokenizer must fetch from the mirror, not from the previous call's cache."""
    shutil.rmtree(Path(os.environ["HF_HOME"]) / "hub", ignore_errors=True)
    from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info

    _load_tokenizer_from_model_info.cache_clear()


def main() -> None:
    arg = json.loads(sys.argv[1])
    import tinker
    from tinker import types

    out: dict[str, dict] = {}

    def attempt(name, fn):
        try:
            out[name] = {"ok": True, "value": fn()}
        except BaseException:  # noqa: BLE001 - reported to the parent
            out[name] = {"ok": False, "error": traceback.format_exc(limit=8)}

    def from_handle():
        s = tinker.SamplingClient.from_sampler_handle(arg["handle"])
        greedy = s.sample(
            types.ModelInput.from_ints(arg["prompt"]), 1, types.SamplingParams(max_tokens=8, temperature=0.0)
        ).result(timeout=60)
        lps = s.compute_logprobs(types.ModelInput.from_ints(arg["fp_seq"])).result(timeout=60)
        return {"base_model": s.get_base_model(), "greedy": greedy.sequences[0].tokens, "logprobs": lps[1:]}

    def sampler_tokenizer():
        forget_hub_cache()
        s = tinker.SamplingClient.from_sampler_handle(arg["handle"])
        return observe_tokenizer(s.get_tokenizer())

    def training_tokenizer():
        forget_hub_cache()
        sc = tinker.ServiceClient(base_url=arg["url"])
        try:
            tc = sc.create_lora_training_client(arg["model"], rank=4).result(timeout=60)
            return observe_tokenizer(tc.get_tokenizer())
        finally:
            sc.close("success").result(timeout=30)

    attempt("SamplingClient.from_sampler_handle", from_handle)
    attempt("SamplingClient.get_tokenizer", sampler_tokenizer)
    attempt("TrainingClient.get_tokenizer", training_tokenizer)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
