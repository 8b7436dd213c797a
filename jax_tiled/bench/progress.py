"""Progress of a benchmark run: tqdm when installed, else a counter on stderr."""

from __future__ import annotations

import sys


class Progress:
    """tqdm when installed, else a one-line counter on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            sys.stderr.write(f"\r[{self.done:>3}/{self.total}] {text:<60.60}")
            sys.stderr.flush()

    def step(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write(f"\r[{self.done:>3}/{self.total}] done{' ' * 56}\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
