"""Fine-tune DeepSeek-V4 on a text file with optax; resumable.

The text is tokenised with the real DeepSeek-V4 tokenizer and cut into consecutive windows of
`--seq-len + 1` tokens. Each step trains on `--batch` windows: next-token cross-entropy, the MTP
loss (when the model has an MTP block), the sequence-wise balance loss, and the
auxiliary-loss-free router-bias update. AdamW with warmup and cosine decay, clipped gradients.

Every `--save-every` steps (and at the end) the train state (parameters, optimizer state, step
and data position) is saved to `OUT/train_state`; running the same command again resumes from
it exactly (`--stop-after N` ends a run early on purpose, e.g. to fit a job's time slot). At
the end (or at `--stop-after`) the model is also saved to `OUT/model`, loadable with
`examples/generate.py --checkpoint OUT/model`.

With no model argument it trains the embedded tiny default from a seeded random init.

`--lora RANK` trains low-rank adapters instead (`ed.lora`: LoRA, or QLoRA over a checkpoint's
FP8/FP4 weights, kept quantised): the base stays as loaded, the optimizer holds the adapters'
moments only, and the end of the run saves the adapter alone to `OUT/adapter` in PEFT's
layout, for `examples/generate.py --lora OUT/adapter` (or transformers + peft).
"""

import argparse
import contextlib
import pathlib
import shutil
import sys
import time

import jax
import numpy as np
from _common import add_model_arguments, load_model, new_parser, run_reporting_errors, say
from tqdm import tqdm

import equinox_dsv4 as ed


ROOT = pathlib.Path(__file__).resolve().parent.parent


def windows(tokens: np.ndarray, seq_len: int, batch: int, position: int) -> np.ndarray:
    """Batch number `position`: `batch` consecutive windows of `seq_len + 1` tokens (each
    overlapping the next by one), wrapping around the text."""
    n = len(tokens) - 1
    starts = (np.arange(batch) + position * batch) * seq_len % max(1, n - seq_len + 1)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts])


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model_arguments(parser)
    parser.add_argument("--text", default=str(ROOT / "README.md"), help="training text file")
    parser.add_argument("--out", default="runs/train", help="run directory (state, model)")
    parser.add_argument("--steps", type=int, default=100, help="total steps (resume included)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--balance-weight", type=float, default=1e-4)
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="router-bias update step")
    parser.add_argument(
        "--remat",
        choices=("none", *ed.train.REMAT_POLICIES),
        default="dots",
        help="per-layer remat",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="gradient accumulation: split each batch into this many micro-batches",
    )
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="end this run after N steps, saving the state and the model (to fit a job's time "
        "slot); running the command again resumes, on the same learning-rate schedule",
    )
    parser.add_argument(
        "--fsdp",
        type=int,
        help="FSDP over this many devices (default: 1, or all devices with several processes)",
    )
    parser.add_argument("--layers", type=int, help="default model: keep the first N layers")
    parser.add_argument(
        "--lora", type=int, metavar="RANK", help="train LoRA adapters of this rank, not the model"
    )
    parser.add_argument(
        "--lora-alpha", type=float, metavar="A", help="LoRA scale numerator (default: RANK)"
    )
    parser.add_argument(
        "--lora-targets",
        nargs="+",
        choices=tuple(ed.lora.TARGETS),
        metavar="NAME",
        help=f"weights to adapt (default: all of {', '.join(ed.lora.TARGETS)})",
    )
    ed.parallel.add_distributed_arguments(parser)
    return run_reporting_errors(run, parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.steps <= 0 or args.batch <= 0 or args.seq_len <= 0 or args.save_every <= 0:
        raise ValueError("--steps, --batch, --seq-len and --save-every must be positive")
    if args.stop_after is not None and args.stop_after <= 0:
        raise ValueError(f"--stop-after must be positive, got {args.stop_after}")
    if args.lora is not None and args.lora <= 0:
        raise ValueError(f"--lora must be a positive rank, got {args.lora}")
    if args.lora is None and (args.lora_alpha is not None or args.lora_targets):
        raise ValueError("--lora-alpha and --lora-targets need --lora RANK")
    if args.micro_batches <= 0 or args.batch % args.micro_batches:
        raise ValueError(
            f"--batch {args.batch} does not split into {args.micro_batches} micro-batches"
        )
    text = pathlib.Path(args.text).read_text()
    tokens = np.asarray(ed.encode_text(text), np.int32)
    if len(tokens) < args.seq_len + 1:
        raise ValueError(f"{args.text}: {len(tokens)} tokens, fewer than --seq-len + 1")
    out = pathlib.Path(args.out)
    state_dir = out / "train_state"

    t0 = time.perf_counter()
    fsdp = args.fsdp or (jax.device_count() if jax.process_count() > 1 else 1)
    mesh = None
    if fsdp > 1:
        if args.batch % fsdp:
            raise ValueError(f"--batch {args.batch} is not divisible by the fsdp size {fsdp}")
        mesh = ed.make_mesh(fsdp=fsdp)
    model, source = load_model(args, layers=args.layers, mesh=mesh)
    say(f"model: {source} ({time.perf_counter() - t0:.1f} s)")
    if args.lora is not None:
        key = jax.random.key(args.seed + 1)
        # On a mesh the factors are created beside their weights (`ed.lora.add` places them).
        model = ed.lora.add(
            model, rank=args.lora, alpha=args.lora_alpha, targets=args.lora_targets, key=key
        )
        say(f"LoRA: rank {args.lora}, targets {', '.join(args.lora_targets or ed.lora.TARGETS)}")
    say(f"data: {args.text}, {len(tokens)} tokens")

    optimizer = ed.make_optimizer(
        args.lr,
        warmup_steps=min(args.warmup, args.steps - 1),
        total_steps=args.steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip,
    )
    step_fn = ed.make_train_step(
        optimizer,
        mtp_weight=args.mtp_weight,
        balance_weight=args.balance_weight,
        bias_update_rate=args.bias_rate,
        remat=None if args.remat == "none" else args.remat,
        micro_batches=args.micro_batches,
    )
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        state = ed.init_train_state(model, optimizer)
        position = 0
        if (state_dir / "train_state.json").is_file():
            state, position = ed.train.restore_train_state(state_dir, state)
            say(f"resumed at step {int(state.step)} from {state_dir}")
        start = int(state.step)
        if start >= args.steps:
            say(f"already trained {start} >= --steps {args.steps} steps")
            return 0

        stop = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
        bar = tqdm(
            total=args.steps,
            initial=start,
            desc="train",
            unit="step",
            file=sys.stderr,
            disable=not ed.parallel.is_primary(),
        )
        seen, timed_from = 0, None
        for step in range(start, stop):
            batch = ed.Batch.from_tokens(windows(tokens, args.seq_len, args.batch, position))
            state, metrics = step_fn(state, batch)
            position += 1
            loss = float(metrics["loss"])  # waits for the step
            if timed_from is None:  # the first step includes compilation
                timed_from = time.perf_counter()
            else:
                seen += args.batch * args.seq_len
            rate = seen / max(time.perf_counter() - timed_from, 1e-9)
            bar.set_postfix(
                loss=f"{loss:.3f}", lm=f"{float(metrics['lm']):.3f}", tok_s=f"{rate:.0f}"
            )
            bar.update(1)
            if (step + 1) % args.save_every == 0 or step + 1 == stop:
                ed.train.save_train_state(state_dir, state, data_position=position)
        bar.close()

    if args.lora is not None:
        model_dir = out / "adapter"
        ed.lora.save(state.model, model_dir)  # every process: the adapters are gathered
    else:
        model_dir = out / "model"
        if ed.parallel.is_primary():
            shutil.rmtree(model_dir, ignore_errors=True)
        ed.parallel.barrier("examples-train-old-model-removed")
        ed.save(model_dir, state.model)
    say(
        f"trained steps {start}..{stop} of {args.steps}: final loss {loss:.4f}, "
        f"{rate:.0f} tokens/s after the first step; state in {state_dir}, "
        f"{'adapter' if args.lora is not None else 'model'} in {model_dir}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
