"""The execution policy: which form each computation takes on the backend a program is compiled
for.

The math is the same under every policy. A few computations have a second form that exists
only for one backend (XLA:CPU computes 16-bit floats in float32 and schedules breadth first),
or a kernel that suits one backend and not another (the routed experts); `Policy` says which
forms a program uses. It is fixed on the model, as `numerics` is: a static field of every
module that chooses a form, set across the tree by `with_policy`, which the model's jitted
entry points do with the policy of the platform the weights live on unless the model already
carries one. It is static, so each policy is its own compiled program, and a test can run any
policy on any machine. The forms themselves are this package's other modules;
docs/design.md says why each exists and what guards it.
"""

import copy
import dataclasses
import functools
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array

from .._typecheck import typechecked


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the layer loop, the routed experts and the primitives are laid out.

    - `platform`: what the policy was decided for (informative; the fields decide).
    - `widen_16bit`: the backend computes 16-bit floats in float32, converting operands first
      (XLA:CPU). Then 16-bit products take a float32 result (`linear_widened`), a few rows
      (`few_writes`) of a 16-bit cache are written as dynamic updates, not a scatter
      (`set_rows`), and a loop's 16-bit output buffer is held in float32 and rounded to 16
      bits as it leaves the loop (`held_dtype`: XLA:CPU converts a 16-bit buffer whole around
      each dynamic update of it).
    - `carry_stacks`: for the same reason, 16-bit layer stacks ride in a loop's carry, through
      a barrier, so that their conversion cannot be hoisted in front of the loop, whole.
    - `barrier_slices`: a layer loop fixes each layer's slice of the stacked weights behind an
      optimisation barrier before the layer reads it, so that no conversion of a weight (a
      16-bit widening, a dequantisation) is moved in front of the slicing and out of the
      loop, onto the whole stack. The barrier makes the slice a copy.
    - `late_slices`: the scheduler creates values as early as it can (XLA:CPU's breadth-first
      default). Then an unrolled loop over stacked layers takes layer `r`'s slices only once
      the residual streams exist.
    - `group_matmuls`: the attention's grouped output projection runs as one matmul per group
      (XLA:CPU runs the batched einsum as per-token matmuls), except for `few_tokens` or fewer
      (a decode step), where the batched einsum reads `wo_a` as stored; 16-bit ones always.
    - `blocked_argmax`: greedy sampling takes block maxima of an order-preserving integer key,
      then an argmax inside the winning block (XLA:CPU's argmax is a scalar reduction).
    - `experts`: the routed experts' form for many assignments (a prefill, a train step):
      `"loop"`, a loop over experts on rows sorted by expert with its gradient written out
      (`expert_mlps`; XLA:CPU's), or `"ragged"`, `jax.lax.ragged_dot` on the same sorted rows
      (every other platform's; dense weights only: quantised ones take the loop, which
      dequantises one expert at a time).
    - `gather_experts`: decoding's routed experts gather the chosen experts' weights and batch
      the products, instead of a loop over assignments. Set by the layer loop for a scanned
      stack, whose expert weights are slices (values, which a loop would copy whole), not by
      the platform.
    - `expert_buffer`: under expert parallelism with many assignments, a device runs the
      assignments to its own experts (about `1 / mesh["expert"]` of its tokens') at most this
      many times that even share at once, in the ragged form, in as many rounds as they
      need: dropless, with buffers that follow its own assignments, not every one of its
      tokens' (0: all of its tokens' assignments in one buffer, its own ones grouped first).
    - `experts_stay`: under expert parallelism, many assignments (a prefill, a train step)
      travel to the experts' weights too, as a decode step's do, and run in rounds of each
      device's own assignments (`expert_buffer`), instead of each device gathering its
      experts' weights over `fsdp`, where fewer rows would travel that way: the `fsdp`
      group's tokens and a round's rows against the local experts' weights' (ragged form,
      dense weights whose hidden units split over `fsdp`).
    - `expert_exchange`: under expert parallelism, many assignments (a prefill, a train
      step) travel by `all_to_all` to the devices that own their experts and back
      (`execution/_exchange.py`), the experts split whole over `expert` and `fsdp` (the
      `experts` rule `("expert", "fsdp")`) and the tokens over the same axes: each row goes
      to one device, and each expert's slots hold `expert_buffer` times its even share of
      a device's rows (0: every row it could receive), in as many rounds as they need.
      Dense weights without `tensor` splits; otherwise the forms above. A model whose routed
      experts are placed so resolves to it (`DeepseekV4.resolved_policy`).
    - `stationary_rows`: under expert parallelism, the assignments (all devices) up to which
      the tokens travel to the experts' weights instead of the weights being gathered.
    - `stationary_tokens`: up to this many tokens at a block boundary (batch x chunk: a
      decode step), the dense weights stay where they are and the activations travel: the
      activations are split along `d_model` as the weights are (`constrain_batch`), not
      along the batch.
    - `split_chunks`: a chunk of at least this many tokens per sequence (a prefill, a train
      step; 0: none) is split along the sequence over `expert` as well as along the batch at
      the block boundaries, so that the attention, the mHC and the norms of a sequence run
      on every chip of its `expert` row, each on its share of the tokens, instead of on all
      of them alike. XLA moves what a chip needs across the split (the window and the
      compressed entries before its tokens).
    - `picks_in_place`: a short chunk's (a decode step's) picked compressed entries are
      gathered straight from the cache's stack where a CSA layer holds at least this many
      entries per pick (0: always), else from the layer's entries sliced out of it (a copy
      of them all, which XLA's TPU compiler does not fuse into the gather: with a long
      context, most of a decode step's traffic). Below it the copy is small, and the TPU
      compiler offloads a gather from the stack to its SparseCores and charges it the whole
      stack per layer.
    - `experts_in_place`: a decode step's layer loop hands each layer's routed experts the
      whole stacked weights with the layer's index (a view, `Experts.layer`), and the forms
      that read only the chosen experts read them from the stack in place. Otherwise the
      loop takes each layer's slice of every expert first, which XLA's TPU compiler copies
      whole (one sequence with a long context: most of the step's traffic) before reading
      the chosen experts from the copy.
    - `attention_kernel`: a long chunk's (a prefill's, a train step's) attention over its
      window and its compressed entries as one Pallas kernel that keeps each block's logits
      and probabilities on the core (`attend_blocks`), instead of writing them to memory and
      reading them back; its gradient is the plain form's. Off TPUs it runs in Pallas'
      interpreter (tests).
    - `gather_in_steps`: a dense weight that a product over many tokens (more than
      `stationary_tokens`) reads whole, on a mesh of at least this many `fsdp x expert`
      chips (0: none), is gathered one mesh axis at a time (`gathered_in_steps`), not over
      every chip at once, which XLA's TPU compiler does there as an all-reduce of a
      zero-filled whole weight. On fewer chips it gathers them directly, for less.
    - `rolled_sinkhorn`: the mHC Sinkhorn rounds as a loop rather than unrolled. XLA's GPU
      compiler tries to tile every unrolled normalisation as a Triton fusion, which for
      V4's rounds at every mHC site makes a full-size compile impractically slow
      (docs/design.md); GPUs' policy.
    """

    platform: str = "generic"
    widen_16bit: bool = False
    carry_stacks: bool = False
    barrier_slices: bool = True
    late_slices: bool = False
    group_matmuls: bool = False
    blocked_argmax: bool = False
    experts: Literal["loop", "ragged"] = "loop"
    gather_experts: bool = False
    expert_buffer: int = 0
    experts_stay: bool = False
    expert_exchange: bool = False
    few_writes: int = 16
    few_tokens: int = 16
    stationary_rows: int = 64
    stationary_tokens: int = 0
    split_chunks: int = 0
    picks_in_place: int = 8
    experts_in_place: bool = False
    rolled_sinkhorn: bool = False
    attention_kernel: bool = False
    gather_in_steps: int = 0

    def __post_init__(self):
        if self.experts not in ("loop", "ragged"):
            raise ValueError(f"Policy.experts must be 'loop' or 'ragged', got {self.experts!r}")
        counts = (
            "expert_buffer",
            "few_writes",
            "few_tokens",
            "stationary_rows",
            "stationary_tokens",
            "split_chunks",
            "picks_in_place",
            "gather_in_steps",
        )
        for name in counts:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Policy.{name} must be an int, got {value!r}")

    @classmethod
    def for_platform(cls, platform: str) -> "Policy":
        """The policy for programs compiled for `platform` (`"cpu"`, `"gpu"`, `"tpu"`, ...): the
        plain forms and `ragged_dot` for the routed experts (on GPUs the Sinkhorn rounds as a
        loop, `rolled_sinkhorn`; on TPUs no barrier on the layers' slices and decode steps'
        tokens travelling to the dense weights, `stationary_tokens`), except on XLA:CPU, whose
        forms are its own and whose experts run the loop (`ragged_dot` measured far slower
        there)."""
        if platform == "tpu":
            # By the TPU compiler's count (benchmarks/tpu_roofline.py): without the barrier
            # the layer loop's slices are read in place; a decode step's tokens travel to the
            # dense weights, and up to 64 sequences' to the experts' weights; a prefill's
            # sequences split over `expert` too; a device's own assignments run twice their
            # even share at a time; a long chunk's attention keeps its logits on the core.
            return cls(
                platform,
                experts="ragged",
                expert_buffer=2,
                experts_stay=True,
                barrier_slices=False,
                stationary_tokens=64,
                stationary_rows=512,
                split_chunks=1024,
                experts_in_place=True,
                attention_kernel=True,
                gather_in_steps=64,
            )
        if platform != "cpu":
            return cls(platform, experts="ragged", rolled_sinkhorn=platform == "gpu")
        return cls(
            platform,
            widen_16bit=True,
            carry_stacks=True,
            late_slices=True,
            group_matmuls=True,
            blocked_argmax=True,
        )

    @classmethod
    def for_arrays(cls, *trees: Any) -> "Policy":
        """The policy for the platform that the arrays in `trees` live on (`platform_of`)."""
        return cls.for_platform(platform_of(*trees))

    def narrow(self, *arrays: Array) -> bool:
        """Whether any of `arrays` is a 16-bit float that the backend widens (`widen_16bit`)."""
        return self.widen_16bit and any(_is_16bit(a.dtype) for a in arrays)

    def held_dtype(self, dtype: DTypeLike) -> jnp.dtype:
        """The dtype a loop holds an output buffer of `dtype` values in, updated a block at a
        time: float32 for a 16-bit float the backend widens (`widen_16bit`), else `dtype`."""
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.float32) if self.widen_16bit and _is_16bit(dtype) else dtype

    def carries(self, *arrays: Array) -> bool:
        """Whether a loop over stacks holding `arrays` carries them (`carry_stacks`: some are
        16-bit floats)."""
        return self.carry_stacks and any(_is_16bit(a.dtype) for a in arrays)


def _is_16bit(dtype: jnp.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def resolve(policy: Policy | None) -> Policy:
    """`policy`, or where it is `None` (a module used before `with_policy`, or on its own) the
    policy of the platform the computation compiles for (`platform_of`)."""
    return Policy.for_platform(platform_of()) if policy is None else policy


@typechecked
def with_policy(tree: T, policy: Policy | None) -> T:
    """`tree` with the `policy` field of every module in it set to `policy` (`None`: decided
    per computation from the platform), as `eqx.nn.inference_mode` sets `inference`. The
    field is static: a model carries its policy into the key of every compiled program."""
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy or None, got {type(policy).__name__}")

    def visit(node: Any) -> Any:
        if isinstance(node, tuple | list):
            items = [visit(item) for item in node]
            changed = any(new is not old for new, old in zip(items, node, strict=True))
            return type(node)(items) if changed else node
        if not isinstance(node, eqx.Module):
            return node
        changes = {}
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.name == "policy" and field.metadata.get("static", False):
                if value != policy:
                    changes[field.name] = policy
            elif not field.metadata.get("static", False):
                new = visit(value)
                if new is not value:
                    changes[field.name] = new
        if not changes:
            return node
        # A static field is part of the pytree's structure, which `eqx.tree_at` cannot
        # change: the module is copied and its fields set on the copy.
        node = copy.copy(node)
        for name, value in changes.items():
            object.__setattr__(node, name, value)
        return node

    return visit(tree)


def policy_field() -> Any:
    """The `policy` field of a module that chooses forms: static, `None` until `with_policy`
    (its `__init__` sets it to `None`, as it sets every field)."""
    return eqx.field(static=True)


def platform_of(*trees: Any) -> str:
    """The platform of the computation on these arrays: the platform of the context mesh
    (`jax.set_mesh`, so that an ahead-of-time compile for a TPU topology from a CPU host is a
    TPU program), else of the first concrete array or sharded `ShapeDtypeStruct` among the
    leaves, else JAX's default backend (tracers carry no devices)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and device.platform:
        return device.platform
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return next(iter(leaf.devices())).platform
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.ShapeDtypeStruct) and isinstance(sharding, jax.sharding.Sharding):
            devices = getattr(sharding, "device_set", None)
            if devices:
                return next(iter(devices)).platform
    return jax.default_backend()


def error_if(x: Any, pred: Array, message: str) -> Any:
    """`eqx.error_if(x, pred, message)`: `x`, and a runtime error if `pred` holds, raised on
    the host by a callback. Left out of a program for GPUs compiled on a machine without one
    (`python -m equinox_dsv4.compile --topology h100:8`): no host callback can be lowered
    without the GPU's runtime, and such a program is compiled to be measured, not run."""
    if platform_of(x) == "gpu" and not _gpu_runtime():
        return x
    return eqx.error_if(x, pred, message)


@functools.cache
def _gpu_runtime() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend in this process (JAX_PLATFORMS, or no GPU)
        return False
