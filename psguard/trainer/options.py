"""What ``psguard.CheckpointManager`` and ``psguard.keras.CheckpointCallback`` take beyond TF's and Keras'
arguments, as frozen dataclasses, and the keyword arguments they took before, still accepted for a release.

:class:`ManagerOptions` is flat (a job sets one or two fields: one import, one line); only the capture's tuning,
for benchmarks and tests, is nested (:class:`CaptureOptions`). Each old keyword argument warns with its new
spelling and still takes effect; given beside the same field of ``options`` it is refused (:class:`ConfigError`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, cast

from psguard.errors import ConfigError
from psguard.policy.engine import Retention
from psguard.policy.files import HangSpec

if TYPE_CHECKING:
    from psguard.store import Store

Opts = TypeVar("Opts")


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    """Tuning of the PS-side capture (:class:`~psguard.trainer.capture.Capturer`'s arguments), for benchmarks
    and tests. ``None``: the capturer's default, which its docstring states and measures."""

    #: Variables with fewer rows than this are captured whole, without row fingerprints.
    row_tracking_min_rows: int | None = None
    #: Bytes of a variable fingerprinted per PS call.
    hash_chunk_bytes: int | None = None
    #: Mark the rows the optimizer writes, so that a capture hashes only those (else every row, every save).
    track_writes: bool | None = None
    #: Every this many captures, hash every row to check the write marks against the values.
    verify_every: int | None = None
    #: Rows of an untracked variable sampled per capture to notice it changed.
    probe_rows: int | None = None
    #: PS task -> folder its agent reads the shards from (under an agent: the ones the agent announced).
    spill_dirs: Mapping[str, str] | None = None

    def capturer_kwargs(self) -> dict[str, Any]:
        """The fields set, as the capturer's keyword arguments."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True, kw_only=True)
class ManagerOptions:
    """``psguard.CheckpointManager``'s own settings (its ``options=``), as the user guide's table describes them.

    Capture: ``coordinator`` (``None``: the one on the variables' strategy), ``data_position``, ``capture``.
    Durable log: ``store`` (an open store, left open), ``storage_options``, ``retention``, ``new_base_after``
    (``0``: only when a policy asks; ``None``: 16, or the agent's ``max_chain``). Agent: ``spool`` (``None``:
    ``$PSGUARD_SPOOL``), ``restore_timeout``, ``hang``. Policy: ``watch_policy``, ``preemption``. ``summaries``:
    a folder for psguard's TensorBoard scalars.
    """

    coordinator: Any = None
    data_position: Callable[[], Any] | None = None
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    store: Store | None = None
    storage_options: Mapping[str, Any] | None = None
    retention: Retention | None = None
    new_base_after: int | None = None
    spool: str | os.PathLike[str] | None = None
    restore_timeout: float = 120.0
    hang: HangSpec | None = None
    watch_policy: bool = True
    preemption: bool = False
    summaries: str | os.PathLike[str] | None = None


@dataclass(frozen=True, kw_only=True)
class CallbackOptions:
    """``psguard.keras.CheckpointCallback``'s own settings (its ``options=``), for the manager it creates:
    ``max_to_keep`` (beside the best with ``monitor``), ``save_at_end``, ``summaries`` (``True``:
    ``<log_dir>/psguard`` of the fit's ``TensorBoard`` callback; a folder; ``False``) and ``manager``."""

    max_to_keep: int | None = None
    save_at_end: bool = True
    summaries: str | os.PathLike[str] | bool = True
    manager: ManagerOptions = field(default_factory=ManagerOptions)


class DeprecatedManagerArgs(TypedDict, total=False):
    """``CheckpointManager``'s keyword arguments before :class:`ManagerOptions` (each one warns)."""

    coordinator: Any
    retention: Retention | None
    watch_policy: bool
    storage_options: Mapping[str, Any] | None
    data_position: Callable[[], Any] | None
    new_base_after: int | None
    preemption: bool
    store: Store | None
    capturer_options: Mapping[str, Any] | None
    spool: str | os.PathLike[str] | None
    restore_timeout: float
    hang: HangSpec | None
    summaries: str | os.PathLike[str] | None


class DeprecatedCallbackArgs(TypedDict, total=False):
    """``CheckpointCallback``'s keyword arguments before :class:`CallbackOptions` (each one warns)."""

    save_every_n_steps: int | None
    max_to_keep: int | None
    storage_options: Mapping[str, Any] | None
    save_at_end: bool
    manager_options: Mapping[str, Any] | None
    summaries: str | os.PathLike[str] | bool


@dataclass(frozen=True)
class Moved(Generic[Opts]):
    """Where an old keyword argument went: the field at dotted ``path``, spelled ``spelling``, via ``convert``."""

    path: str
    spelling: str
    convert: Callable[[Any], Any] = lambda value: value

    def apply(self, options: Opts, name: str, value: Any) -> Opts:
        *outer, last = self.path.split(".")
        chain: list[Any] = [options]  # the options, then each nested options object down to the field's holder
        for part in outer:
            chain.append(getattr(chain[-1], part))
        f = next(f for f in dataclasses.fields(chain[-1]) if f.name == last)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(chain[-1], last) != default:
            raise ConfigError(
                f"`{name}=` (deprecated) and `options.{self.path}` are both given; give it once: {self.spelling}"
            )
        new = dataclasses.replace(chain[-1], **{last: self.convert(value)})
        for holder, part in zip(reversed(chain[:-1]), reversed(outer), strict=True):
            new = dataclasses.replace(holder, **{part: new})
        return cast(Opts, new)


def deprecation(name: str, spelling: str) -> str:
    """The warning an old keyword argument gives: what to write instead, exactly."""
    return f"`{name}=` is deprecated; use `{spelling}`"


def apply_deprecated(
    options: Opts, given: Mapping[str, Any], moves: Mapping[str, Moved[Opts]], *, callee: str, stacklevel: int = 3
) -> Opts:
    """``options`` with each old keyword argument in ``given`` moved to its field, each warned about at the
    caller's line (``stacklevel``: this function, the ``__init__`` calling it, the user's code)."""
    unknown = sorted(set(given) - set(moves))
    if unknown:
        raise TypeError(f"{callee}() got an unexpected keyword argument {unknown[0]!r}")
    # A whole nested options object (``manager_options``) before the fields inside it, so that a clash names both.
    for name in sorted(given, key=lambda n: moves[n].path.count(".")):
        move = moves[name]
        warnings.warn(deprecation(name, move.spelling), DeprecationWarning, stacklevel=stacklevel)
        options = move.apply(options, name, given[name])
    return options


def _known(what: str, mapping: Mapping[str, Any] | None, known: Collection[str]) -> dict[str, Any]:
    """``mapping`` as a dict, once each of its keys is ``known`` (else a :class:`ConfigError` naming it)."""
    if unknown := sorted(set(mapping or {}) - set(known)):
        raise ConfigError(f"{what}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return dict(mapping or {})


#: ``CheckpointManager``'s old keyword arguments and where each went (``capturer_options``: a mapping).
MANAGER_MOVES: dict[str, Moved[ManagerOptions]] = {
    name: Moved(name, f"options=psguard.ManagerOptions({name}=...)")
    for name in DeprecatedManagerArgs.__annotations__
    if name != "capturer_options"
}
MANAGER_MOVES["capturer_options"] = Moved(
    "capture",
    "options=psguard.ManagerOptions(capture=psguard.trainer.options.CaptureOptions(...))",
    lambda mapping: CaptureOptions(
        **_known("capturer_options", mapping, [f.name for f in dataclasses.fields(CaptureOptions)])
    ),
)


def manager_options_from(mapping: Mapping[str, Any] | None) -> ManagerOptions:
    """The Keras callback's old ``manager_options`` mapping (the manager's old keyword arguments) as
    :class:`ManagerOptions`."""
    options = ManagerOptions()
    for name, value in _known("manager_options", mapping, MANAGER_MOVES).items():
        options = MANAGER_MOVES[name].apply(options, name, value)
    return options


#: ``CheckpointCallback``'s old keyword arguments that went into :class:`CallbackOptions` (``save_every_n_steps``
#: went to ``save_freq``: the callback moves it itself).
CALLBACK_MOVES: dict[str, Moved[CallbackOptions]] = {
    name: Moved(name, f"options=psguard.keras.CallbackOptions({name}=...)")
    for name in ("max_to_keep", "save_at_end", "summaries")
}
CALLBACK_MOVES["storage_options"] = Moved(
    "manager.storage_options",
    "options=psguard.keras.CallbackOptions(manager=psguard.ManagerOptions(storage_options=...))",
)
CALLBACK_MOVES["manager_options"] = Moved(
    "manager", "options=psguard.keras.CallbackOptions(manager=psguard.ManagerOptions(...))", manager_options_from
)
