"""Quantization recipes: which modules get which bit width and group size (``RECIPES``), and the
requested parameters as a ``Quantization`` that gives each module's (``params_for``) and mlx-lm's
``quantization`` config entry. convert.py applies them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import ConversionError

MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}  # (group size, bits)
BITS = (2, 3, 4, 5, 6, 8)  # the affine widths mx.quantize packs (mlx-lm's set)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: str = "affine"


# What mlx-vlm's DiffusionGemma quant_predicate gives the modules most sensitive to rounding.
SENSITIVE_PARAMS = QuantParams(group_size=64, bits=8)


def is_sensitive(path: str) -> bool:
    """Embeddings (also the output head), attention, router and dense MLP, by mlx-vlm's rule."""
    return (
        path.endswith(("embed_tokens", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
        or ".self_attn." in path
        or "router" in path
    )


@dataclass(frozen=True)
class Recipe:
    """Which parameters each module gets: the sensitive ones ``sensitive`` (None: the same as the
    others), the others ``bits`` (None: the requested --q-bits)."""

    name: str
    sensitive: QuantParams | None
    bits: int | None
    summary: str


RECIPES = {
    r.name: r
    for r in (
        Recipe(
            "mixed",
            SENSITIVE_PARAMS,
            None,
            "embeddings, attention, router and dense MLP at 8 bits, group 64; "
            "the experts and the self-conditioning MLP at --q-bits",
        ),
        Recipe("uniform", None, None, "every module at --q-bits"),
        # Named for the Mac whose GPU working set (about three quarters of its memory) holds the released
        # model's weights, a 256-position canvas and a few thousand tokens of context: docs/quantization.md.
        Recipe("mixed-16gb", SENSITIVE_PARAMS, 2, "mixed with the experts at 2 bits"),
        Recipe("mixed-24gb", SENSITIVE_PARAMS, 4, "mixed with the experts at 4 bits"),
        Recipe("mixed-32gb", SENSITIVE_PARAMS, 6, "mixed with the experts at 6 bits"),
    )
}


@dataclass(frozen=True)
class Quantization:
    """The requested parameters and a recipe (``RECIPES``): ``uniform`` quantizes every module with
    them; the ``mixed`` ones keep the sensitive modules at 8 bits, group 64, and use them for the
    experts and the self-conditioning MLP only."""

    default: QuantParams
    recipe: str = "mixed"

    @classmethod
    def from_flags(
        cls, bits: int | None = None, group_size: int | None = None, mode: str | None = None, recipe: str | None = None
    ) -> "Quantization":
        mode = mode or "affine"
        if mode not in MODE_DEFAULTS:
            raise ConversionError(f"unknown quantization mode {mode!r}; choose one of {', '.join(MODE_DEFAULTS)}")
        recipe = recipe or "mixed"
        if recipe not in RECIPES:
            raise ConversionError(f"unknown quantization recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        fixed = RECIPES[recipe].bits
        if fixed is not None and bits not in (None, fixed):
            raise ConversionError(
                f"--quant-predicate {recipe} quantizes the experts at {fixed} bits; drop --q-bits "
                f"{bits} or use --quant-predicate mixed"
            )
        if fixed is not None and mode != "affine":
            raise ConversionError(f"--quant-predicate {recipe} is affine; drop --q-mode {mode}")
        if bits is not None and bits not in BITS:
            raise ConversionError(
                f"--q-bits {bits} is not a width MLX quantizes to; choose one of {', '.join(map(str, BITS))}"
            )
        if group_size is not None and group_size not in GROUP_SIZES:
            raise ConversionError(
                f"--q-group-size {group_size} is not supported; choose one of {', '.join(map(str, GROUP_SIZES))}"
            )
        mode_group, mode_bits = MODE_DEFAULTS[mode]
        params = QuantParams(group_size or mode_group, bits or fixed or mode_bits, mode)
        if mode != "affine" and (params.group_size, params.bits) != (mode_group, mode_bits):
            raise ConversionError(f"--q-mode {mode} needs --q-group-size {mode_group} and --q-bits {mode_bits}")
        return cls(params, recipe)

    def params_for(self, path: str) -> QuantParams:
        sensitive = RECIPES[self.recipe].sensitive
        if sensitive is not None and is_sensitive(path):
            return sensitive
        return self.default

    def config(self, paths: list[str]) -> dict:
        """mlx-lm's ``quantization`` entry: the defaults, plus an override for each module that differs."""
        entry: dict = asdict(self.default)
        for path in sorted(paths):
            if (params := self.params_for(path)) != self.default:
                entry[path] = asdict(params)
        return entry

    def describe(self) -> str:
        return f"{self.recipe} {self.default.bits}-bit {self.default.mode} g{self.default.group_size}"
