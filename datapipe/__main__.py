"""``python -m datapipe``: the ``datapipe`` command."""

if __name__ == "__main__":  # the build's LocalCluster re-imports the main module in its workers: only run as one
    from datapipe.cli import main

    raise SystemExit(main())
