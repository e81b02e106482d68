"""The `attnkit` command: explain | info."""

from __future__ import annotations

import argparse
import sys


def _cmd_explain(args) -> int:
    from .explain import worked_example
    print(worked_example())
    return 0


def _cmd_info(args) -> int:
    from .backends import info
    print("attnkit backends on this machine:")
    for name, status, desc in info():
        print(f"  {name:<10} {status:<40.40} {desc}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attnkit", description="Exact scaled dot-product attention.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("explain", help="the four steps of attention on a worked example").set_defaults(fn=_cmd_explain)
    sub.add_parser("info", help="which backends run here, and why the others do not").set_defaults(fn=_cmd_info)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
