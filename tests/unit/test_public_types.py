"""`shardwise`'s public callables name real types: `Any` appears in a signature only where
anything truly goes, each place listed below with the reason.

Annotations are resolved in their defining module, aliases included (an alias hiding `Any`,
such as `Callable[[], Any]`, counts); one naming a TYPE_CHECKING-only import is read as text.
"""

from __future__ import annotations

import inspect
import re
import sys
import typing

import shardwise

ALLOWED_ANY: dict[str, str] = {
    "pack.tokenize": (
        "called with one document, whatever the stream yields (a dict from datasets, a "
        "str, ...): Callable[[object], ...] would refuse a function typed for the user's own"
    ),
    "load_checkpoint.return": (
        "the manifest, JSON read back from the checkpoint: counters, configs and the user's "
        "`extra`, of any JSON type"
    ),
    "PendingCheckpoint.manifest": (
        "built by save_checkpoint only: the manifest it will write, JSON of any JSON type"
    ),
    "PendingCheckpoint.written": (
        "built by save_checkpoint only: DCP's own future (torch types it Future[Any]); its "
        "value is never read"
    ),
    "Runner.train_data": (
        "a sample is whatever the model takes, passed on untouched (Dataset[object] would say "
        "the same, as Dataset and DataLoader are covariant: to change with runner.py)"
    ),
    "Runner.val_data": "as Runner.train_data",
    "Runner.test_data": "as Runner.train_data",
    "Runner.evaluate": (
        "EvaluateFn(outputs, batch): the model's outputs and the user's batch, of any type"
    ),
}


def _resolve(annotation: object, module: object) -> object:
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, vars(module))
    except NameError:  # a TYPE_CHECKING-only name: read the text
        return annotation


def _has_any(tp: object) -> bool:
    if tp is typing.Any:
        return True
    if isinstance(tp, str):
        return re.search(r"\bAny\b", tp) is not None
    if isinstance(tp, (list, tuple)):  # Callable's parameter list
        return any(_has_any(a) for a in tp)
    return any(_has_any(a) for a in typing.get_args(tp))


def _signatures() -> dict[str, tuple[inspect.Signature, object]]:
    found = {}
    for name in shardwise.__all__:
        obj = getattr(shardwise, name)
        if not callable(obj):
            continue
        try:
            signature = inspect.signature(obj)
        except ValueError:  # exceptions keeping BaseException's own __init__
            continue
        target = inspect.unwrap(obj.__init__ if isinstance(obj, type) else obj)
        module = sys.modules[getattr(target, "__module__", None) or obj.__module__]
        found[name] = (signature, module)
    return found


def _any_in_signatures() -> set[str]:
    places = set()
    for name, (signature, module) in _signatures().items():
        for param in signature.parameters.values():
            if param.annotation is not param.empty and _has_any(_resolve(param.annotation, module)):
                places.add(f"{name}.{param.name}")
        returned = signature.return_annotation
        if returned is not signature.empty and _has_any(_resolve(returned, module)):
            places.add(f"{name}.return")
    return places


def test_public_signatures_have_no_any_but_the_listed():
    places = _any_in_signatures()
    unlisted = sorted(places - set(ALLOWED_ANY))
    assert not unlisted, (
        f"{unlisted} say Any: name the real type (a TYPE_CHECKING import, or a Protocol where "
        "a layer may not import it), `object` where anything is accepted and checked, or add "
        "the place to ALLOWED_ANY with the reason"
    )
    stale = sorted(set(ALLOWED_ANY) - places)
    assert not stale, f"{stale} no longer say Any: remove them from ALLOWED_ANY"


def test_the_scan_sees_the_signatures_and_finds_any():
    signatures = _signatures()
    assert {"wrap", "save_checkpoint", "Engine", "ParallelConfig", "print0"} <= set(signatures)
    assert "model" in signatures["save_checkpoint"][0].parameters
    assert _has_any(typing.Callable[[], typing.Any]) and _has_any("dict[str, Any]")
    assert not _has_any(typing.Callable[[], object]) and not _has_any("AnyOtherName")
