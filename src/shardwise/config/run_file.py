"""The one configuration schema for files and the command line.

Owns: `Config` (sections parallel, train, optimizer, scheduler, runner; the optimizer
section's own class lives in optimizer.py, its error in errors.py) and the machinery
every schema shares: strict loading from YAML (`yaml.safe_load`), `section.key=value`
overrides, dumping back to YAML, and the Markdown reference generated from the fields'
docstrings (so the reference in docs/configuration.md cannot drift).

Strictness: an unknown key is an error listing the valid keys and the closest match; a
value of the wrong type names the field and the expected type; each section's own
validation (e.g. ParallelConfig's) then runs as usual. In the parallel section a string
for a closed set (a `Literal` field) is left to ParallelConfig, which translates the set's
other spellings (strategy: FULL_SHARD) and names the allowed values otherwise.

Must not: read environment variables or start anything.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import inspect
import itertools
import math
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin

import torch
import yaml

from shardwise.config.adapters import AdapterConfig
from shardwise.config.errors import ConfigError as ConfigError
from shardwise.config.errors import check_choice
from shardwise.config.names import closest
from shardwise.config.optimizer import FallbackConfig as FallbackConfig
from shardwise.config.optimizer import OptimizerConfig as OptimizerConfig
from shardwise.config.optimizer import OptimizerName as OptimizerName
from shardwise.config.parallel import ParallelConfig
from shardwise.config.training import RunnerConfig, TrainConfig
from shardwise.config.vocabulary import FOREIGN_WORDS, PLACEMENT_WORDS, integral, translate

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")


SchedulerName = Literal["none", "constant", "cosine", "linear"]


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: SchedulerName = "none"
    """'none' keeps the optimizer's lr; the others add linear warm-up, then decay."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to the peak lr."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (cosine, linear), in [0, 1]."""

    def __post_init__(self) -> None:
        check_choice(self.name, SchedulerName, "scheduler.name")
        w = self.warmup_steps
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ConfigError(f"scheduler.warmup_steps={w!r} must be an int >= 0 (0: no warm-up).")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (the final lr "
                "as a fraction of the peak; a negative ratio would give a negative lr)."
            )

    def build(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        if self.name == "none":
            return None
        warmup, floor, name = self.warmup_steps, self.min_lr_ratio, self.name

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if name == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            decay = 0.5 * (1 + math.cos(math.pi * progress)) if name == "cosine" else 1 - progress
            return floor + (1 - floor) * decay

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass(kw_only=True)
class Config:
    """Everything a training job needs besides the model and data."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Strategy, mesh, precision, wrap planning."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Accumulation, clipping, loss scaling."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The learning-rate schedule."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Loops, logging and checkpoints."""
    adapter: AdapterConfig | None = None
    """LoRA adapters added before wrapping (None: the whole model trains)."""


# --- from plain data -------------------------------------------------------------------------


def _type_name(tp: Any, none: str = "null") -> str:
    """A type as people read it: "int | null" in errors about YAML values; the config
    reference passes none="None"."""
    if tp is type(None):
        return none
    if isinstance(tp, list):  # Callable's parameters
        return f"[{', '.join(_type_name(a, none) for a in tp)}]"
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a, none) for a in get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(a, none) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


_SEQUENCES = (
    tuple,
    list,
    collections.abc.Iterable,
    collections.abc.Collection,
    collections.abc.Sequence,
)


def _coerce(value: Any, tp: Any, path: str, translates: bool = False) -> Any:
    """`value` checked (and lightly converted: int->float, list->tuple) against `tp`.

    `translates`: the section translates other spellings of its closed sets (ParallelConfig:
    FULL_SHARD, bf16-mixed), so a string outside a `Literal` is left to it."""
    if tp is Any or tp is object:
        return tuple(value) if isinstance(value, list) else value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        arm_error = None
        for arm in get_args(tp):
            try:
                return _coerce(value, arm, path, translates)
            except ConfigError as exc:
                if (isinstance(value, (list, tuple)) and get_origin(arm) in _SEQUENCES) or (
                    isinstance(value, str) and get_origin(arm) is Literal
                ):
                    arm_error = exc  # the arm of the value's kind says what is wrong
                continue
        if arm_error is not None:
            raise arm_error
        if not _file_can_hold(tp):
            # The field also takes Python objects (a DeviceMesh, module classes, callables):
            # its section's own error names every accepted form, and which a file cannot give.
            return tuple(value) if isinstance(value, list) else value
        raise ConfigError(
            f"{path}: expected {_type_name(tp)}, got {type(value).__name__} ({value!r})."
        )
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        if translates and isinstance(value, str) and all(isinstance(c, str) for c in choices):
            return value  # the section translates it, or refuses it naming the allowed values
        hint = closest(str(value), [str(a) for a in choices])
        raise ConfigError(f"{path}={value!r} is not allowed.{hint} Choose one of {list(choices)}.")
    if tp is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, Mapping):
            return from_dict(tp, value, path)
    elif origin in _SEQUENCES:
        if isinstance(value, (list, tuple)):
            args = get_args(tp)
            fixed = origin is tuple and args and args[-1] is not Ellipsis
            if fixed and len(args) != len(value):
                raise ConfigError(
                    f"{path}: expected {len(args)} values ({_type_name(tp)}), got {len(value)}."
                )
            items = (
                [
                    _coerce(v, args[i] if fixed else args[0], f"{path}[{i}]", translates)
                    for i, v in enumerate(value)
                ]
                if args
                else list(value)
            )
            return items if origin is list else tuple(items)
    elif origin in (dict, collections.abc.Mapping) or tp in (dict, collections.abc.Mapping):
        if isinstance(value, Mapping):
            return dict(value)
    elif origin is collections.abc.Callable:
        if callable(value):
            return value
    elif origin is type:
        if isinstance(value, type) and issubclass(value, get_args(tp)[0]):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, (float, str)):
            # 1e7 is an int count written as a float (YAML 1.1 even reads it as text).
            try:
                return integral(value, path, text=True)
            except TypeError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads 1e-4, without a dot, as a string.
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} ({value!r}).")


_PLAIN_DATA = (str, int, float, bool, type(None), list, tuple, dict)


def _file_can_hold(tp: Any) -> bool:
    """Whether every form of `tp` is plain data a YAML file can write (no Python objects)."""
    origin = get_origin(tp)
    if tp is Any or tp is object or origin is Literal:
        return True
    if origin in (Union, types.UnionType, dict, collections.abc.Mapping, *_SEQUENCES):
        return all(_file_can_hold(a) for a in get_args(tp) if a is not Ellipsis)
    return tp in _PLAIN_DATA


def _fields(cls: type[Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "", base: Any = None) -> T:
    """Build the dataclass `cls` from plain data, strictly (see the module docstring).

    Keys not given keep `base`'s values, or the field defaults; a nested section given
    in part keeps its own defaults (e.g. the demo's) for the rest.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{path or 'config'}: expected a mapping of keys, got {type(data).__name__}."
        )
    fields = _fields(cls)
    defaults = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    if base is not None:
        kwargs = {name: getattr(base, name) for name in fields}
    if cls is ParallelConfig and FOREIGN_WORDS & set(data):
        data = _translate_words(data, path)
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key in PLACEMENT_WORDS:  # checked by wrap against this rank's device
            kwargs[key] = value
            continue
        if key not in fields:
            raise _unknown_key(cls, key, path)
        tp = fields[key]
        optional = _optional_section(tp)
        if optional is not None and value is not None and not isinstance(value, Mapping):
            raise ConfigError(
                f"{where}: expected a section (a mapping of keys, or null for none), got "
                f"{type(value).__name__} ({value!r})."
            )
        plain_section = dataclasses.is_dataclass(tp) and isinstance(tp, type)
        section = optional or (tp if plain_section else None)
        if section is not None and isinstance(value, Mapping):  # given in part: keeps the rest
            section_base = kwargs[key] if key in kwargs else _field_default(defaults[key])
            kwargs[key] = from_dict(section, value, where, base=section_base)
            continue
        kwargs[key] = _coerce(value, tp, where, translates=cls is ParallelConfig)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _unknown_key(cls: type[Any], key: object, path: str) -> ConfigError:
    """`key` is no field of `cls` (the section at `path`): the closest key, the valid ones."""
    fields, known_as = _fields(cls), getattr(cls, "KNOWN_AS", {}).get(key)  # other tools' names
    hint = f" Did you mean {known_as!r}?" if known_as else closest(str(key), fields)
    where, where_in = (f"{path}.{key}", f" in {path}") if path else (str(key), "")
    return ConfigError(f"unknown key {where!r}.{hint} Valid keys{where_in}: {sorted(fields)}.")


def _optional_section(tp: Any) -> type | None:
    """The section class of a section that may be absent (`AdapterConfig | None`), else None."""
    if get_origin(tp) not in (Union, types.UnionType) or type(None) not in get_args(tp):
        return None
    arms = [a for a in get_args(tp) if a is not type(None)]
    section = arms[0] if len(arms) == 1 else None
    return section if isinstance(section, type) and dataclasses.is_dataclass(section) else None


def _translate_words(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Other systems' words in a parallel section, as ParallelConfig fields (before the
    section is merged over its defaults, so `sharding_strategy` replaces `strategy`)."""
    try:
        values, placement = translate(dict(data))
    except ValueError as exc:
        raise ConfigError(f"{path or 'parallel'}: {exc}") from None
    return {**values, **placement}


def to_dict(config: DataclassInstance) -> dict[str, Any]:
    """Plain data (what YAML can hold) for a dataclass config; the inverse of from_dict."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.init:
            out[f.name] = _plain(getattr(config, f.name), f.name)
    return out


def _plain(value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v, where) for v in value)
    if isinstance(value, Mapping):
        return {k: _plain(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type):
        return value.__name__  # module classes (wrap policies) by name
    raise ConfigError(f"{where}={value!r} cannot be written to YAML; use names and numbers.")


# --- files and overrides -----------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (['section', 'key'], value); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value.")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(
            f"override {text!r}: {key!r} is not a dotted key such as runner.max_steps."
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc}).") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of `data` with each override set (creating sections as needed)."""
    result: dict[str, Any] = _deep_copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section.")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently: a second `runner:` section replaced the first whole)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.name}: key {key!r} appears twice in the same mapping, on lines "
                    f"{seen[key]} and {line}; YAML would silently keep only the second. "
                    "Keep one of them."
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str, path: str | Path) -> Any:
    """The YAML in `text` (from `path`) with the safe loader, a key given twice refused."""
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    finally:
        loader.dispose()


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    cls: type[T] = Config,  # type: ignore[assignment]
) -> T:
    """A config of type `cls` from an optional YAML file plus `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        loaded = read_yaml(text, path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}."
            )
        data = loaded or {}
    return from_dict(cls, apply_overrides(data, overrides))


def dump_config(config: DataclassInstance) -> str:
    """`config` (a Config, or any config dataclass) as YAML that `load_config` reads back."""
    return str(yaml.safe_dump(to_dict(config), sort_keys=False))


# --- the generated reference ---------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after it), read from the source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _reference_type(tp: Any) -> str:
    """A field's type for the reference: a closed set as "one of: a, b", other types by
    name ("int | None"), and a closed set with other types as "one of: a, b; or int"."""
    arms = list(get_args(tp)) if get_origin(tp) in (Union, types.UnionType) else [tp]
    values = [v for a in arms if get_origin(a) is Literal for v in get_args(a)]
    rest = [a for a in arms if get_origin(a) is not Literal]
    names = " | ".join(_type_name(a, none="None") for a in rest)
    if not values:
        return names
    choices = "one of: " + ", ".join(str(v) for v in values)
    return f"{choices}; or {names}" if names else choices


def reference_markdown(cls: type = Config) -> str:
    """The Markdown reference of every section and key of `cls`."""
    lines = []
    default, sections = cls(), _fields(cls)
    for section in dataclasses.fields(cls):
        given = getattr(default, section.name)
        sub = _optional_section(sections[section.name]) if given is None else type(given)
        if sub is None:
            continue  # a plain value at the top level: no section to list
        docs, absent = field_docs(sub), given is None
        given = sub() if absent else given
        note = f", absent by default: {field_docs(cls).get(section.name, '')}" if absent else ""
        lines += [
            f"### `{section.name}` ({sub.__name__}{note})",
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        hints = _fields(sub)
        for f in dataclasses.fields(sub):
            if not f.init:
                continue
            value = _plain(getattr(given, f.name), f.name)
            shown = (
                yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            )
            kind = _reference_type(hints[f.name]).replace("|", "\\|")
            doc = docs.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{section.name}.{f.name}` | `{kind}` | `{shown}` | {doc} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


REFERENCE_PAGE = "docs/configuration.md"
"""The page that holds the generated reference (the default of `--update`)."""
REFERENCE_BEGIN = (
    "<!-- BEGIN CONFIG REFERENCE "
    f"(generated by `shardwise config reference --update {REFERENCE_PAGE}`) -->"
)
REFERENCE_END = "<!-- END CONFIG REFERENCE -->"


def update_reference(doc: str | Path = REFERENCE_PAGE, cls: type = Config) -> bool:
    """Rewrite the generated block in the Markdown file `doc`; True if it changed."""
    path = Path(doc)
    text = path.read_text()
    if REFERENCE_BEGIN not in text or REFERENCE_END not in text:
        raise ConfigError(
            f"{path} has no generated-reference markers "
            f"({REFERENCE_BEGIN!r} ... {REFERENCE_END!r})."
        )
    head, rest = text.split(REFERENCE_BEGIN, 1)
    _, tail = rest.split(REFERENCE_END, 1)
    new = f"{head}{REFERENCE_BEGIN}\n\n{reference_markdown(cls)}\n{REFERENCE_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text
