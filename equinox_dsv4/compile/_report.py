"""What `python -m equinox_dsv4.compile` reports beside XLA's figures: the useful FLOPs and
roofline estimate of a phase (at the chip's published peaks, `_targets.py`), and the printed
table."""


def estimate(args, chip, config, phase: str, tokens: int, batch: int, devices: int, row) -> dict:
    """Useful FLOPs per device, and where the chip's peak is known the roofline time and MFU
    from XLA's cost analysis (an unrolled program's only: a scanned one counts a layer once)."""
    import equinox_dsv4 as ed

    useful = None  # a decode step's useful work depends on its context: not estimated
    if phase == "train" and getattr(args, "lora", None):
        # The frozen weights get no gradient: the forward and the activations' backward (the
        # adapters' own products are negligible).
        useful = 2 * ed.train.forward_flops(config, tokens, logits="all")
    elif phase == "train":
        useful = ed.train.train_flops(config, tokens)
    elif phase == "prefill":
        useful = ed.train.forward_flops(config, tokens)
    out = {"useful_flops": None if useful is None else useful * batch / devices}
    if chip is None or not args.unrolled or not row["flops"] or not row["bytes_accessed"]:
        return out | {"estimate_seconds": None, "mfu_estimate": None}
    seconds = max(
        row["flops"] / chip["bf16_flops_per_s"], row["bytes_accessed"] / chip["hbm_bytes_per_s"]
    )
    mfu = None if useful is None else out["useful_flops"] / seconds / chip["bf16_flops_per_s"]
    return out | {"estimate_seconds": seconds, "mfu_estimate": mfu}


def print_table(results: dict) -> None:
    gib = 2**30
    ideal = results["parameter_bytes_per_device_ideal"]
    chip = results["peak"]
    mfu = f"MFU upper bound ({chip['chip']} peak) |" if chip else ""
    print(
        "| phase | trace + lower | compile | arguments / device | (params / devices) "
        "| temporaries / device | outputs / device | code | FLOPs / device "
        f"| useful FLOPs / device |{mfu}"
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if chip else ""))
    for phase, r in results["phases"].items():
        flops = f"{r['flops']:.3g}" if r["flops"] else "n/a"
        useful = f"{r['useful_flops']:.3g}" if r["useful_flops"] else "n/a"
        if r["mfu_estimate"] is not None:
            bound = f" {r['mfu_estimate']:.1%} ({r['estimate_seconds']:.3g} s) |"
        elif chip and not r["flops"]:
            bound = " n/a (no FLOP count from this compiler) |"
        else:
            bound = " n/a (needs --unrolled) |" if chip else ""
        print(
            f"| {phase} ({r['tokens_per_sequence']} tok) | {r['trace_lower_seconds']:.1f} s "
            f"| {r['compile_seconds']:.1f} s | {r['argument_bytes'] / gib:.2f} GiB "
            f"| {ideal / gib:.2f} GiB (x{r['argument_bytes'] / ideal:.2f}) "
            f"| {r['temp_bytes'] / gib:.2f} GiB | {r['output_bytes'] / gib:.2f} GiB "
            f"| {r['generated_code_bytes'] / 2**20:.1f} MiB | {flops} | {useful} |{bound}"
        )
