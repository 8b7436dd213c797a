"""The knob for overlapping communication with the sharded product.

    import jax_tiled
    with jax_tiled.overlap.settings(chunks=4):     # finer pieces for a replicated K-sharded result
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(spare_sms=48):  # SMs the GPU kernels leave to the transfers
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(gather_spare_sms=16):  # the same in the all-gather ring
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(gather_barrier=False):  # its order left to XLA's scheduler
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(k_ring="operands"):  # K rings send operands, not sums
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(k_ring="collectives"):  # K sums by collectives, in pieces
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(gather_ring="collectives"):  # an all-gather a piece
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(k_sums="accumulation"):  # their sums sent in float32
        y = jax.jit(jax_tiled.matmul)(x, w)
    with jax_tiled.overlap.settings(enabled=False):   # one all-reduce / all-gather, as before
        y = jax.jit(jax_tiled.matmul)(x, w)
    jax_tiled.overlap.set_default(chunks=2)         # for the rest of the process

On GPUs of one process, XLA_FLAGS=--xla_gpu_collective_permute_mode=peer runs
the rings' transfers on the copy engines instead of NCCL's kernels, which take
SMs from the products; the defaults then spare no SM in the rings and ring a
replicated K split on two GPUs (`permutes_by_copy_engines`, docs/sharding.md).

The setting is read when a function holding `tiled_matmul` is lowered, and is
part of `jax.jit`'s cache key (through `jax.make_user_context`), so changing it
retraces and recompiles rather than reusing a program built under the other
value. What each layout does with it: docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import jax

__all__ = [
    "GATHER_SPARE_SMS",
    "K_RINGS",
    "K_SUMS",
    "COLLECTIVE_PIECES",
    "GATHER_RINGS",
    "SPARE_SMS",
    "Settings",
    "current",
    "permutes_by_copy_engines",
    "set_default",
    "settings",
]

# On two H100s (docs/sharding.md), a K ring's product and NCCL's send/receive
# kernel beside it competed for SMs; with 32 left to NCCL, bfloat16 8192^3 K
# rings ran 18-22% faster, with 16 no faster, with 48 the same, with 64 slower.
# Where the rings' transfers run on the copy engines
# (`permutes_by_copy_engines`) no SM is spared them: on two H100s 32 spared
# then cost 8-10% (docs/sharding.md, "The rings on the copy engines").
SPARE_SMS = 32

# XLA's flag that runs a collective-permute between GPUs of one process as a
# copy by the copy engines (its peer-access mode) instead of NCCL's
# send/receive kernel, which runs on SMs beside the product.
PERMUTE_MODE_FLAG = re.compile(r"--xla_gpu_collective_permute_mode=(\S+)")
PEER_PERMUTE_MODES = ("peer", "collectives_peer_memory")

# The same for the all-gather ring's products, with the barrier that places
# them inside the transfer: on two H100s (docs/sharding.md, "The all-gather
# ring's order") 32 ran the bfloat16 8192^3 pattern 4-7% faster than the ring
# before in four processes, 16 1-5%, none 5-7% slower. Without the barrier XLA's scheduler ends
# the transfer before the product, and any SM spared is only lost (0).
GATHER_SPARE_SMS = 32

# What the K rings can send: their partial sums, or the operands; or, no
# ring, the sums of pieces of the result by one collective each.
K_RINGS = ("sums", "operands", "collectives")

# How the all-gather pattern gathers its operand: a ring passing the blocks
# from device to device, or one all-gather a piece of each block.
GATHER_RINGS = ("blocks", "collectives")

# k_ring="collectives" and gather_ring="collectives" cut the work into this
# many pieces unless `chunks` says otherwise: one piece's collective runs
# beside the next piece's product, and the last one's alone.
COLLECTIVE_PIECES = 4

# The type the sums ring's running sums travel in: the accumulation type, or
# the result's.
K_SUMS = ("accumulation", "output")


@dataclasses.dataclass(frozen=True)
class Settings:
    """enabled: run the rings of `ppermute`s (True) or one collective (False).
    chunks: how many pieces each device's block of the result is cut into in the
    K-sharded rings (more pieces let a replicated result's all-gather run
    behind later products, but each product is smaller); None picks the
    measured best, 1 (docs/sharding.md). The collectives (k_ring and
    gather_ring "collectives") cut their work into as many, and None is
    `COLLECTIVE_PIECES` there.
    spare_sms: how many of the GPU's SMs a K ring's products leave free while a
    transfer runs beside them, so that the communication kernel (NCCL's, which
    runs on SMs) starts at once rather than waiting on the product's persistent
    grid; the ring's first product, which overlaps no transfer, takes every SM.
    None (the default) picks `SPARE_SMS`, or 0 for the rings (not the
    collectives) where their transfers run on the copy engines
    (`permutes_by_copy_engines`).
    gather_spare_sms: the same for the all-gather ring's products that run
    beside a transfer; None (the default) picks 0 where the transfers run on
    the copy engines, else `GATHER_SPARE_SMS` with `gather_barrier` and 0
    without it.
    gather_barrier: pass each step of the all-gather ring, the block in
    transit and the product beside it, through `lax.optimization_barrier`
    (default True). XLA's default scheduler, which knows no custom call's
    time, otherwise ends the transfer before the product; with the barrier
    the two become ready together and the product runs inside the transfer.
    False leaves the order to XLA: a program compiled with XLA's analytical
    latency estimator (the compiler option
    `xla_gpu_enable_analytical_latency_estimator`) places the product inside
    the transfer by itself, and ran faster so, with 16 SMs spared
    (docs/sharding.md).
    CPU products ignore the spared SMs.
    k_ring: what the K rings send between devices: None (the default) picks
    by the devices, the result and the transfers (`ring`); "sums", each
    block's float32 partial sums around the ring; "operands", each device's
    slice of K of the operands, in their own type, to every other device
    (fewer bytes where K is not much larger than M and N; one piece, so
    `chunks` does not apply). On two H100s it ran slower than the sums
    (docs/sharding.md). "collectives": no ring; the result is cut into
    `chunks` pieces (`COLLECTIVE_PIECES` where None) across the dimension it
    is scattered along, and each piece's partial products are summed by one
    reduce-scatter (or all-reduce, for a replicated result) beside the next
    piece's product: NCCL's collective kernels moved bytes about twice as
    fast as its send/receive on four H100s, where it ran 1.8x and 1.5x the
    sums ring; on two, replicated faster, reduce-scattered slower (not the
    default: docs/sharding.md).
    k_sums: the type the sums ring sends its running sums in: "output" (the
    default), the result's dtype, each running sum rounded to it before each
    transfer: half the bytes for a 16-bit result, and its rounding, one per
    device, is the class of jnp's all-reduce of 16-bit partial products;
    "accumulation", float32 (float64 for float64), so that a 16-bit result
    is rounded once, as on one device, at twice the bytes; the collectives
    sum in it too. The operand ring adds its sums on one device and ignores
    it. On two and four H100s the default ran faster on every K split
    (docs/sharding.md).
    gather_ring: how the all-gather pattern gathers its operand: "blocks"
    (the default), a ring of `ppermute`s passing each device's block on while
    the product of the one before runs; "collectives", each device's block
    cut into `chunks` pieces (`COLLECTIVE_PIECES` where None), each gathered
    by one all-gather beside the product of the piece before (with the
    barrier and the spared SMs of the ring). Not yet run on GPUs."""

    enabled: bool = True
    chunks: int | None = None
    spare_sms: int | None = None
    gather_spare_sms: int | None = None
    k_ring: str | None = None
    gather_barrier: bool = True
    k_sums: str = "output"
    gather_ring: str = "blocks"

    def __post_init__(self):
        for name in ("enabled", "gather_barrier"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"jax_tiled.overlap: {name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.chunks is not None and (
            isinstance(self.chunks, bool) or not isinstance(self.chunks, int)
        ):
            raise TypeError(
                f"jax_tiled.overlap: chunks must be an int or None, got {self.chunks!r}"
            )
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"jax_tiled.overlap: chunks must be at least 1, got {self.chunks}")
        for name in ("spare_sms", "gather_spare_sms"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"jax_tiled.overlap: {name} must be an int or None, got {value!r}")
            if value < 0:
                raise ValueError(f"jax_tiled.overlap: {name} must be at least 0, got {value}")
        if self.k_ring is not None and self.k_ring not in K_RINGS:
            raise ValueError(
                f"jax_tiled.overlap: k_ring must be None or one of "
                f"{', '.join(map(repr, K_RINGS))}, "
                f"got {self.k_ring!r}"
            )
        if self.gather_ring not in GATHER_RINGS:
            raise ValueError(
                f"jax_tiled.overlap: gather_ring must be one of "
                f"{', '.join(map(repr, GATHER_RINGS))}, got {self.gather_ring!r}"
            )
        if self.k_sums not in K_SUMS:
            raise ValueError(
                f"jax_tiled.overlap: k_sums must be one of {', '.join(map(repr, K_SUMS))}, "
                f"got {self.k_sums!r}"
            )

    def ring(self, devices: int, replicated: bool, gpu: bool, copy_engines: bool = False) -> str:
        """How a K split over `devices` devices sums: `k_ring`, or where it is
        None the one measured faster on GPUs (docs/sharding.md): on two
        devices the sums ring for a reduce-scattered result, and for a
        replicated one too where the ring's transfers run on the copy engines
        (`copy_engines`: `permutes_by_copy_engines` on a GPU); the
        collectives elsewhere (NCCL's send/receive ran at half its
        collectives' rate on four H100s; on the copy engines the sums ring
        ran a reduce-scattered split there 1.18-1.19x jnp in two processes
        and 0.75x in a third, where the collectives do not vary so). CPU
        devices, whose transfers are copies in one host's memory, keep the
        sums ring."""
        if self.k_ring is not None:
            return self.k_ring
        if not gpu or (devices == 2 and (copy_engines or not replicated)):
            return "sums"
        return "collectives"

    def spares(self, ring: str, copy_engines: bool = False) -> int:
        """The SMs the products of K ring `ring` beside a transfer leave to it:
        `spare_sms`, or where None `SPARE_SMS`, and none for a ring whose
        transfers run on the copy engines (the collectives are NCCL's kernels
        on SMs either way)."""
        if self.spare_sms is not None:
            return self.spare_sms
        return 0 if copy_engines and ring != "collectives" else SPARE_SMS

    def pieces(self, ring: str = "sums") -> int:
        """The pieces a device's block of the result is cut into by `ring`."""
        if self.chunks is not None:
            return self.chunks
        return COLLECTIVE_PIECES if ring == "collectives" else 1

    def gather_pieces(self) -> int:
        """The pieces gather_ring="collectives" cuts each device's block into."""
        return self.chunks if self.chunks is not None else COLLECTIVE_PIECES

    def gather_spares(self, copy_engines: bool = False) -> int:
        """The SMs the all-gather ring's products beside a transfer leave to it
        (none where its transfers run on the copy engines and gather_ring is
        "blocks": on two H100s that ran the pattern 1.27-1.29x jnp's against
        1.09-1.10x with 32 spared, docs/sharding.md)."""
        if self.gather_spare_sms is not None:
            return self.gather_spare_sms
        if copy_engines and self.gather_ring == "blocks":
            return 0
        return GATHER_SPARE_SMS if self.gather_barrier else 0


def permutes_by_copy_engines(xla_flags: str | None = None) -> bool:
    """Whether the XLA flags ask XLA to run the rings' transfers
    (collective-permutes between GPUs of this process) on the copy engines:
    `xla_flags` (default: the environment's XLA_FLAGS, which XLA reads once,
    when its backend starts) set `--xla_gpu_collective_permute_mode=peer`,
    the last such flag winning. XLA then copies into the peer's memory, and
    falls back to NCCL's send/receive only where the GPUs have no peer
    access. The transfers take no SM from the products beside them, and the
    rings' defaults (`Settings.ring`, `spares`, `gather_spares`) follow.
    Being fixed for the process, the flag is not part of jit's cache key; a
    mode passed to one compilation as a compiler option is not seen here:
    name the settings then."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    modes = PERMUTE_MODE_FLAG.findall(flags)
    return bool(modes) and modes[-1].lower() in PEER_PERMUTE_MODES


# A jit-cache-sensitive context where jax has one; on a jax without it a plain
# global, with the caveat docs/sharding.md states.
_make = getattr(jax, "make_user_context", None)
_context = _make(Settings()) if _make is not None else None
_fallback = [Settings()]


def current() -> Settings:
    """The settings in force here."""
    if _context is None:
        return _fallback[-1]
    value = _context.value
    return value if value is not None else _context.get_global()


@contextlib.contextmanager
def settings(enabled: bool = True, **options):
    """Sets the overlap for the functions lowered inside the block; `options`
    are `Settings`' other fields, by name (its defaults where not given)."""
    new = Settings(enabled, **options)
    if _context is None:
        _fallback.append(new)
        try:
            yield new
        finally:
            _fallback.pop()
        return
    with _context(new):
        yield new


def set_default(enabled: bool = True, **options) -> None:
    """Sets the overlap outside any `settings` block (`options` as for
    `settings`)."""
    new = Settings(enabled, **options)
    if _context is None:
        _fallback[0] = new
    else:
        _context.set_global(new)
