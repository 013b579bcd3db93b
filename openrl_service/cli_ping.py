"""``openrl-service ping``: say within seconds whether a service answers at a URL and takes a key.

The Tinker SDK and its ``tinker`` CLI retry a URL nothing answers at for about five minutes, silently
(tinker 0.38: no setting bounds it); run this first to learn in seconds that the URL is wrong."""

from __future__ import annotations

import argparse
import os
import sys
import time

WITHIN_S = 5.0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ping`` to the ``openrl-service`` command's subcommands."""
    p = sub.add_parser("ping", help="say within seconds whether a service answers at a URL and takes its key")
    p.add_argument(
        "--base-url", default=None, help="the service's URL (default: $TINKER_BASE_URL, then $OPENRL_URL)"
    )
    p.add_argument("--within", type=float, default=WITHIN_S, help="seconds to keep trying (default 5)")
    p.set_defaults(func=run)


def reach(url: str, within_s: float) -> tuple[int | None, str]:
    """(HTTP status of GET /readyz, or None, and what was tried): refused connections are tried again
    every half second until ``within_s`` has passed."""
    import httpx

    start, tries, last = time.monotonic(), 0, ""
    with httpx.Client(timeout=within_s) as http:
        while True:
            tries += 1
            try:
                status = http.get(
                    f"{url}/readyz", timeout=max(0.5, within_s - (time.monotonic() - start))
                ).status_code
                return status, ""
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if time.monotonic() - start + 0.5 >= within_s:
                break
            time.sleep(0.5)
    waited = time.monotonic() - start
    return None, f"tried GET {url}/readyz {tries} time{'s' if tries > 1 else ''} over {waited:.1f} s ({last})"


def run(args: argparse.Namespace) -> int:
    import httpx

    url = (args.base_url or os.environ.get("TINKER_BASE_URL") or os.environ.get("OPENRL_URL") or "").rstrip(
        "/"
    )
    if not url:
        print("openrl-service ping: no URL: pass --base-url or set TINKER_BASE_URL", file=sys.stderr)
        return 2
    status, tried = reach(url, args.within)
    if status is None:
        print(
            f"openrl-service ping: nothing answers at {url}: {tried}. Check the URL, or start a service "
            "there: `openrl-service serve` prints the URL and key to export",
            file=sys.stderr,
        )
        return 1
    key = (
        os.environ.get("TINKER_API_KEY")
        if url == (os.environ.get("TINKER_BASE_URL") or "").rstrip("/")
        else None
    )
    key = key or os.environ.get("OPENRL_TOKEN")
    headers = {"X-API-Key": key} if key else {}
    r = httpx.get(f"{url}/api/v1/get_server_capabilities", headers=headers, timeout=args.within)
    if r.status_code in (401, 403):
        try:
            why = r.json().get("error", r.text)
        except ValueError:
            why = r.text
        print(
            f"openrl-service ping: {url} answers, but refuses the key ({r.status_code}): {why}",
            file=sys.stderr,
        )
        return 1
    if r.status_code != 200:
        print(
            f"openrl-service ping: something answers at {url} (GET /readyz: {status}), but not as an openrl "
            f"service (GET /api/v1/get_server_capabilities: {r.status_code})",
            file=sys.stderr,
        )
        return 1
    models = ", ".join(m.get("model_name", "?") for m in r.json().get("supported_models", []))
    state = "ready" if status == 200 else f"readyz {status}"
    print(
        f"openrl-service ping: an openrl service answers at {url} ({state}); it serves {models or 'no model'}"
    )
    return 0
