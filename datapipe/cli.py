"""The ``datapipe`` command: build, info, verify, bench, demo, sample — a thin layer over the library."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .environment import environment
from .errors import DatapipeError, describe_quarantine, thread_start_failed
from .text import message_text, plain_where_unencodable, plural, printable

if TYPE_CHECKING:
    from types import FrameType

    import numpy as np

    from .records import Manifest, ReportRecord

__all__ = ["environment", "main"]


def _whole_number(text: str, least: int, need: str) -> int:
    """``text`` as an int of at least ``least``; argparse prints the message after the flag's name."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1, "a positive integer")


def _path(text: str) -> str:
    """A path argument: an empty one (an unset shell variable) would be the working folder, never what was meant."""
    if not text:
        raise argparse.ArgumentTypeError("is empty (an unset variable?); give a path: \"\" would be the working folder")
    return text


def _nonnegative_int(text: str) -> int:
    return _whole_number(text, 0, "a whole number >= 0")


def _check_build_args(args: argparse.Namespace) -> None:
    """Ranges argparse's types do not express, checked before anything starts; the message names the flag.
    (The sample format's ranges are checked by BuildSpec, whose messages name the flags too.)"""
    from .errors import ArgumentError

    if not 0.0 <= args.max_bad_fraction <= 1.0:
        raise ArgumentError(f"--max-bad-fraction must be a share from 0 to 1, got {args.max_bad_fraction:g}")


def _storage_option_flag(parser: argparse.ArgumentParser) -> None:
    from .remote import TEXT_WORDS

    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the object store's fsspec filesystem for s3:// (gs://, az://) URLs, e.g. "
                             "endpoint_url=http://minio:9000 or client_kwargs.region_name=eu-west-1 (repeatable). "
                             "A credential, name or URL is taken as the text given, digits too: a key whose last part "
                             f"has one of the words {', '.join(sorted(TEXT_WORDS))} (as a word, split at _ and case: "
                             "region_name, aws_access_key_id, sessionToken); other values are JSON when they parse "
                             "(numbers, true/false, null, {...}), else text. An option the filesystem does not take is "
                             "refused. Credentials also come from AWS_* variables")


def _storage_options(args: argparse.Namespace, *locations: str | None) -> dict | None:
    """The --storage-option flags as a dict (None when none was given); refused when none of
    ``locations`` (the command's paths and URLs) is in object storage: they would do nothing."""
    from .errors import ArgumentError
    from .remote import is_url, local_path, parse_storage_options

    if not args.storage_option:
        return None
    if not any(where is not None and is_url(local_path(where)) for where in locations):
        raise ArgumentError("--storage-option: for s3:// (gs://, az://) URLs only; "
                            f"{' and '.join(str(w) for w in locations if w is not None)} "
                            f"{'is' if sum(w is not None for w in locations) == 1 else 'are'} local, so leave it out")
    return parse_storage_options(args.storage_option)



def _command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand that accepts full option names only (a renamed option must not live on as a prefix)."""
    return sub.add_parser(name, allow_abbrev=False, **kwargs)


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="datapipe", description="Decode images once on Dask; stream them at memory speed.",
                                allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"datapipe {__version__}", help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND --help for its options)")

    b = _command(sub, "build", help="decode a folder of images (or a CSV list) into a sharded cache")
    b.add_argument("source", type=_path, help="folder of class folders (ImageNet layout) or a CSV of path,label; either may "
                                  "be an s3:// (gs://, az://) URL")
    b.add_argument("output", type=_path, help="cache folder to write (a rerun resumes or is a no-op), or an s3:// (gs://, az://) URL")
    _storage_option_flag(b)
    b.add_argument("--size", type=_positive_int, default=256,
                   help="side of the square samples, or the shorter side with --fit short, 8 to 8192 (default 256)")
    b.add_argument("--fit", choices=("crop", "pad", "stretch", "short"), default="crop",
                   help="crop: shorter side to SIZE then center crop (default); pad: letterbox on white; stretch; "
                        "short: shorter side to SIZE keeping the aspect, the longer cut to --max-aspect x SIZE")
    b.add_argument("--max-aspect", type=float, default=2.0,
                   help="with --fit short: the longest side a sample keeps, as a multiple of SIZE, 1 to 8 (default 2)")
    b.add_argument("--encoding", choices=("raw", "jpeg"), default="raw",
                   help="raw: pixels, read in place (default); jpeg: encoded once (4:2:0), ~1/10 of the bytes, "
                        "decoded by the loader")
    b.add_argument("--quality", type=int, default=90, help="JPEG quality with --encoding jpeg, 1 to 100 (default 90)")
    b.add_argument("--shard-size", type=_positive_int, default=None,
                   help="samples per shard (default: ~100 MB shards; for jpeg, counting a sample as 1/8 of its raw bytes)")
    b.add_argument("--workers", type=_positive_int, default=None, help="LocalCluster worker processes (default: one per core)")
    b.add_argument("--scheduler", default=None,
                   help="address of an existing Dask scheduler (tcp://host:8786), or 'sync' to build serially")
    b.add_argument("--max-bad-fraction", type=float, default=0.01,
                   help="fail when more than this share of files is quarantined (default 0.01)")
    b.add_argument("--max-pixels", type=_positive_int, default=100_000_000,
                   help="quarantine images whose header claims more pixels (default 100,000,000)")
    b.add_argument("--force", action="store_true",
                   help="rebuild an output built with another configuration or source; with the same ones, read "
                        "again the files an earlier build quarantined for a reason their bytes do not decide "
                        "(timeouts, unreadable files, decoder crashes)")
    b.add_argument("--classes-from", type=_path, default=None, metavar="CACHE_OR_FILE",
                   help="label with this class list instead of the source's own: a datapipe cache's (folder or URL; "
                        "e.g. the training cache, for a validation set missing some classes) or a text file of "
                        "one class name per line; every class of the source must be in it")
    b.add_argument("--verify", action="store_true",
                   help="check every finished shard's checksum before keeping it (rebuilds damaged shards)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")

    i = _command(sub, "info", help="describe a cache, or the environment with --env")
    i.add_argument("cache", nargs="?", type=_path, help="cache folder, or the s3:// (gs://, az://) URL of one")
    i.add_argument("--env", action="store_true", help="print the active decoders and library versions")
    _storage_option_flag(i)

    v = _command(sub, "verify", help="check every shard's size and checksum against the manifest")
    v.add_argument("cache", type=_path, help="cache folder, or the s3:// (gs://, az://) URL of one")
    _storage_option_flag(v)

    s = _command(sub, "sample", help="generate an ImageNet-like sample image folder")
    s.add_argument("output", type=_path, help="folder to write (new or empty; a rerun with the same options completes it)")
    s.add_argument("--images", type=_positive_int, default=2000, help="number of images (default 2000)")
    s.add_argument("--classes", type=_positive_int, default=10, help="number of class folders (default 10)")
    s.add_argument("--seed", type=_nonnegative_int, default=0,
                   help="a whole number >= 0; the output is a pure function of the options and this (default 0)")

    d = _command(sub, "demo", help="generate a sample dataset, build it on a LocalCluster, read it back, bench it")
    d.add_argument("--dir", type=_path, default="datapipe-demo", help="working folder (default ./datapipe-demo)")
    d.add_argument("--images", type=_positive_int, default=2000,
                   help="sample images to generate, at least 10 (the sample's classes) (default 2000)")
    d.add_argument("--workers", type=_positive_int, default=None, help="LocalCluster worker processes (default: one per core)")
    d.add_argument("--skip-bench", action="store_true", help="stop after reading the cache back")

    k = _command(sub, "bench", help="measure the loader stage by stage and against other loaders")
    k.add_argument("cache", type=_path, help="cache folder written by `datapipe build`")
    k.add_argument("--also", nargs="+", action="extend", default=[], metavar="CACHE",
                   help="more caches (the same source built with another --encoding or --fit), each measured as one "
                        "more datapipe system in the same rounds")
    k.add_argument("--source", type=_path, default=None, help="the source image folder, for the peers that read it")
    k.add_argument("--against", default="", help="comma-separated peers: dataloader,webdataset,litdata,streaming or 'all'")
    k.add_argument("--batch-size", type=_positive_int, default=256, help="samples per batch for every system (default 256)")
    k.add_argument("--workers", type=_positive_int, default=2, help="loader workers for every system (default 2)")
    k.add_argument("--repeats", type=_positive_int, default=3, help="measured repetitions per system (default 3)")
    k.add_argument("--batches", type=_positive_int, default=None,
                   help="batches per measurement (default: one epoch, at most 40)")
    k.add_argument("--crop", type=_positive_int, default=224, help="augmentation output size (default 224)")
    k.add_argument("--step-ms", type=float, default=0.0,
                   help="also run a synthetic model step of this many ms and report the share spent waiting")
    k.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    k.add_argument("--work-dir", type=_path, default=None,
                   help="where peers write their shards, each in a folder of its own that datapipe marks as its "
                        "(default: CACHE-bench-work beside the cache); not inside the cache or the source. A peer's "
                        "folder that datapipe did not write is refused, never deleted")
    k.add_argument("--json", default=None, help="write the results as JSON to this file (checked before anything runs)")
    k.add_argument("--plot", default=None,
                   help="write a chart to this file: .png (added where the name has no suffix), .svg, .pdf, ... "
                        "(checked before anything runs)")
    k.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the command stops the way Ctrl-C stops it."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def _ignore_signals_at_exit() -> None:
    """The first handler at exit (the last registered): SIGTERM and SIGINT are ignored from here on (CPython puts
    back the default action of the signals it handles, killing the process, but leaves ignored ones as they are)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    restore = plain_where_unencodable(sys.stdout, sys.stderr)  # before --help, which is typeset too
    if argv is None:  # the command line's entry point: the process ends with the command
        return _main(argv)
    disabled = logging.root.manager.disable  # what _quiet() changes
    try:  # called from a program: its streams and logging are given back as they were
        return _main(argv)
    finally:
        restore()
        logging.disable(disabled)


def _main(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except ModuleNotFoundError as exc:  # the parser's own imports (numpy, for one)
        print(_missing_dependency(exc, "datapipe"), file=sys.stderr)
        return 2
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    with _messages_to_stderr():
        try:
            status = _COMMANDS[args.command](args)
            if threading.current_thread() is threading.main_thread():
                # done, and said so: a SIGTERM or Ctrl-C during the interpreter's exit (Dask's clean-up takes a
                # moment) neither kills the process by the signal nor says a finished build was terminated. As the
                # command line's entry point (no argv) from now on; called from a program, only once it exits.
                if argv is None:
                    _ignore_signals_at_exit()
                else:
                    atexit.register(_ignore_signals_at_exit)
            return status
        except DatapipeError as exc:  # a user's mistake or the machine's state; anything else is a bug
            if argv is None:  # the process ends with this line: nothing from a library's shutdown after it
                _quiet()
            print(f"datapipe {args.command}: error: {exc.line()}", file=sys.stderr)
            return getattr(exc, "exit_code", 2)
        except KeyboardInterrupt as exc:
            _quiet()
            what = "terminated" if isinstance(exc, Terminated) else "interrupted"
            then = "; finished shards are kept, rerun to resume" if args.command == "build" else ""
            print(f"\ndatapipe {args.command}: {what}{then}", file=sys.stderr, flush=True)
            return 143 if isinstance(exc, Terminated) else 130
        except BrokenPipeError:
            gone = [stream for stream in (sys.stdout, sys.stderr) if _reader_gone(stream)]
            if not gone:  # a connection's, not the output's: a failure to show
                raise
            # what read the output went away (`datapipe info CACHE | head`, `datapipe build SRC OUT 2>&1 | head -1`):
            # stop quietly, as a pipe's writer does
            for stream in gone:
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # nothing left to flush at exit
            return 141
        except ModuleNotFoundError as exc:
            print(_missing_dependency(exc, f"datapipe {args.command}"), file=sys.stderr)
            return 2
        except RuntimeError as exc:  # a library's thread that could not start (datapipe's own say so themselves)
            failed = thread_start_failed(exc)
            if failed is None:
                raise
            print(f"datapipe {args.command}: error: {failed}", file=sys.stderr, flush=True)
            if argv is None:  # the libraries' exit handlers fail too (zarr's joins the thread that never started)
                _quiet()
                atexit.register(_stderr_closed)  # run before theirs, registered earlier
            return 1
        except OSError as exc:  # the machine's state (a permission, a disk) where no message of ours says it: one line
            where = f"{message_text(str(exc.filename))}: " if exc.filename else ""
            print(f"datapipe {args.command}: error: {where}{exc.strerror or exc} ({type(exc).__name__}); check the "
                  "path, its permissions and its disk, and rerun", file=sys.stderr)
            return 1


# The modules of datapipe's dependencies (pyproject.toml's) -> the distribution that installs each
_REQUIRED = {"torch": "torch", "kornia": "kornia", "numpy": "numpy", "dask": "dask", "distributed": "distributed",
             "bokeh": "bokeh", "zarr": "zarr", "PIL": "Pillow", "simplejpeg": "simplejpeg", "tqdm": "tqdm",
             "google_crc32c": "google-crc32c"}


def _missing_dependency(exc: ModuleNotFoundError, command: str) -> str:
    """The one line for one of datapipe's own dependencies missing (installed with --no-deps, or removed since);
    ``exc`` itself is raised again when it is about another module (a bug, or an extra's: each says so itself)."""
    dist = _REQUIRED.get((exc.name or "").split(".")[0])
    if dist is None:
        raise exc
    how = " (the build for this machine: https://pytorch.org/get-started)" if dist == "torch" else ""
    return (f"{command}: error: it needs {dist}, one of datapipe's dependencies, which is not installed in this Python "
            f"({sys.executable}): pip install {dist}{how}")


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` (standard output or error) is a pipe whose reader has gone (poll reports an error on its
    write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll here
        return False


class _Stderr(logging.Handler):
    """Writes each message as it is, to whatever ``sys.stderr`` is at the time."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never end the command
            self.handleError(record)


@contextlib.contextmanager
def _messages_to_stderr() -> Iterator[None]:
    """The library's ``datapipe`` logger, shown on stderr as plain lines while a command runs."""
    logger = logging.getLogger("datapipe")
    level, handler = logger.level, _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _stderr_closed() -> None:
    """Nothing more on standard error from here to the process's end."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def _quiet() -> None:
    """After Ctrl-C, SIGTERM or an error the one line the command prints is all the user needs: nothing more from
    the loggers of the libraries still shutting down (Dask's cluster) or from interpreter exit. main() switches
    logging back on for a program that called it."""
    logging.disable(logging.CRITICAL)


def _build(args: argparse.Namespace) -> int:
    from . import remote
    from .builder import BuildSpec, Cluster, build

    _check_build_args(args)
    storage_options = _storage_options(args, args.source, args.output, args.classes_from)
    classes = None if args.classes_from is None else _classes_from(args.classes_from, storage_options)
    if not any(remote.is_url(remote.local_path(where)) for where in (args.source, args.output)):
        storage_options = None  # for --classes-from only
    spec = BuildSpec(size=args.size, fit=args.fit, max_pixels=args.max_pixels, shard_size=args.shard_size,
                     max_aspect=args.max_aspect, encoding=args.encoding, quality=args.quality, classes=classes)
    build(args.source, args.output, spec, cluster=Cluster(workers=args.workers, scheduler=args.scheduler),
          max_bad_fraction=args.max_bad_fraction, force=args.force, verify=args.verify, progress=not args.quiet,
          storage_options=storage_options)
    return 0


# First lines of a class list that are more likely a column's name than a class (a header written by pandas).
_HEADER_WORDS = frozenset({"class", "classes", "class_name", "classname", "label", "labels", "name", "names",
                           "category", "categories"})


def _classes_from(where: str, storage_options: dict | None) -> tuple[str, ...]:
    """The class list of ``--classes-from``: a cache's (its manifest's, local or in a store) or a text file's."""
    from pathlib import Path

    from .errors import ArgumentError
    from .remote import is_url, local_path

    where = local_path(where)
    if is_url(where):
        from . import remote
        from .errors import CacheError

        loc = remote.open_location(where, storage_options, timeout=remote.store_timeout())
        try:
            return remote.read_manifest(loc).classes
        except CacheError as no_cache:  # perhaps a text object of class names
            folder, _, name = where.rstrip("/").rpartition("/")
            data = remote.read_bytes(remote.open_location(folder, storage_options, timeout=remote.store_timeout()),
                                     name, 64 << 20) if name else None
            if data is None:
                raise no_cache from None
        try:
            text = data.decode("utf-8-sig")  # a byte-order mark (Notepad, Excel) is not part of the first name
        except UnicodeDecodeError as exc:
            raise ArgumentError(f"--classes-from {where}: neither a cache nor a UTF-8 text object of class names "
                                f"({exc})") from None
    else:
        path = Path(where).expanduser()
        if path.is_dir():
            from .errors import CacheError
            from .manifest import read_manifest

            try:
                return read_manifest(path).classes
            except CacheError as exc:  # a source folder, or a cache not finished: the class list is a cache's
                raise ArgumentError(f"--classes-from {where}: {exc} (--classes-from takes the training cache, the "
                                    "output of its finished datapipe build, or a text file of class names, one per "
                                    "line)") from None
        try:
            text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise ArgumentError(f"--classes-from {where}: cannot be read as a cache folder or a UTF-8 text file of "
                                f"class names ({getattr(exc, 'strerror', None) or exc})") from None
    if text.lstrip().startswith(("{", "[")):  # a name may begin with one ("[unlabelled]"): JSON only if it parses
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, (dict, list)):
            raise ArgumentError(f"--classes-from {where}: a JSON document, not a class list; pass the cache folder "
                                "(for its manifest), or a text file of class names, one per line")
    # one name a line; a line "#" or beginning with "# " is a comment (a name kept from it would be class 0 and every
    # label one too high); "#1" is a name, as a class folder may be called
    names = [line.strip() for line in text.splitlines()
             if line.strip() and line.strip() != "#" and not line.strip().startswith("# ")]
    if not names:
        raise ArgumentError(f"--classes-from {where}: holds no class name; write one per line")
    if names[0].lower() in _HEADER_WORDS:
        import logging

        logging.getLogger("datapipe.build").warning(
            f"datapipe build: the first class of --classes-from {where} is {names[0]!r}, which looks like a header; "
            "a class list has none: if it is one, remove it (every label would be one too high)")
    seen: set[str] = set()
    for number, name in enumerate(names, start=1):
        if name in seen:
            raise ArgumentError(f"--classes-from {where}: names class {name!r} more than once (again as name "
                                f"{number:,}); each class name must be given once")
        seen.add(name)
    return tuple(names)


def _info(args: argparse.Namespace) -> int:
    if args.env or not args.cache:
        print(json.dumps(environment(), indent=1))
        if not args.cache:
            return 0
    from .remote import is_url, local_path

    args.cache = local_path(args.cache)  # a file:// URL is the folder it names
    if is_url(args.cache):
        return _remote_info(args)
    _storage_options(args, args.cache)  # refused for a folder
    from .cache import Cache
    from .records import read_report

    cache = Cache(args.cache)
    report = read_report(cache.root)  # checked before anything is printed
    m = cache.manifest
    shapes, stored = cache.shapes, cache.sample_nbytes  # an indexed cache's sample indexes are read (and checked) here
    if cache.fixed_shape is not None:
        shape = f"{cache.fixed_shape}"
    else:
        lo, hi = cache.shape_range
        shape = (f"height {lo[0]} to {hi[0]}, width {lo[1]} to {hi[1]} (shorter side {cache.size}, aspect kept)"
                 if (lo[0], lo[1]) != (hi[0], hi[1]) else f"{lo[0]}x{lo[1]} (shorter side {cache.size}, aspect kept)")
    _print_summary(m, str(cache.root), shape=shape, shards=len(cache.counts), report=report,
                   report_at=str(cache.root / "report.json"), where="on disk", stored=(shapes, stored))
    return 0


def _print_summary(m: Manifest, location: str, *, shape: str, shards: int, report: ReportRecord | None, report_at: str,
                   where: str, stored: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """What ``datapipe info`` prints of a cache, local or in object storage (``stored``: the shapes and
    stored sizes of every sample, when the sample indexes were read)."""
    print(f"cache      {message_text(location)}")
    print(f"format     {m.format} v{m.version} (config {m.config_hash}{', build ' + m.build_id if m.build_id else ''})")
    print(f"samples    {m.num_samples:,} of shape {shape} uint8 in {plural(shards, 'shard')}")
    restart = m.config.get("restart_interval")
    markers = ("no restart markers: a crop decodes every row above it" if not restart
               else "a restart marker after every MCU" if restart == 1 else f"a restart marker every {restart} MCUs")
    quality = f" (quality {m.config.get('quality')}, {markers})" if m.encoding == "jpeg" else ""
    print(f"encoding   {m.encoding}{quality}")
    print(f"layout     {m.layout} ({'one sample every S*S*3 bytes' if m.layout == 'fixed' else 'per-shard sample index'})")
    if stored is not None:
        shapes, nbytes = stored
        raw_bytes = float((shapes[:, 0] * shapes[:, 1] * 3).mean()) if len(shapes) else 0.0
        mean = float(nbytes.mean()) if len(nbytes) else 0.0
        print(f"stored     {mean:,.0f} bytes/sample mean ({mean / max(raw_bytes, 1.0):.0%} of the raw pixels)")
    first = m.classes[:8]  # quoted when a name would blur the list: a comma, an edge space, an empty or quoted name
    quote = any(not name or name != name.strip() or "," in name or name[0] in "'\"" for name in first)
    names = ", ".join(printable(json.dumps(name, ensure_ascii=False) if quote else name) for name in first)
    print(f"classes    {len(m.classes)}: {names}{' …' if len(m.classes) > 8 else ''}")
    shown_config = dict(m.config)
    if isinstance(shown_config.get("classes"), list):  # a class list given to the build: the classes line shows it
        shown_config["classes"] = f"<{plural(len(shown_config['classes']), 'name')}>"
    print(f"config     {printable(json.dumps(shown_config, ensure_ascii=False))}")
    print(f"source     {message_text(str(m.source.root))} ({message_text(m.source.kind)})")
    print(f"{where:<10} {m.nbytes / 2**20:,.1f} MiB ({m.nbytes / max(m.num_samples, 1) / 1024:,.1f} KiB/sample)")
    if report is not None:
        work = (f"{report.images_per_second:,.0f} img/s on {plural(report.workers, 'worker')}"
                if report.shards_built != 0 else "no shard built")
        print(f"last build {printable(report.status)}: {describe_quarantine(report.quarantined)}, {work} "
              f"(every file and reason: {message_text(report_at)})")


def _remote_info(args: argparse.Namespace) -> int:
    """``datapipe info URL``: what the manifest and report of a cache in object storage say (no shard is read)."""

    from . import remote
    from .records import parse_report

    loc = remote.open_location(args.cache, _storage_options(args, args.cache), timeout=remote.store_timeout())
    m = remote.read_manifest(loc)
    with remote.store_errors(loc, "read report.json"):
        doc = remote.read_doc(loc, "report.json")
    report = parse_report(doc, loc.url_of("report.json")) if doc is not None else None
    shape = f"{m.fixed_shape}" if m.fixed_shape is not None else f"shorter side {m.size}, aspect kept"
    _print_summary(m, loc.url, shape=shape, shards=len(m.shards), report=report,
                   report_at=loc.url_of("report.json"), where="in store")
    return 0


def _remote_verify(args: argparse.Namespace) -> int:
    """``datapipe verify URL``: every object of a cache in object storage checked by streaming it."""
    from . import remote

    loc = remote.open_location(args.cache, _storage_options(args, args.cache), timeout=remote.store_timeout())
    manifest = remote.read_manifest(loc)
    return _verdict(remote.verify(loc, manifest), loc.url, len(manifest.shards), manifest.num_samples, output=loc.url)


def _verify(args: argparse.Namespace) -> int:
    from .remote import is_url, local_path

    args.cache = local_path(args.cache)  # a file:// URL is the folder it names
    if is_url(args.cache):
        return _remote_verify(args)
    _storage_options(args, args.cache)  # refused for a folder
    from .cache import Cache

    # every shard's size is checked by verify itself, which names each one that is wrong (the open names the first)
    cache = Cache(args.cache, check_sizes=False)
    problems = cache.verify(progress=True)
    if cache.node_cache_of is not None:
        for line in problems:
            print(message_text(line))
        verdict = "OK" if not problems else plural(len(problems), "problem")
        print(f"{message_text(str(cache.root))}: the node-local cache of {message_text(str(cache.node_cache_of))}: "
              f"{cache.verified_shards} of "
              f"{plural(len(cache.counts), 'shard')} downloaded, checked against the manifest: {verdict} "
              f"(`datapipe verify {cache.node_cache_of}` checks the cache itself)")
        return 0 if not problems else 1
    return _verdict(problems, str(cache.root), len(cache.counts), cache.num_samples, output="OUTPUT")


def _verdict(problems: list[str], where: str, shards: int, samples: int, *, output: str) -> int:
    """Print what ``datapipe verify`` found and return its exit status (1 when anything is wrong)."""
    for line in problems:
        print(message_text(line))
    from .errors import PERMISSION_ADVICE
    from .shards import MOVE_AWAY

    refused = sum(PERMISSION_ADVICE in line for line in problems)
    moved = sum(MOVE_AWAY in line for line in problems)
    fix = f"`datapipe build SOURCE {output} --verify` rewrites damaged shards"
    if moved:  # shards no build can tell to be its own: they are moved away first
        fix = (f"move the shard folders named away; then {fix}" if moved < len(problems) - refused else
               f"move the shard folders named away; then `datapipe build SOURCE {output}` rewrites them")
    if refused:  # a file that cannot be read is no damage: fixing its permissions is all it takes
        fix = ("fix the permissions of the files named" if refused == len(problems) else
               f"fix the permissions of the files named; {fix}")
    verdict = "OK" if not problems else f"{plural(len(problems), 'problem')}; {fix}"
    print(f"{message_text(where)}: {plural(shards, 'shard')}, {plural(samples, 'sample')}: {verdict}")
    return 0 if not problems else 1


def _require(extra: str, command: str, *modules: str) -> None:
    """Refuse a command whose optional libraries are missing with one line naming the extra to install."""
    import importlib.util

    from .errors import MissingExtraError

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"`datapipe {command}` needs {', '.join(missing)}, which is not installed: "
                                f"pip install 'datapipe[{extra}]'")


def _sample(args: argparse.Namespace) -> int:
    _require("sample", "sample", "skimage")
    from .bench.sample import make_sample_dataset, sample_is_complete

    params = {"images": args.images, "classes": args.classes, "seed": args.seed}
    if sample_is_complete(args.output, **params):
        print(f"{message_text(str(args.output))} already holds this sample ({plural(args.images, 'image')} in "
              f"{plural(args.classes, 'class', 'classes')}, "
              f"seed {args.seed}): nothing to do")
        return 0
    root = make_sample_dataset(args.output, **params)
    print(f"wrote {plural(args.images, 'image')} in {plural(args.classes, 'class', 'classes')} to {message_text(str(root))}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    _require("bench", "demo", "skimage", "psutil")
    from .bench.demo import check_demo_args, run_demo

    check_demo_args(images=args.images, workers=args.workers)  # before anything is written
    with _loaders_stop_quietly():
        run_demo(args.dir, images=args.images, workers=args.workers, bench=not args.skip_bench)
    return 0


def _bench(args: argparse.Namespace) -> int:
    _require("bench", "bench", "psutil", *(["matplotlib"] if args.plot else []))
    from .bench.harness import BenchSpec, chart_path, check_output_file, format_table, plot, run
    from .files import atomic_write_text

    spec = BenchSpec(batch_size=args.batch_size, workers=args.workers, crop=args.crop, batches=args.batches,
                     device=args.device, repeats=args.repeats, step_ms=args.step_ms)  # checks every flag
    # The result files are checked before anything is measured: a bench takes minutes.
    json_out = check_output_file("--json", args.json) if args.json is not None else None
    plot_out = check_output_file("--plot", chart_path(args.plot) if args.plot else "") if args.plot is not None else None
    if json_out is not None and plot_out is not None and json_out.absolute() == plot_out.absolute():
        from .errors import ArgumentError

        raise ArgumentError(f"--json and --plot name the same file ({json_out}): the chart would overwrite the "
                            "results; give each its own")
    against = [a.strip() for a in args.against.split(",") if a.strip()]
    with _loaders_stop_quietly():
        result = run(args.cache, spec, source=args.source, against=against, work_dir=args.work_dir,
                     progress=not args.quiet, also=args.also)
    unwritten = None
    if json_out is not None:  # first: the figures are kept whatever showing them meets (a closed pipe, an encoding)
        try:
            with _writing("--json", str(json_out)):
                atomic_write_text(json_out.resolve(), json.dumps(result.to_dict(), indent=1))  # through a link
        except DatapipeError as exc:  # a full disk: the figures are shown all the same, then the error
            unwritten = exc
    print(format_table(result))
    if json_out is not None and unwritten is None:
        print(f"wrote {message_text(str(json_out))}")
    if plot_out is not None:
        try:
            with _writing("--plot", str(plot_out)):
                written = plot(result, plot_out)
            print(f"wrote {message_text(str(written))}")
        except DatapipeError as exc:
            if unwritten is None:
                raise
            unwritten = type(unwritten)(f"{unwritten.args[0]}; and {exc.args[0]}")  # both files in the one line
    if unwritten is not None:
        raise unwritten
    failed = [s.name for s in result.systems.values() if s.status == "failed"]
    if failed:
        print(f"datapipe bench: {plural(len(failed), 'system')} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _child_exited(signum: int, frame: FrameType | None) -> None:
    """SIGCHLD while the command stops: a worker process ended, as it was told to; nothing to report."""


@contextlib.contextmanager
def _loaders_stop_quietly() -> Iterator[None]:
    """While bench or demo runs DataLoaders with worker processes: on SIGTERM or Ctrl-C (sent to the
    whole process group, the workers die too) stop with the command's one line, never torch's report
    of a killed worker.

    torch's SIGCHLD handler raises "DataLoader worker ... is killed" in the main process whenever a
    worker dies, also while the interrupted command shuts its loaders down. So the handlers here
    give SIGCHLD a handler that does nothing before they raise; the loaders are then closed by ``run``.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stopping: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        # Not SIG_DFL: a SIGCHLD already pending would then be reported as "ignored due to race condition".
        signal.signal(signal.SIGCHLD, _child_exited)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        yield
    except RuntimeError as exc:
        # Python runs signal handlers between bytecodes: torch's SIGCHLD handler can run inside ``stop`` before
        # ``stop`` has replaced it, and report the worker that the same signal killed. That is this stop.
        signum = _killed_worker_signal(exc)
        if signum is None or (stopping and stopping[0] != signum):
            raise
        stop(signum, None)
    finally:
        if not stopping:  # once stopping, the signals stay ignored until the command has said so and exited
            for sig, handler in before.items():
                signal.signal(sig, handler)


def _killed_worker_signal(exc: RuntimeError) -> int | None:
    """The signal (SIGTERM, SIGINT) that killed a DataLoader worker, as torch reports it; None for anything else."""
    import re
    import signal

    found = re.search(r"DataLoader worker \(pid \d+\) is killed by signal: (Terminated|Interrupt)", str(exc))
    if found is None:
        return None
    return signal.SIGTERM if found.group(1) == "Terminated" else signal.SIGINT


@contextlib.contextmanager
def _writing(flag: str, path: str) -> Iterator[None]:
    """A file the command was asked to write cannot be: one line naming the flag and the file."""
    from .errors import FULL_DISK, OutputError, OutputWriteError

    try:
        yield
    except OSError as exc:
        if exc.errno in FULL_DISK or exc.errno == errno.EFBIG:  # the machine's, not the call's: exit 1
            advice = "free space on its disk" if exc.errno in FULL_DISK else "raise the file size limit (ulimit -f)"
            raise OutputWriteError(f"{flag} {path}: {exc.strerror}; {advice} or choose another path") from exc
        raise OutputError(f"{flag} {path}: {exc.strerror or exc}; choose a writable path") from exc


_COMMANDS = {"build": _build, "info": _info, "verify": _verify, "sample": _sample, "demo": _demo, "bench": _bench}

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
