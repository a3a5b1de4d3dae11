"""The GGUF side of the model families: which family reads a file (its
`general.architecture`), the config from the header's keys and the plan of its tensors,
checked against the header. The families themselves (their keys, names and shapes) live
in their own files in models/; nothing here is specific to one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from toy.errors import InputError
from toy.formats.gguf_header import GGUFHeader, _show
from toy.models import registry
from toy.models.family import Arch, BadConfig, Family, Keys, Planned


@dataclass(frozen=True)
class GGUFFamily:
    """A GGUF architecture as toy reads it: the family's way with that architecture."""

    name: str  # general.architecture (llama, qwen3, gemma3, ...)
    family: Family
    arch: Arch

    @property
    def model(self) -> type:
        return self.family.model

    @property
    def targets(self) -> tuple[str, ...]:
        return self.family.targets

    @property
    def default_targets(self) -> str:
        return self.family.default_targets

    @property
    def chat_format(self) -> str | None:
        return self.arch.chat_format

    def config(self, h: GGUFHeader) -> Any:
        try:
            return self.arch.config(keys(h))
        except BadConfig as e:
            raise InputError(f"{h.path}: {e}")

    def plan(self, cfg) -> dict[str, Planned]:
        return self.arch.plan(cfg)


def keys(h: GGUFHeader) -> Keys:
    return Keys(h.metadata, {n: ti.shape for n, ti in h.tensors.items()})


@cache
def gguf_families() -> dict[str, GGUFFamily]:
    """general.architecture -> GGUFFamily, for every architecture a family reads."""
    return {
        name: GGUFFamily(name, fam, arch)
        for name, (fam, arch) in sorted(registry.gguf_archs().items())
    }


def supported_archs() -> tuple[str, ...]:
    return tuple(gguf_families())


def family_of(h: GGUFHeader) -> GGUFFamily:
    """The family of a model GGUF; an InputError naming the architecture and the
    supported ones otherwise (an adapter file is refused here too)."""
    arch = h.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise InputError(
            f"{h.path}: GGUF key 'general.architecture' is missing; the file is not a GGUF model"
        )
    if h.metadata.get("general.type") == "adapter":
        raise InputError(
            f"{h.path}: is a LoRA adapter GGUF, not a model; pass the base model's GGUF here"
        )
    fams = gguf_families()
    if arch not in fams:
        raise InputError(
            f"{h.path}: architecture {_show(arch)} is not supported; supported: "
            f"{', '.join(fams)} (`toy describe` still shows what the file holds)"
        )
    return fams[arch]


def check_plan(h: GGUFHeader, plan: dict[str, Planned], arch: str, n_layer: int) -> None:
    """The header's tensors are exactly the plan's, each with the planned shape (names and
    shapes only: nothing read). The first misfit is named."""
    missing = [g for g in plan if g not in h.tensors]
    if missing:
        more = f" ({len(missing)} missing in all)" if len(missing) > 1 else ""
        raise InputError(
            f"{h.path}: missing tensor {missing[0]!r}{more}; the file is not a complete {arch} "
            f"model with {n_layer} layers"
        )
    extra = [n for n in h.tensors if n not in plan]
    if extra:
        raise InputError(
            f"{h.path}: unexpected tensor {_show(extra[0])} ({len(extra)} in all); toy's {arch} "
            "has no place for it (a different architecture or an unsupported variant)"
        )
    for gname, p in plan.items():
        found = h.tensors[gname].shape
        if found != p.shape:
            raise InputError(
                f"{h.path}: misshapen tensor {gname!r}: expected {list(p.shape)}, found "
                f"{list(found)} (torch order, out x in); the header's hyper-parameters do not "
                "match the weights"
            )
