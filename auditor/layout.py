"""Rank layouts: how a rank's number maps to its coordinates (DESIGN.md §3.1).

A leaf module (stdlib only) shared by the trainer side, which computes coordinates from an
explicit topology, and the service, which checks that a report's coordinates follow its
``order`` and names missing ranks from it.

Two factorisations of one world (Megatron-core 0.16, ``parallel_state.initialize_model_parallel``):
dense ``(dp, cp, tp, pp)`` and expert ``(edp, ep, etp, pp)``. Both are laid out by one
``order`` string, fastest-varying dim first (Megatron's default ``"tp-cp-ep-dp-pp"``): the
dense layout uses its tokens without ``ep``; the expert layout (Megatron's expert
``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)``) uses them without
``cp``, with ``tp`` read as ``etp`` and ``dp`` as ``edp``. Then

    rank = Σᵢ c(tᵢ) · Πⱼ<ᵢ s(tⱼ)     over the tokens t₁, t₂, … of the layout, fastest first

(the inverse of Megatron's ``generate_masked_orthogonal_rank_groups`` decomposition).
"""

from __future__ import annotations

from typing import Mapping

DENSE_DIMS: tuple[str, ...] = ("dp", "cp", "tp", "pp")
EXPERT_DIMS: tuple[str, ...] = ("edp", "ep", "etp", "pp")
#: Every dim a report may carry, in wire order.
ALL_DIMS: tuple[str, ...] = ("dp", "cp", "tp", "pp", "edp", "ep", "etp")
#: Dims only the expert factorisation has.
EXPERT_ONLY: frozenset[str] = frozenset({"edp", "ep", "etp"})
#: Dims only the dense factorisation has.
DENSE_ONLY: frozenset[str] = frozenset({"dp", "cp", "tp"})
#: ``initialize_model_parallel``'s default ``order``.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_TOKENS = ("tp", "cp", "ep", "dp", "pp")
_EXPERT_NAME = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}


def parse_order(order: str) -> tuple[str, ...]:
    """Tokens of a Megatron order string, fastest first: ``"tp-cp-ep-dp-pp"`` →
    ``("tp", "cp", "ep", "dp", "pp")``.

    Raises
    ------
    ValueError
        A token other than tp, cp, ep, dp, pp; a token twice; or one of tp, cp, dp, pp
        missing (``ep`` may be left out when ep = 1).
    """
    tokens = tuple(t.strip().lower() for t in order.split("-"))
    unknown = [t for t in tokens if t not in _TOKENS]
    if unknown:
        raise ValueError(f"order {order!r}: unknown dim {unknown[0]!r}; tokens are {'-'.join(_TOKENS)}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"order {order!r} names a dim twice")
    missing = [t for t in ("tp", "cp", "dp", "pp") if t not in tokens]
    if missing:
        raise ValueError(f"order {order!r} lacks {', '.join(missing)}")
    return tokens


def canonical_order(order: str | None) -> str | None:
    """The order string as :func:`parse_order` reads it, written back: lower case, no
    spaces (``" TP - CP - DP - PP "`` → ``"tp-cp-dp-pp"``), so that two spellings of one
    order are one topology; None stays None. Raises what :func:`parse_order` raises."""
    return None if order is None else "-".join(parse_order(order))


def layout(order: str, factorisation: str) -> tuple[str, ...]:
    """The wire dims of ``factorisation`` (``"dense"`` or ``"expert"``) in ``order``, fastest
    first: ``layout("tp-cp-ep-dp-pp", "expert")`` → ``("etp", "ep", "edp", "pp")``."""
    tokens = parse_order(order)
    if factorisation == "dense":
        return tuple(t for t in tokens if t != "ep")
    if factorisation == "expert":
        names = [_EXPERT_NAME[t] for t in tokens if t != "cp"]
        return tuple(names) if "ep" in names else tuple(names[:1] + ["ep"] + names[1:])
    raise ValueError(f"unknown factorisation {factorisation!r}")


def has_expert(sizes: Mapping[str, int]) -> bool:
    """True when ``sizes`` carries the expert factorisation (any of edp, ep, etp given)."""
    return any(sizes.get(d) is not None for d in EXPERT_ONLY)


def coords_of(rank: int, sizes: Mapping[str, int], order: str) -> dict[str, int]:
    """Coordinates of ``rank`` along every dim of ``sizes`` under ``order`` (both
    factorisations when ``sizes`` has expert dims). ``sizes`` maps dims to sizes ≥ 1; a
    dim it lacks has size 1. Raises ValueError for a bad ``order``."""
    out: dict[str, int] = {}
    for fact in ("dense", "expert") if has_expert(sizes) else ("dense",):
        rest = rank
        for d in layout(order, fact):
            s = int(sizes.get(d) or 1)
            out[d] = rest % s
            rest //= s
    return out


def rank_of(coords: Mapping[str, int], sizes: Mapping[str, int], order: str, factorisation: str = "dense") -> int:
    """Inverse of :func:`coords_of` for one factorisation: the rank at ``coords``."""
    rank, stride = 0, 1
    for d in layout(order, factorisation):
        rank += int(coords.get(d) or 0) * stride
        stride *= int(sizes.get(d) or 1)
    return rank
