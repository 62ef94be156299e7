"""Decode one file in a process of its own: ``python -m datapipe.probe PATH SPEC_JSON``.

Used when a shard's task has killed its Dask worker: the build then decodes that shard's files one
by one in separate processes, so the file that crashes the decoder (or never finishes) is
quarantined with a reason instead of killing workers again. The file is read as the build reads it
(regular files only, bounded in size and time). Exit 0: decodes; exit 3: the quarantine entry's
``error`` and ``reason`` as JSON on stdout.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from .bounded import Watchdog, max_file_bytes, read_file, warm_up
    from .codecs import DecodeSpec, decode_sample
    from .errors import DecodeError, unreadable

    path, spec = argv[0], DecodeSpec(**json.loads(argv[1]))

    def timed_out(_path: str, timeout: float) -> str:  # the same limit as in the build, reported as its entry
        return json.dumps({"error": "timeout", "reason": f"reading and decoding did not finish within {timeout:g} s "
                                                         "(DATAPIPE_FILE_TIMEOUT; isolated after its shard killed a worker)"})

    warm_up()
    try:
        with Watchdog(timed_out, 3, fd=sys.stdout.fileno()) as watchdog:
            watchdog.watch(path)
            decode_sample(read_file(path, max_file_bytes(spec.max_pixels)), spec)
    except DecodeError as exc:
        print(json.dumps({"error": exc.kind, "reason": str(exc)}))
        return 3
    except OSError as exc:
        print(json.dumps(unreadable(exc)))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
