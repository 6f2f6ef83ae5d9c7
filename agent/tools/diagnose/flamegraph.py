"""A flame graph as SVG from collapsed stacks, for captures that read the agent's own samples
(py-spy draws its own when it samples). Brendan Gregg's layout: the outermost frame at the
bottom, each frame as wide as its share of the samples, siblings in name order; each box's
tooltip (``<title>``) names the frame and its samples. Static SVG, no script: a capture is
served with ``X-Content-Type-Options: nosniff`` and opened in a browser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from mrc_agent.agent.tools.diagnose.stacks import Stack

WIDTH = 1200
ROW = 16
#: Boxes narrower than this (pixels) are left out, as flamegraph.pl does.
MIN_WIDTH = 0.1
#: Roughly a character of 12 px monospace text, for cutting labels to their box.
CHAR = 7.2


@dataclass
class _Node:
    count: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _tree(stacks: Sequence[Stack]) -> _Node:
    root = _Node()
    for s in stacks:
        root.count += s.count
        node = root
        for frame in s.frames:
            node = node.children.setdefault(frame.key, _Node())
            node.count += s.count
    return root


def _colour(name: str) -> str:
    """A warm colour from the name, stable across captures (as flamegraph.pl's "hot")."""
    h = sum(ord(c) * (i + 1) for i, c in enumerate(name)) & 0xFFFF
    return f"rgb({205 + h % 50},{(h >> 4) % 180},{(h >> 8) % 55})"


def render(stacks: Sequence[Stack], title: str) -> str:
    """The SVG text for ``stacks`` (any threads), titled ``title``."""
    root = _tree(stacks)
    placed: list[tuple[str, int, float, int, float]] = []  # name, count, x, level, width

    def walk(node: _Node, name: str, x: float, level: int) -> None:
        width = WIDTH * node.count / root.count
        if width < MIN_WIDTH:
            return
        placed.append((name, node.count, x, level, width))
        for child_name in sorted(node.children):
            child = node.children[child_name]
            walk(child, child_name, x, level + 1)
            x += WIDTH * child.count / root.count

    if root.count:
        walk(root, "all", 0.0, 0)
    depth = max((p[3] for p in placed), default=0)
    height = (depth + 1) * ROW + 40
    out = [
        '<?xml version="1.0" standalone="no"?>',
        f'<svg version="1.1" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" xmlns="http://www.w3.org/2000/svg">',
        "<style>text{font-family:monospace;font-size:12px}</style>",
        f'<text x="{WIDTH / 2:g}" y="18" text-anchor="middle">{escape(title)}</text>',
    ]
    # Rows count up from the bottom: the outermost frame is the lowest box.
    out.extend(_box(name, count, root.count, x, height - 4 - (level + 1) * ROW, width)
               for name, count, x, level, width in placed)
    if not root.count:
        out.append('<text x="10" y="40">No samples: the target ran no Python code in the '
                   "window (idle).</text>")
    out.append("</svg>\n")
    return "\n".join(out)


def _box(name: str, count: int, total: int, x: float, y: int, width: float) -> str:
    label = name if name == "all" else name.split(" (", 1)[0]
    fits = int((width - 6) / CHAR)
    text = label if len(label) <= fits else (label[:fits - 2] + ".." if fits > 3 else "")
    tip = f"{name} ({count} samples, {100 * count / total:.2f} %)"
    shown = f'<text x="{x + 3:.2f}" y="{y + ROW - 4}">{escape(text)}</text>' if text else ""
    return (f'<g><title>{escape(tip)}</title><rect x="{x:.2f}" y="{y}" width="{width:.2f}" '
            f'height="{ROW - 1}" fill="{_colour(label)}"/>{shown}</g>')


def write(path: str, stacks: Sequence[Stack], title: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(stacks, title))
