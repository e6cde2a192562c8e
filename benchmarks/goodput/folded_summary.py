"""A summary of one process's collapsed stacks (py-spy record --format raw): where its samples went.

    python -m benchmarks.goodput.folded_summary router.folded [--top 25]

Prints the share of samples under each function (inclusive: a function counts once per sample however
deep it recurs), then the hottest leaves (self time). Frames read "function (file:line)"; the summary
keys them by function and file, not line, so a function's samples add up.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def frame_key(frame: str) -> str:
    """'read (grpc/aio/_call.py:123)' -> 'read (grpc/aio/_call.py)', with site-packages paths shortened."""
    frame = _LINE.sub(")", frame.strip())
    return re.sub(r"\([^()]*(?:site-packages|lib/python3\.\d+)/", "(", frame)


def summarize(lines: list[str]) -> tuple[int, Counter, Counter]:
    """(samples, inclusive counts per frame, self counts per leaf frame) of collapsed-stack lines."""
    total, inclusive, leaves = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame_key(f) for f in stack.split(";") if f]
        samples = int(count)
        total += samples
        inclusive.update({frame: samples for frame in set(frames)})
        if frames:
            leaves[frames[-1]] += samples
    return total, inclusive, leaves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folded")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    total, inclusive, leaves = summarize(Path(args.folded).read_text().splitlines())
    print(f"{args.folded}: {total} samples")
    for title, counts in (("inclusive", inclusive), ("self", leaves)):
        print(f"-- {title}")
        for frame, samples in counts.most_common(args.top):
            print(f"{100 * samples / max(total, 1):5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
