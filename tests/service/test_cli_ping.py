"""`openrl-service ping`: a wrong URL is named within its few seconds of tries (the Tinker SDK retries
one for minutes, silently), a right one with a wrong key says the key is refused, and a right pair
says what the service serves."""

from __future__ import annotations

import re

from openrl_service.cli import main
from tests.conftest import ALICE_KEY, TINY, free_port


def test_ping_names_a_url_where_nothing_answers(capsys, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TINKER_BASE_URL", dead)
    assert main(["ping", "--within", "1"]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"nothing answers at {dead}: tried GET {dead}/readyz \d+ times over \d+\.\d s", err), (
        err
    )
    assert "Connection refused" in err and "`openrl-service serve` prints the URL and key" in err


def test_ping_says_whether_the_service_takes_the_key(server, capsys, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-wrong-0123456789")
    assert main(["ping"]) == 1
    err = capsys.readouterr().err
    assert f"{server.url} answers, but refuses the key (401): wrong API key" in err, err
    monkeypatch.setenv("TINKER_API_KEY", ALICE_KEY)
    assert main(["ping"]) == 0
    out = capsys.readouterr().out
    assert f"an openrl service answers at {server.url} (ready); it serves {TINY}" in out, out


def test_ping_without_a_url_says_where_it_looks(capsys, monkeypatch):
    for name in ("TINKER_BASE_URL", "OPENRL_URL"):
        monkeypatch.delenv(name, raising=False)
    assert main(["ping"]) == 2
    assert "pass --base-url or set TINKER_BASE_URL" in capsys.readouterr().err
