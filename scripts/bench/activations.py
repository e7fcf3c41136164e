"""Part 9: what the activation meter costs (``activations.ActivationMeter``; this process, one thread).

In a run the meter is armed at the call before a logging iteration and finished at the logging
step; off the logging iterations nothing is installed. Here:

- the demo's model (scripts/demo_model.py's first ``Stage``, passed in by the script: the package
  never imports scripts/): one logging iteration is 4 microbatches' forwards (outputs kept, as
  the first of 4 stages keeps them under 1F1B), then each one's backward, then an Adam step and
  ``zero_grad``; with the meter armed before and finished after, against the same without it,
  interleaved (each variant once a repetition, the first rotating);
- a 100-layer model (``Sequential`` of 100 ``Linear(64, 256), GELU, Linear(256, 64)`` blocks, 400
  parameter tensors, batch 16): one microbatch's forward and backward with and without the meter,
  interleaved; and ``arm()`` + ``finish()`` alone (installing and removing the hooks), on both;
- off the logging iterations: the modules and parameters the meter was armed on have no hook left
  after ``finish()`` (counted), and an iteration of the 100-layer model armed and finished before
  against a never-armed twin (same seed, same weights), interleaved.

Besides each variant's median, the median of the per-repetition ratios (with / without, from the
same repetition) is given: on a noisy machine it drifts less than the ratio of two medians.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

from .timing import interleaved, summarise

#: The demo's defaults (scripts/demo.py: model.*, train.micro_batch_size, seq_len, micro_batches).
DEMO = {"vocab": 128, "hidden": 64, "heads": 4, "layers_per_stage": 2}
SEQ_LEN, MICRO_BATCH_SIZE, MICROBATCHES = 128, 128, 4
DEEP_LAYERS, DEEP_WIDTH, DEEP_BATCH = 100, 64, 16


def _deep_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(DEEP_WIDTH, 4 * DEEP_WIDTH), nn.GELU(), nn.Linear(4 * DEEP_WIDTH, DEEP_WIDTH))
            for _ in range(DEEP_LAYERS)
        )
    )


def hooks_left(model) -> int:
    """Forward (pre-)hooks on every module, post-accumulate-grad hooks on every parameter, and
    saved-tensor hook pairs installed now: what a meter left behind (0 after ``finish()``)."""
    import torch

    count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    count += sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return count + (torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)


def _paired_ratio(wall: dict, with_meter: str, without: str) -> float:
    return statistics.median(a / b for a, b in zip(wall[with_meter], wall[without]))


def activations_part(build_stage, repetitions: int, deep_repetitions: int, quick: bool = False) -> dict:
    """``build_stage(model_cfg, seq_len, first, last)``: the demo's ``Stage``. ``quick``: microbatches
    of 8 sequences instead of 128 (the smoke run; the times then mean little)."""
    import torch

    from nemo_memlog.measure.activations import ActivationMeter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        micro_batch_size = 8 if quick else MICRO_BATCH_SIZE
        torch.manual_seed(0)
        stage = build_stage(SimpleNamespace(**DEMO), SEQ_LEN, True, False)
        optimizer = torch.optim.Adam(stage.parameters())
        tokens = torch.Generator().manual_seed(0)
        batches = [
            torch.randint(DEMO["vocab"], (micro_batch_size, SEQ_LEN), generator=tokens) for _ in range(MICROBATCHES)
        ]
        meter = ActivationMeter()
        seen = {}

        def demo_iteration(armed: bool):
            if armed:
                meter.arm(stage)
            outputs = [stage(x) for x in batches]  # all forwards first: 4 microbatches in flight
            for out in outputs:
                out.square().mean().backward()
            del outputs
            optimizer.step()
            optimizer.zero_grad()
            if armed:
                seen["demo"] = meter.finish()

        demo, _ = interleaved(
            {"demo_meter": lambda _: demo_iteration(True), "demo_plain": lambda _: demo_iteration(False)},
            repetitions,
            warmup=1 if quick else 2,
        )

        deep, twin = _deep_model(1), _deep_model(1)
        x = torch.randn(DEEP_BATCH, DEEP_WIDTH, generator=torch.Generator().manual_seed(1))

        def deep_iteration(model, armed: bool = False):
            if armed:
                meter.arm(model)
            model(x).square().mean().backward()
            model.zero_grad()
            if armed:
                seen["deep"] = meter.finish()

        def arm_finish(model):
            meter.arm(model)
            meter.finish()

        warmup = 2 if quick else 5
        with_without, _ = interleaved(
            {"deep_meter": lambda _: deep_iteration(deep, True), "deep_plain": lambda _: deep_iteration(deep)},
            deep_repetitions,
            warmup=warmup,
        )
        install, _ = interleaved(
            {"arm_finish_demo": lambda _: arm_finish(stage), "arm_finish_deep": lambda _: arm_finish(deep)},
            4 * deep_repetitions,
            warmup=warmup,
        )
        left = {"demo": hooks_left(stage), "deep": hooks_left(deep)}
        # Off the logging iterations: ``deep`` has been armed and finished hundreds of times, ``twin`` never.
        off, _ = interleaved(
            {"after_finish": lambda _: deep_iteration(deep), "never_armed": lambda _: deep_iteration(twin)},
            deep_repetitions,
            warmup=warmup,
        )
    finally:
        torch.set_num_threads(threads)
    measured = {
        name: None
        if m is None
        else {
            "activations_gb": m.activations_gb,
            "microbatches_in_flight": m.microbatches_in_flight,
            "activations_per_microbatch_gb": m.activations_per_microbatch_gb,
        }
        for name, m in seen.items()
    }
    return {
        "quick": quick,
        "micro_batch_size": micro_batch_size,
        "deep_tensors": len(list(deep.parameters())),
        "measured": measured,
        "hooks_left": left,
        "paired": {
            "demo": _paired_ratio(demo, "demo_meter", "demo_plain"),
            "deep": _paired_ratio(with_without, "deep_meter", "deep_plain"),
            "off": _paired_ratio(off, "after_finish", "never_armed"),
        },
        **summarise(demo),
        **summarise(with_without),
        **summarise(install),
        **summarise(off),
    }


def activations_markdown(part: dict | None) -> list[str]:
    if not part:
        return []

    def ms(key: str, field: str = "median_us") -> float:
        return part[key][field] / 1e3

    def row(label: str, with_key: str, without_key: str, paired: str) -> str:
        extra = ms(with_key) - ms(without_key)
        return (
            f"| {label} | {ms(with_key):.2f} ({ms(with_key, 'p90_us'):.2f}) | {ms(without_key):.2f} "
            f"({ms(without_key, 'p90_us'):.2f}) | {extra:+.2f} | {100 * (ms(with_key) / ms(without_key) - 1):+.1f}% "
            f"| x{part['paired'][paired]:.3f} | {part[with_key]['n']} |"
        )

    demo, deep = part["measured"].get("demo"), part["measured"].get("deep")
    lines = [
        "",
        f"Activation meter (this process, 1 thread), ms per iteration, median (p90), interleaved"
        f"{'; quick: microbatches of 8 sequences' if part['quick'] else ''}:",
        "",
        "| | with the meter | without | overhead, ms | overhead, % of median | paired ratio (median) | n |",
        "|---|---:|---:|---:|---:|---:|---:|",
        row(
            f"demo model, logging iteration ({MICROBATCHES} x {part['micro_batch_size']}x{SEQ_LEN} tokens, Adam)",
            "demo_meter",
            "demo_plain",
            "demo",
        ),
        row(f"{DEEP_LAYERS}-layer model, forward + backward", "deep_meter", "deep_plain", "deep"),
        row(
            "off the logging iterations: armed and finished before vs never armed", "after_finish", "never_armed", "off"
        ),
        "",
        f"arm() + finish() alone (hooks installed and removed): demo model {ms('arm_finish_demo'):.3f} ms, "
        f"{DEEP_LAYERS}-layer model ({part['deep_tensors']} parameter tensors) {ms('arm_finish_deep'):.3f} ms.",
        f"Hooks left after finish(): demo model {part['hooks_left']['demo']}, "
        f"{DEEP_LAYERS}-layer model {part['hooks_left']['deep']}.",
    ]
    if demo and deep:
        lines.append(
            f"Measured: demo {demo['activations_gb']:.3f} GB at most held, "
            f"{demo['microbatches_in_flight']} microbatches in flight, "
            f"{demo['activations_per_microbatch_gb']:.3f} GB a microbatch; {DEEP_LAYERS}-layer "
            f"{deep['activations_gb'] * 1e3:.2f} MB."
        )
    return lines
