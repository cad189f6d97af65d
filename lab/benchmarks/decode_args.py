"""The command line the decoding benchmarks share: a data root's drafter decoded under a
profile's target, timed as the best of N repeats on a set number of torch threads."""

from __future__ import annotations

import argparse

import torch

from storage import default_root


def drafter_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with --root, --profile and --drafter; the benchmark adds its own options, then
    `parse_decoding` adds --repeats and --threads and parses."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--root", default=None, help="data root [default: OPD_HOME]")
    parser.add_argument("--profile", default="default")
    parser.add_argument("--drafter", default="opd@latest")
    return parser


def parse_decoding(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, str]:
    """The parsed options and the data root, with torch's threads set to --threads."""
    parser.add_argument("--repeats", type=int, default=1, help="best of N per decoder")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args, args.root or str(default_root())
