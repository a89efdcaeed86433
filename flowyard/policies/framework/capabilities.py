"""What a global scheduler, or one part of a composed one, does beyond the methods of its role,
declared once by its class as a `Capabilities` value. `Composed` and the executors read the
declaration instead of probing for attributes by name, so a capability cannot be switched on
by an attribute that happens to share its name, and a reader sees every one in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capabilities:
    """Declared capabilities; the defaults are a part that does none of these."""

    # As a decode router: also asked where requests prefilled on MIXED instances decode
    # (Arrow's stateless instances); the global scheduler's `routes_decode`.
    routes_mixed: bool = False
    # As a splitter: the first micro-request's KV may be pushed chunk by chunk while it still
    # runs (DynaServe's overlapped push; the simulator prices it).
    chunked_kv: bool = True
    # Hears of every finished request through `on_finished` (DynaServe's length predictor,
    # flowyard's output-length window).
    learns: bool = False
    # Keeps a pool model in `pools` (None until its first use), which `Composed.pools` serves.
    has_pools: bool = False


NONE = Capabilities()


def capabilities_of(part: object) -> Capabilities:
    """The capabilities `part` declares (a class attribute or, when a config decides them, an
    instance attribute named `capabilities`); a part that declares none has none."""
    declared = getattr(part, "capabilities", NONE)
    if not isinstance(declared, Capabilities):
        raise TypeError(f"{type(part).__name__}.capabilities must be a Capabilities, got {declared!r}")
    return declared
