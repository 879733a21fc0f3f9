"""`python -m edgeinfer.bench serve ...`: the same as `edgeinfer bench serve ...`."""

import argparse
import sys

from edgeinfer.bench.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m edgeinfer.bench", description="serving benchmarks")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
