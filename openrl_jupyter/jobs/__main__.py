"""``python -m openrl_jupyter.jobs worker``: see :mod:`openrl_jupyter.jobs.worker`."""

import sys

from openrl_jupyter.jobs.worker import main

if __name__ == "__main__":
    sys.exit(main())
