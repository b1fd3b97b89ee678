"""The training recipe: which GEMMs run in FP4 and how they are quantized."""

from __future__ import annotations

import dataclasses
import fnmatch
import numbers
from typing import Optional, Sequence, Union

BlockCount = Union[int, float, None]

FORMATS = ("nvfp4", "mxfp4")
BLOCK_SCALE_RULES = ("6", "4/6")
HIGH = "high"
_BOOL_FIELDS = ("rht", "stochastic_rounding", "weight_2d", "quantize_backward", "check_finite",
                "high_precision_outside_blocks", "include_activation_matmuls", "decoded_operands", "share_weight",
                "allow_emulation", "high_precision_routers")
_INT_FIELDS = ("rht_size", "seed", "switch_to_high_precision_at", "amax_history")
_OPTIONAL_FIELDS = ("decoded_operands", "seed", "switch_to_high_precision_at")  # None is allowed


@dataclasses.dataclass(frozen=True)
class Recipe:
    """NVFP4 training recipe (defaults reproduce the published 12B/10T-token recipe).

    fmt: "nvfp4" (E2M1 + E4M3 scales per 16 + FP32 tensor scale) or "mxfp4" (E8M0 scales per 32).
    rht: 16x16 random Hadamard transform on both operands of the weight-gradient GEMM.
    stochastic_rounding: SR for gradients (dY in dgrad and wgrad); everything else rounds to nearest even.
    weight_2d: 16x16 tile scaling of weights, so fprop and dgrad see one quantized weight.
    high_precision_first_blocks / high_precision_last_blocks: blocks kept in high precision at each end;
        an int is a count, a float in (0, 1) a fraction of the blocks, None the recipe's proportions
        (first max(1, round(n*2/62)), last max(1, round(n*8/62)) of n blocks).
    high_precision_modules: fnmatch patterns of site names kept in high precision (lm_head, embeddings).
    high_precision_outside_blocks: keep every GEMM outside the model's repeated blocks in high precision
        (the output layer whatever its name, a tied embedding head, projections before the first block).
    quantize_backward: False quantizes the forward (fprop) GEMMs only.
    seed: None (default): stochastic rounding draws from torch's generator (``torch.manual_seed``
        governs it, as it governs dropout); an int makes it fp4compile's own stream, the same bits
        whatever torch's seed (``fp4compile.manual_seed`` resets that stream's step).
    switch_to_high_precision_at: step (see ``Backend.step``) from which every GEMM runs in high
        precision, the recipe's "switch to BF16 before the end" schedule; recompiles once.
    check_finite: raise an error naming the layer, GEMM role and operand when a quantized tensor holds
        NaN or Inf (costs a device-to-host sync per quantized tensor).
    include_activation_matmuls: experimental; also run explicit products of two activations (``q @ k.mT``,
        ``probs @ v`` with ``matmul``/``mm``/``bmm``, 2-D to 4-D) as FP4 GEMM sites, both operands in
        1x16 blocks. Fused ``scaled_dot_product_attention`` stays in high precision.
    decoded_operands: for emulated NVFP4 GEMMs on CUDA (no effect elsewhere): each operand's quantizer
        writes it decoded to BF16 for the GEMM (pass ``lower_gemms``) instead of packed codes
        that are decoded right before it. Same bits and one pass over memory less per operand, but
        decoded operands are 3.6x the size of packed ones while they wait for their GEMM. None (the
        default): on where Inductor records the steps in CUDA graphs (the backend's
        ``mode="reduce-overhead"`` or ``"max-autotune"``, or Inductor's global setting), where it
        measured faster, off otherwise (docs/emulation.md).
    high_precision_routers: keep mixture-of-experts routers (a GEMM whose output feeds a top-k) and
        shared-expert gates (one output through a sigmoid) in high precision (pass ``keep_routers_high``).
    share_weight: with NVFP4 16x16 weights and FP4 backward GEMMs, quantize each weight once per step:
        the forward's quantization serves fprop and, transposed in packed form
        (``fp4.transpose_quantized``), dgrad, and the backward keeps the packed weight (0.56 bytes per
        parameter) instead of quantizing W^T again. Same bits either way (NUMERICS: quantizing W and
        W^T gives the same codes, transposed); False quantizes W in each GEMM and keeps nothing. Planned
        on the joint graph (``plan_sharing``): where the graph has no dgrad for a linear (its input needs
        no gradient), W is quantized per GEMM.
    amax_history: how many training forwards the activation range of each FP4 layer is kept over
        (``fp4compile.ranges``): the fprop quantizer's amax of the layer's input is recorded on the
        device by every forward compiled with gradients, and ``export(scheme="NVFP4")`` takes the
        maximum over the last ``amax_history`` of them as the input's global scale. 0 records nothing.
    allow_emulation: on a Blackwell GPU (compute capability 10.x), let FP4 GEMMs that cannot run on a
        CUTLASS kernel (a shape or format the kernels do not take, a failed build, load or first-use
        self-test) run in emulation, with one ``PlanWarning`` per reason. False (the default): such a
        GEMM is an error naming the reason. No effect on other devices, where emulation is the kernel.
    block_scale_rule: NVFP4's block scale rule for every FP4 operand: "6" (the recipe's: each block's
        maximum scaled to 6) or "4/6" (Four Over Six: each block scaled to 6 or to 4, whichever has the
        smaller squared error after dequantization; the per-tensor scale maps amax to 6 x 256, which
        dequantization, the GEMMs' alpha and export follow; docs/numerics.md). One rule for all roles: the
        weight quantized once serves fprop and dgrad, and a GEMM's alpha takes both operands' constant.
        MXFP4 takes "6" only. CUTLASS kernels compute alpha for "6": with "4/6" GEMMs run emulated.
    """

    fmt: str = "nvfp4"
    rht: bool = True
    rht_size: int = 16
    stochastic_rounding: bool = True
    weight_2d: bool = True
    high_precision_first_blocks: BlockCount = None
    high_precision_last_blocks: BlockCount = None
    high_precision_modules: Sequence[str] = ("lm_head", "*.lm_head", "*embed*", "*wte", "*wpe")
    high_precision_outside_blocks: bool = True
    quantize_backward: bool = True
    seed: Optional[int] = None
    switch_to_high_precision_at: Optional[int] = None
    check_finite: bool = False
    include_activation_matmuls: bool = False
    decoded_operands: Optional[bool] = None
    share_weight: bool = True
    amax_history: int = 16
    allow_emulation: bool = False
    high_precision_routers: bool = True
    block_scale_rule: str = "6"

    def __post_init__(self):
        # Every field is checked here, so that a wrong value (a string "false", which is truthy) fails
        # at once, naming the field, instead of silently changing the recipe or failing while compiling.
        if not isinstance(self.fmt, str) or self.fmt not in FORMATS:
            raise ValueError(f"Recipe.fmt must be one of {FORMATS}, got {self.fmt!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name in _OPTIONAL_FIELDS and value is None):
                accepts = "True, False or None" if name in _OPTIONAL_FIELDS else "True or False"
                raise TypeError(f"Recipe.{name} must be {accepts}, got {value!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                accepts = "an int or None" if name in _OPTIONAL_FIELDS else "an int"
                raise TypeError(f"Recipe.{name} must be {accepts}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.switch_to_high_precision_at is not None and self.switch_to_high_precision_at < 0:
            raise ValueError(f"Recipe.switch_to_high_precision_at must be a step >= 0 or None, got {self.switch_to_high_precision_at}")
        if self.amax_history < 0:
            raise ValueError(f"Recipe.amax_history must be a number of steps >= 0 (0: no recording), got {self.amax_history}")
        if not isinstance(self.block_scale_rule, str) or self.block_scale_rule not in BLOCK_SCALE_RULES:
            raise ValueError(f"Recipe.block_scale_rule must be one of {BLOCK_SCALE_RULES}, got {self.block_scale_rule!r}")
        if self.block_scale_rule != "6" and self.fmt != "nvfp4":
            raise ValueError(
                f"Recipe.block_scale_rule={self.block_scale_rule!r} (Four Over Six) is an NVFP4 rule; fmt={self.fmt!r} "
                "has power-of-two block scales and no per-tensor scale: use block_scale_rule='6' with it"
            )
        if self.rht_size != 16:
            raise ValueError(f"Recipe.rht_size: only 16-point transforms are supported, got {self.rht_size}")
        for name in ("high_precision_first_blocks", "high_precision_last_blocks"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"Recipe.{name} must be a count >= 0, a fraction in (0, 1) or None, got {value!r}")
            if isinstance(value, float) and not 0 <= value < 1:
                raise ValueError(f"Recipe.{name}: a float is a fraction of the blocks in [0, 1), got {value}")
        modules = self.high_precision_modules
        modules = (modules,) if isinstance(modules, str) else modules
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
            raise TypeError(
                f"Recipe.high_precision_modules must be a module-path pattern or a list of them (str), got {modules!r}"
            )
        object.__setattr__(self, "high_precision_modules", tuple(modules))

    @property
    def weight_block(self) -> str:
        if self.fmt == "mxfp4":
            return "1x32"
        return "16x16" if self.weight_2d else "1x16"

    @property
    def activation_block(self) -> str:
        return "1x32" if self.fmt == "mxfp4" else "1x16"

    @property
    def block_size(self) -> int:
        return 32 if self.fmt == "mxfp4" else 16

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    def high_precision_block_counts(self, n_blocks: int) -> tuple[int, int]:
        """(first, last) numbers of blocks kept in high precision for a model of ``n_blocks`` blocks."""

        def resolve(value, default_share):
            if value is None:
                return max(1, round(n_blocks * default_share)) if n_blocks else 0
            if isinstance(value, float):
                return round(n_blocks * value)
            return int(value)

        first = resolve(self.high_precision_first_blocks, 2 / 62)
        last = resolve(self.high_precision_last_blocks, 8 / 62)
        return min(first, n_blocks), min(last, n_blocks)

    def matches_high_precision_module(self, name: str) -> Optional[str]:
        for pattern in self.high_precision_modules:
            if fnmatch.fnmatchcase(name, pattern):
                return pattern
        return None

    @classmethod
    def from_options(cls, options: Optional[dict]) -> "Recipe":
        """A recipe from ``torch.compile(..., options={...})``: Recipe fields by name, or "recipe"."""
        options = dict(options or {})
        if "recipe" in options:
            recipe = options.pop("recipe")
            if not isinstance(recipe, Recipe):
                raise TypeError(f"options['recipe'] must be a fp4compile.Recipe, got {type(recipe).__name__}")
            return recipe.replace(**options) if options else recipe
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"unknown nvfp4 backend options {unknown}; Recipe fields are {sorted(fields)}")
        return cls(**options)
