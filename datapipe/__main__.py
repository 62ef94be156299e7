"""``python -m datapipe``: the ``datapipe`` command."""

from .cli import main

raise SystemExit(main())
