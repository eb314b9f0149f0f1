"""``nanolimit`` (or ``python -m nanolimit``): the command line of the nanolimit rate limiter.

The parser and the dispatch; each command lives in a module of its own:
``demo`` (:mod:`.demo`) replays the reference scenarios of docs/spec.md §7 through
the gateway middleware, ``check-config`` (:mod:`.check_config`) validates a
rules file, ``replay`` (:mod:`.replay`) runs a request log through a
candidate limit, ``bench`` (:mod:`.bench`) sets nanolimit beside its peers,
``inspect`` and ``clear`` (:mod:`.inspect`) read and forget one key on a live
store, and ``info`` says which core is loaded. ``--help`` shows these docstrings as
plain text (:func:`._help.plain`), never as reStructuredText.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import nanolimit

from .._limiter_config import Algorithm
from ..gateway.rules import KeyScope
from . import check_config as check_config_command
from . import demo as demo_command
from . import inspect as inspect_command
from . import replay as replay_command
from . import zone as zone_command
from ._help import FORMATTER, first_paragraph, plain
from .check_config import check_config
from .demo import ALGORITHM_ORDER, WALL, demo
from .replay import REPLAY_BATCH, replay

__all__ = ["ALGORITHM_ORDER", "REPLAY_BATCH", "WALL", "check_config", "demo", "main", "replay"]


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["bench"]:
        # routed before parsing: the bench engine has options of its own
        from . import bench as _bench

        return _bench.main(args_list[1:])
    argv = args_list
    parser = argparse.ArgumentParser(
        prog="nanolimit",
        description=first_paragraph(__doc__),
        epilog="Run 'nanolimit COMMAND --help' for what one command does and its options.",
        formatter_class=FORMATTER,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"nanolimit {nanolimit.__version__} ({nanolimit.IMPLEMENTATION} core)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo",
        help="replay docs/spec.md §7 through the gateway middleware",
        description=plain(demo_command.__doc__),
        formatter_class=FORMATTER,
    )
    commands.add_parser(
        "info",
        help="print which core is loaded",
        description="Print the version and the live core (native or reference) as JSON.",
    )
    commands.add_parser(
        "bench",
        help="nanolimit and its peers side by side (nanolimit bench --help)",
        description="nanolimit and its peers side by side; 'nanolimit bench --help' lists its options.",
    )
    zone_parser = commands.add_parser(
        "zone",
        help="show a shared-memory zone's keys, evictions and processes",
        description=plain(zone_command.__doc__),
        formatter_class=FORMATTER,
    )
    zone_parser.add_argument("name", help="the zone's name, as given to SharedMemoryStorage")
    zone_parser.add_argument("--keys", type=int, default=0, metavar="N", help="list up to N of its keys")
    zone_parser.add_argument("--unlink", action="store_true", help="then remove the zone's name")
    for name, summary in (
        ("inspect", "show one key's state on a store and what its next request would get"),
        ("clear", "forget one key's state on a store (its next request sees a full budget)"),
    ):
        key_parser = commands.add_parser(
            name, help=summary, description=plain(inspect_command.__doc__), formatter_class=FORMATTER
        )
        inspect_command.add_arguments(key_parser, name)
    check = commands.add_parser(
        "check-config",
        help="validate a rules file (TOML or JSON)",
        description=plain(check_config_command.__doc__),
        formatter_class=FORMATTER,
    )
    check.add_argument("path", help="the rules file (.toml or .json)")
    rp = commands.add_parser(
        "replay",
        help="replay a request log (timestamp,key[,cost]) through a limit",
        description=plain(replay_command.__doc__),
        formatter_class=FORMATTER,
    )
    rp.add_argument("trace", help="CSV file: timestamp (Unix seconds or ISO 8601), key, optional cost")
    rp.add_argument("--rule", required=True, help='the limit, e.g. "100/minute" or "10/s burst 20"')
    rp.add_argument(
        "--algorithm",
        default="token_bucket",
        choices=[a.value for a in Algorithm],
        help="the algorithm (default: %(default)s)",
    )
    rp.add_argument(
        "--scope",
        default="ip",
        choices=[s.value for s in KeyScope],
        help="what the key column counts under (default: %(default)s)",
    )
    rp.add_argument("--top", type=int, default=10, help="how many keys to list (most denied first)")
    rp.add_argument("--batch", type=int, default=REPLAY_BATCH, help="requests per native batch")
    rp.add_argument("--per-key", metavar="CSV", help="write every key's counts to this file")
    rp.add_argument("--json", action="store_true", help="print the summary as JSON")
    bar = rp.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="draw a progress bar on stderr (default: when stderr is a terminal and the file is over 8 MiB)",
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never draw it")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(json.dumps({"version": nanolimit.__version__, "implementation": nanolimit.IMPLEMENTATION}))
        return 0
    if args.command == "inspect":
        return inspect_command.inspect_key(args)
    if args.command == "clear":
        return inspect_command.clear(args)
    if args.command == "check-config":
        return check_config(args.path)
    if args.command == "zone":
        if args.keys < 0:
            parser.error("--keys must be >= 0")
        return zone_command.zone(args.name, keys=args.keys, unlink=args.unlink)
    if args.command == "replay":
        if args.batch < 1:
            parser.error("--batch must be >= 1")
        return replay(
            args.trace,
            args.rule,
            args.algorithm,
            args.scope,
            top=args.top,
            batch=args.batch,
            progress=args.progress,
            as_json=args.json,
            per_key=args.per_key,
        )
    return demo()


if __name__ == "__main__":
    sys.exit(main())
