"""Which kernels there are and which one runs a product: `kernels()` and `explain()`.

Both answer from the code that decides at run time: the extension modules'
kernel tables and refusals, and on CUDA the module's own `kernel="auto"`
policy, which needs no GPU to answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tiled import _canonical, _checks, _dot_general, _ffi, _lowering, _matmul, _presets
from jax_tiled._checks import DTypeLike, PrecisionLike
from jax_tiled._primitive import check_kernel_runs

API = "jax_tiled.explain"


def _backend_platform(backend: str | None) -> str:
    backend = jax.default_backend() if backend is None else backend
    return {"gpu": "cuda"}.get(backend, backend)


def kernels(
    backend: str | None = None,
    dtype: DTypeLike = None,
    out_dtype: DTypeLike = None,
    precision: PrecisionLike = None,
) -> list[str]:
    """Kernels built and usable on `backend` ('cpu', 'gpu'/'cuda'; default:
    jax's default backend). Any of them can be forced with `matmul(..., kernel=)`.

    With `dtype` (the operands', after promotion), only the kernels that compute
    that dtype into `out_dtype` (default: the same) at `precision`, which takes
    what `matmul` takes (default None: the product's default, which honours
    `jax.default_matmul_precision`). On CUDA, the tensor-core kernels take float32
    at DEFAULT (TF32) and HIGH (3xTF32) but not at HIGHEST (true fp32). A
    `lax.DotAlgorithmPreset` lists the kernels of the product it runs as (see
    `explain`); one the backend refuses raises ValueError naming those it takes."""
    platform = _backend_platform(backend)
    precision = _checks.precision(precision, "jax_tiled.kernels", platform)
    if platform == "cuda":
        try:
            jax.devices("cuda")
        except RuntimeError:
            return []
    elif platform != "cpu":
        return []
    names = _ffi.kernel_names(platform)
    if dtype is None:
        return list(names)
    dtype = np.dtype(dtype)
    out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
    if dtype not in _canonical.SUPPORTED_DTYPES or out_dtype not in _canonical.SUPPORTED_DTYPES:
        return []  # no kernel computes it: integer operands are promoted to a float first
    run = _presets.resolve(platform, precision, dtype, out_dtype, "jax_tiled.kernels").kernel_run()
    return [
        name
        for name in names
        if not _ffi.refusal(
            platform, name, run.operand_dtype, run.product_dtype, precision=run.precision
        )
    ]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What `explain` found: the product as the kernel sees it, the kernel that
    runs it, why, and its launch plan. `str()` gives it as one line,

        cuda: 1 x (48 x 8192) @ (8192 x 8192), float32 -> float32, precision
        HIGHEST: smem16: fewer than 64 rows or columns: ...; runs 16 x 16 tiles
    """

    platform: str  # "cpu" or "cuda"
    # (batch_a, batch_b, m, n, k, transpose_a, transpose_b): the canonical
    # problem, a batch of 1 broadcast against the other's
    problem: tuple
    dtype: str  # the operands', after promotion
    out_dtype: str
    precision: str  # the lax.Precision's or lax.DotAlgorithmPreset's name
    runs_as: str  # what a preset runs as on the platform ("" for a lax.Precision)
    kernel: str  # "none" where no kernel runs (CUDA: an empty output, or K of 0)
    reason: str
    plan: str  # the launch plan the kernel runs ("" where it has none to describe)

    @property
    def batch(self) -> Any:
        return _canonical.batch(self.problem[0], self.problem[1])

    def __str__(self) -> str:
        _, _, m, n, k, _, _ = self.problem
        text = (
            f"{self.platform}: {self.batch} x ({m} x {k}) @ ({k} x {n}), {self.dtype} -> "
            f"{self.out_dtype}, precision {self.precision}"
        )
        if self.runs_as:
            text += f" (runs as {self.runs_as})"
        text += f": {self.kernel}: {self.reason}"
        return text + (f"; runs {self.plan}" if self.plan else "")


def _cpu_plan(operand_dtype, product_dtype) -> str:
    """The CPU kernel's path for bfloat16 inputs into a non-float64 result (the
    handler's choice: AMX tiles, vdpbf16ps, or the float32 fallback); "" for
    other dtypes, which have one path."""
    if np.dtype(operand_dtype) == np.dtype(jnp.bfloat16) and np.dtype(product_dtype) != np.float64:
        return f"the {_ffi.cpu_bf16_path()} bfloat16 path"
    return ""


def explain(
    a: Any,
    b: Any,
    *,
    precision: PrecisionLike = None,
    preferred_element_type: DTypeLike = None,
    kernel: str = "auto",
    backend: str | None = None,
) -> Explanation:
    """Which kernel `matmul(a, b, ...)` runs on `backend` (default: jax's
    default backend), and why. a and b may be arrays or jax.ShapeDtypeStructs.
    For a `lax.DotAlgorithmPreset` it also says what the preset runs as there:
    the casts and the kernel precision."""
    platform = _backend_platform(backend)
    kernel = _checks.kernel(kernel, API)
    captured = {}

    def canonical(a, b):
        lhs, rhs, dims, request = _matmul.as_dot_general(
            a, b, precision, preferred_element_type, kernel, platform, API
        )
        a3, b3, *flags, _ = _dot_general.canonical(lhs, rhs, dims, request.dtype)
        captured.update(request=request, flags=flags)
        return a3, b3

    a3, b3 = jax.eval_shape(canonical, a, b)
    request, flags = captured["request"], captured["flags"]
    _, m, n, k = _canonical.problem_dims(a3.shape, b3.shape, *flags)
    problem = (a3.shape[0], b3.shape[0], m, n, k, *flags)
    preset_run = _presets.resolve(platform, request.precision, a3.dtype, request.out_dtype, API)
    runs_as = (
        preset_run.describe(a3.dtype, request.out_dtype)
        if _presets.is_preset(request.precision)
        else ""
    )
    # The kernel's own product: an emulation preset's is of the parts, over a longer K.
    run, kernel_problem = preset_run.kernel_run(), preset_run.kernel_problem(problem)
    found = dict(
        platform=platform,
        problem=problem,
        dtype=a3.dtype.name,
        out_dtype=request.out_dtype.name,
        precision=request.precision.name,
        runs_as=runs_as,
    )
    if kernel != "auto":
        check_kernel_runs(
            platform, kernel, run.operand_dtype, run.product_dtype, kernel_problem, run.precision
        )
        plan = ""
        if platform == "cpu":
            plan = _cpu_plan(run.operand_dtype, run.product_dtype)
        elif platform == "cuda" and _ffi.cuda_module_built():
            forced = _ffi.cuda_plan(
                kernel,
                run.operand_dtype,
                run.product_dtype,
                kernel_problem,
                run.precision,
                laid_terms=run.laid_terms,
            )
            plan = forced.text if forced else ""
        return Explanation(**found, kernel=kernel, reason=f"forced by kernel={kernel!r}", plan=plan)
    if platform == "cpu":
        (only,) = _ffi.kernel_names("cpu")
        return Explanation(
            **found,
            kernel=only,
            reason="the cache-blocked CPU kernel, the only CPU kernel",
            plan=_cpu_plan(run.operand_dtype, run.product_dtype),
        )
    if platform == "cuda" and _ffi.cuda_module_built():
        # Parts laid along K (an emulation preset) are lowered unpadded.
        padded = kernel_problem == problem and _lowering.padding_to_whole_lines(
            platform, kernel, run.operand_dtype, run.product_dtype, run.precision, problem
        )
        chosen, reason, plan = _ffi.cuda_explain(
            run.operand_dtype.name,
            run.product_dtype.name,
            (*problem[:2], *padded, *problem[5:]) if padded else kernel_problem,
            _ffi.cuda_multiprocessors(),
            run.precision,
            run.laid_terms,
        )
        parts = _lowering.k_parts_summed_by_xla(
            platform, kernel, run.operand_dtype, run.product_dtype, run.precision, problem
        )
        if parts > 1:
            m, n, k = problem[2:5]
            chosen, reason, plan = _ffi.cuda_explain(
                run.operand_dtype.name,
                "float32",
                (parts, parts, m, n, k // parts, *problem[5:]),
                _ffi.cuda_multiprocessors(),
                run.precision,
            )
            reason = (
                f"K cut into {parts} parts of {k // parts}, one batched product of them "
                f"whose sum XLA adds (fused with what follows); " + reason
            )
        if padded:
            m, n, k = problem[2:5]
            pm, pn, pk = padded
            loads = (
                "the TMA copy engine reads" if chosen == "wgmma" else "float32's own mainloop loads"
            )
            reason = (
                f"operands padded with zeros to rows of whole 16-byte lines, which {loads} "
                f"({m}x{k}x{n} as {pm}x{pk}x{pn}"
                + (", the result sliced back); " if (pm, pn) != (m, n) else "); ")
                + reason
            )
        # No kernel for a product with nothing to compute (the CUDA module says why).
        return Explanation(**found, kernel=chosen or "none", reason=reason, plan=plan)
    raise ValueError(f"{API}: no kernels for backend {platform!r} in this build")
