"""Sum up py-spy's collapsed stacks (bench/many_bench.py --profile DIR): the
functions where a process spent its samples, inclusive (the function and
what it called) and self (the function's own code).

    python bench/profile_top.py DIR/load64-mesh.txt [--top 30] [--match services/]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def frame_key(frame: str) -> str:
    """`function (file)` without the line number, the file shortened to its project path."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    file = match["file"]
    for marker in ("/site-packages/", "/lib/python3."):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    else:
        file = re.sub(r"^.*?/(services|inboxmesh|agent_host|bench)/", r"\1/", file)
    return f"{match['name']} ({file})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="", help="only functions whose key contains this")
    args = parser.parse_args()
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in args.stacks.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_key(f) for f in stack.split(";")[1:]]  # the first is the thread
        total += count
        for key in set(frames):
            inclusive[key] += count
        if frames:
            own[frames[-1]] += count
    if not total:
        raise SystemExit(f"no samples in {args.stacks}")
    print(f"{total} samples in {args.stacks}")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"\n{title}:")
        shown = [(k, v) for k, v in counter.most_common() if args.match in k][:args.top]
        for key, count in shown:
            print(f"{count / total * 100:6.1f}%  {key}")


if __name__ == "__main__":
    main()
