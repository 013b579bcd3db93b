"""The ``openrl-service`` command: ``export`` runs with the notebook side's light dependencies (httpx; no
torch, no uvicorn), so a hub user's image can export; everything else is :mod:`openrl_service.cli`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        from openrl_common.export import main as export

        return export(argv[1:])
    from openrl_service.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
