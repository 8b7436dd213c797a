"""Shapes by name, and the suites the benchmark runs by default."""

from __future__ import annotations

import dataclasses
import re

GPU_SUITE = (
    "512^3",
    "1024^3",
    "2048^3",
    "4096^3",
    "8192^3",
    "1000x800x1200",
    "4096x4096x128",
    "128x4096x4096",
    "16x8192x8192",
    "8192x128x8192",
    "4096x14336x4096",
    "b32x512x64x512",
    "b8x2048^3",
    "4096^3-tA",
    "4096^3-tB",
    "8192^3-tA",
    "8192^3-tB",
)
GPU_QUICK = ("1024^3", "4096^3", "1000x800x1200", "4096x4096x128")
# The CPU target's shapes (squares 256-4096, skinny, batched) and the layouts
# the kernel reads through its transpose flags.
CPU_SUITE = (
    "256^3",
    "512^3",
    "1024^3",
    "2048^3",
    "4096^3",
    "1000x800x1200",
    "8192x64x8192",
    "96x4096x4096",
    "2048x2048x128",
    "128x2048x2048",
    "16x2048x2048",
    "2048x128x2048",
    "b32x512x64x512",
    "b8x384x256x384",
    "1024^3-tA",
    "1024^3-tB",
)
CPU_QUICK = ("256^3", "512^3", "1024^3", "1000x800x1200")
# The shapes users' products take, by class (--user-shapes): not the suite
# the kernels were tuned on, so that a class is judged on shapes beside the
# ones it was measured with (M x K x N; "b" a batch).
USER_SHAPES = {
    "odd sizes": ("1000x800x1200", "777x1999x513", "3000x1000x2999"),
    "skinny (a side of 64 to 128)": (
        "8192x128x8192",
        "4096x4096x128",
        "128x4096x4096",
        "16384x4096x64",
    ),
    "K-heavy": ("512x8192x512", "256x65536x256", "1024x32768x1024"),
    "M <= 64 (decoding)": ("16x8192x8192", "64x4096x14336", "32x4096x4096"),
    "batched": ("b8x2048x128x2048", "b16x1024^3", "b32x512x64x512", "b64x256x64x256"),
}

SKINNY = 128


@dataclasses.dataclass(frozen=True)
class Shape:
    m: int
    k: int
    n: int
    batch: int = 1
    transpose: str = ""  # "", "tA" or "tB"

    @property
    def name(self) -> str:
        core = f"{self.m}^3" if self.m == self.k == self.n else f"{self.m}x{self.k}x{self.n}"
        prefix = f"b{self.batch}x" if self.batch > 1 else ""
        suffix = f"-{self.transpose}" if self.transpose else ""
        return prefix + core + suffix

    def _lead(self) -> tuple[int, ...]:
        return (self.batch,) if self.batch > 1 else ()

    @property
    def stored_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of a and b as generated (a transposed operand stored as its .mT)."""
        a = (self.k, self.m) if self.transpose == "tA" else (self.m, self.k)
        b = (self.n, self.k) if self.transpose == "tB" else (self.k, self.n)
        return self._lead() + a, self._lead() + b

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def skinny(self) -> bool:
        return min(self.m, self.n, self.k) <= SKINNY

    def bytes_moved(self, itemsize: int, out_itemsize: int | None = None) -> int:
        """Each input read once and the output (of out_itemsize bytes an element,
        default the inputs') written once."""
        out_itemsize = itemsize if out_itemsize is None else out_itemsize
        return self.input_bytes(itemsize) + self.batch * self.m * self.n * out_itemsize

    def input_bytes(self, itemsize: int) -> int:
        return self.batch * (self.m * self.k + self.k * self.n) * itemsize


_SHAPE_RE = re.compile(r"^(?:b(\d+)x)?(?:(\d+)\^3|(\d+)x(\d+)x(\d+))(?:-(tA|tB))?$", re.I)


def parse_shape(text: str) -> Shape:
    match = _SHAPE_RE.match(text.strip())
    if not match:
        raise ValueError(
            f"bad shape {text!r}: use e.g. 4096^3, 1000x800x1200, b32x512x64x512, 8192^3-tA"
        )
    batch, cube, m, k, n, transpose = match.groups()
    m, k, n = (int(cube),) * 3 if cube else (int(m), int(k), int(n))
    transpose = {"ta": "tA", "tb": "tB"}.get((transpose or "").lower(), "")
    return Shape(m, k, n, int(batch or 1), transpose)
