"""Benchmark jax_tiled's kernels against jnp.matmul, as docs/performance.md describes.

Every kernel usable on the default backend (each forced by name, plus
"auto") and the peer `jnp.matmul` run in one process through one harness, on
the same random-normal inputs; each row reports its time, TFLOP/s, achieved
GB/s for skinny shapes, and its ratio to the peer (peer time / kernel time, so
> 1 means faster than jnp.matmul). The peer of a float32 row is `jnp.matmul`
at the same precision, except that `high` (3xTF32) is compared with `highest`,
as the targets in docs/performance.md say; a row at a lax.DotAlgorithmPreset
(`--precision bf16_bf16_f32_x3`) is compared with `jnp.matmul` at that preset.
On an sm_90 GPU the Pallas Mosaic-GPU Hopper kernel that jax ships is a second
peer (bench/pallas.py; --pallas / --no-pallas), at the fastest of a few
configs per row.

Usage:

    python -m jax_tiled.bench                      # the backend's default suite
    python -m jax_tiled.bench --quick              # a short run
    python -m jax_tiled.bench --dtype bfloat16 --dtype float16 --shapes 4096^3,8192^3
    python -m jax_tiled.bench --precision highest --kernels smem,auto
    python -m jax_tiled.bench --precision bf16_bf16_f32_x3,bf16_bf16_f32_x6 --shapes 4096^3
    python -m jax_tiled.bench --json out.json --plot out.png
    python -m jax_tiled.bench --dtype bfloat16 --shapes 4096^3,8192^3 --pallas
    python -m jax_tiled.bench --list-shapes
    python -m jax_tiled.bench --train-step         # the training step, bfloat16
    python -m jax_tiled.bench --train-step --width 8192 --tokens 8192 --json step.json
    python -m jax_tiled.bench --train-step --width 64 --tokens 4096   # a small model's step
    python -m jax_tiled.bench --train-step --model attention          # a transformer block
    python -m jax_tiled.bench --chain              # small products in lax.scan and unrolled
    python -m jax_tiled.bench --accuracy           # error and bias, ours and jnp's, vs float64
    python -m jax_tiled.bench --ladder --plot ladder.png --ladder-md ladder.md   # the ladder, GPU

Shape names are M x K x N: "4096^3", "1000x800x1200", "b32x512x64x512" (batch
32), "b8x2048^3"; a suffix "-tA" / "-tB" stores a (or b) transposed and passes
`a_t.mT` (or `b_t.mT`) to the product. Any such name works in --shapes, not
only the suite's.

The package, by concern:

    timing      input sets and pipelined timing (shared with tools/scaling.py)
    shapes      shape names and the suites
    harness     ours against the peer: the matmuls, rows per precision, ratios
    products    the product suite: one row per shape, dtype, precision, kernel
    pallas      the second peer: jax's Pallas Hopper kernel, its configs, its sweep
    train_step  the training step (--train-step): an MLP or a transformer block
    chains      chains of small products, scanned and unrolled (--chain)
    accuracy    error and bias against a float64 product, ours and the peer's (--accuracy)
    ladder      every rung of the CUDA ladder on one shape, its bytes per output (--ladder)
    progress    the progress bar
    report      tables, geometric means, device facts, JSON
    plot        the PNG bar chart (--plot)
    cli         the command line (`python -m jax_tiled.bench`, `cli.main`)
"""
